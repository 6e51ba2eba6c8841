"""What both clients share besides their I/O: configuration, request and retry options, failures.

``ClientBase`` holds the base URL, headers, timeout and retry settings, and turns a ``Call``
into ``httpx`` request options, a retried failure into ``BufferUnavailableError``, and an
answer into the call's typed result (or ``BufferClientError`` when it cannot be read).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, TypeVar

import httpx
import orjson
from tenacity import retry_if_exception_type, stop_after_attempt, stop_before_delay, stop_never
from tenacity.stop import stop_base

from buffer.keys import key_or_env
from buffer.trainer.client.calls import Call
from buffer.trainer.client.errors import BufferClientError, BufferUnavailableError
from buffer.trainer.client.retries import RetryableStatus, RetryWait, log_retry

_T = TypeVar("_T")

#: How long a failing request is retried by default: longer than the service takes to restart
#: (a crash, a deploy, a journal to replay), so a trainer rides it out instead of dying.
DEFAULT_MAX_RETRY_S = 60.0


class ClientBase:
    """Configuration and the pure parts of both clients."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout_s: float,
        max_attempts: int | None,
        max_retry_s: float | None,
        backoff_s: float,
        max_backoff_s: float,
    ) -> None:
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {max_attempts}")
        if max_retry_s is not None and not max_retry_s >= 0:
            raise ValueError(f"max_retry_s must be >= 0, not {max_retry_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.max_retry_s = max_retry_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        api_key = key_or_env(api_key)
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"

    def _retry_options(self) -> dict[str, Any]:
        """For tenacity's ``Retrying`` and ``AsyncRetrying`` alike: retried until ``max_retry_s``
        would pass before the next attempt, or ``max_attempts`` were made, whichever comes first."""
        stops: list[stop_base] = []
        if self.max_attempts is not None:
            stops.append(stop_after_attempt(self.max_attempts))
        if self.max_retry_s is not None:
            stops.append(stop_before_delay(self.max_retry_s))
        return {
            "stop": functools.reduce(operator.or_, stops) if stops else stop_never,
            "wait": RetryWait(self._backoff_s, self._max_backoff_s),
            "retry": retry_if_exception_type((RetryableStatus, httpx.TransportError)),
            "before_sleep": log_retry,
            "reraise": True,
        }

    def _request_options(self, call: Call[Any]) -> dict[str, Any]:
        content = orjson.dumps(call.body) if call.body is not None else None
        return {"content": content, "timeout": self.timeout_s + call.wait_s}

    def _gave_up(self, call: Call[Any], exc: Exception, attempts_made: int) -> BufferUnavailableError:
        url = self.base_url + call.path
        attempts = f"{attempts_made} attempt{'s' if attempts_made > 1 else ''}"
        if isinstance(exc, RetryableStatus):
            last = exc.failure
            return BufferUnavailableError(
                f"{call.method} {url} failed after {attempts}; last: HTTP {last.status_code}: {last.message}",
                url=url,
                status_code=last.status_code,
                message=last.message,
                errors=last.errors,
                body=last.body,
            )
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return BufferUnavailableError(
            f"{call.method} {url} failed after {attempts}; last: {reason}", url=url, message=reason
        )

    def _parse(self, call: Call[_T], answer: Any) -> _T:
        try:
            return call.parse(answer)
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:  # ValidationError too
            url = self.base_url + call.path
            raise BufferClientError(
                f"{call.method} {url}: unexpected answer: {exc}", url=url, status_code=200, body=answer
            ) from exc
