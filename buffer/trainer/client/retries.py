"""Which answers are retried, and how: an HTTP answer decoded or refused, backoff and Retry-After.

``decode`` turns a response into its JSON, raises ``BufferRequestError`` for a 4xx that
retrying cannot fix, and ``RetryableStatus`` for 408, 425, 429 and 5xx. Those and
``httpx.TransportError`` are retried by tenacity with ``RetryWait`` (exponential backoff
with full jitter, never shorter than the server's ``Retry-After``), logged by ``log_retry``.
"""

from __future__ import annotations

import email.utils
import logging
import time
from typing import Any

import httpx
import orjson
from tenacity import RetryCallState, wait_random_exponential

from buffer.trainer.client.errors import BufferClientError, BufferRequestError, BufferUnavailableError

logger = logging.getLogger(__name__)

RETRY_AFTER_CAP_S = 60.0  # a server's Retry-After is honoured up to this


class RetryableStatus(Exception):
    """A 429 or 5xx answer, retried; becomes ``BufferUnavailableError`` when retries run out."""

    def __init__(self, failure: BufferClientError, retry_after_s: float | None) -> None:
        super().__init__(str(failure))
        self.failure = failure
        self.retry_after_s = retry_after_s


def _is_retryable(status_code: int) -> bool:
    return status_code in (408, 425, 429) or status_code >= 500


def decode(response: httpx.Response) -> Any:
    """The answer's JSON; raises ``RetryableStatus`` (429, 5xx) or ``BufferRequestError``."""
    url = str(response.request.url)
    method = response.request.method
    if response.is_error:
        message, errors, body = _server_message(response)
        description = f"{method} {url}: HTTP {response.status_code}: {message}"
        if _is_retryable(response.status_code):
            failure = BufferUnavailableError(
                description,
                url=url,
                status_code=response.status_code,
                message=message,
                errors=errors,
                body=body,
            )
            raise RetryableStatus(failure, _retry_after_s(response))
        raise BufferRequestError(
            description, url=url, status_code=response.status_code, message=message, errors=errors, body=body
        )
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise BufferClientError(
            f"{method} {url}: HTTP {response.status_code} with invalid JSON: {response.text[:200]!r}",
            url=url,
            status_code=response.status_code,
        ) from exc


def _server_message(response: httpx.Response) -> tuple[str, list[Any], Any]:
    """The server's ``message`` and ``errors`` (or FastAPI's ``detail``), else the text."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:500] or response.reason_phrase, [], None
    if not isinstance(body, dict):
        return str(body)[:500], [], body
    detail = body.get("detail")
    message = body.get("message") or (detail if isinstance(detail, str) else "") or response.reason_phrase
    errors = body.get("errors") or (detail if isinstance(detail, list) else [])
    return str(message), list(errors) if isinstance(errors, list) else [errors], body


def _retry_after_s(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds, or as an HTTP date."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class RetryWait:
    """Exponential backoff with full jitter, but never shorter than the server's Retry-After."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self._jitter = wait_random_exponential(multiplier=backoff_s, max=max_backoff_s)

    def __call__(self, state: RetryCallState) -> float:
        wait_s: float = self._jitter(state)
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, RetryableStatus) and error.retry_after_s is not None:
            wait_s = max(wait_s, min(error.retry_after_s, RETRY_AFTER_CAP_S))
        return wait_s


def log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    sleep_s = state.next_action.sleep if state.next_action is not None else 0.0
    logger.warning(
        "rollout buffer request failed (attempt %d), retrying in %.2f s: %s",
        state.attempt_number,
        sleep_s,
        error,
    )
