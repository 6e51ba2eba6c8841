"""What both clients share besides their I/O: configuration, request and retry options, failures.

``ClientBase`` holds the base URL, headers, timeout and retry settings, and turns a ``Call``
into ``httpx`` request options, a retried failure into ``BufferUnavailableError``, and an
answer into the call's typed result (or ``BufferClientError`` when it cannot be read).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import httpx
import orjson
from tenacity import retry_if_exception_type, stop_after_attempt

from buffer.client.calls import Call
from buffer.client.errors import BufferClientError, BufferUnavailableError
from buffer.client.retries import RetryableStatus, RetryWait, log_retry

_T = TypeVar("_T")

#: Where a client finds the key when none is passed: one variable for a trainer and its generators.
API_KEY_VARIABLE = "ROLLOUT_BUFFER_API_KEY"


def key_or_env(api_key: str | None) -> str | None:
    """``api_key``; when it is None, the ``ROLLOUT_BUFFER_API_KEY`` variable (None if unset)."""
    return os.environ.get(API_KEY_VARIABLE) if api_key is None else api_key


class ClientBase:
    """Configuration and the pure parts of both clients."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout_s: float,
        max_attempts: int,
        backoff_s: float,
        max_backoff_s: float,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {max_attempts}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        api_key = key_or_env(api_key)
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"

    def _retry_options(self) -> dict[str, Any]:
        """For tenacity's ``Retrying`` and ``AsyncRetrying`` alike."""
        return {
            "stop": stop_after_attempt(self.max_attempts),
            "wait": RetryWait(self._backoff_s, self._max_backoff_s),
            "retry": retry_if_exception_type((RetryableStatus, httpx.TransportError)),
            "before_sleep": log_retry,
            "reraise": True,
        }

    def _request_options(self, call: Call[Any]) -> dict[str, Any]:
        content = orjson.dumps(call.body) if call.body is not None else None
        return {"content": content, "timeout": self.timeout_s + call.wait_s}

    def _gave_up(self, call: Call[Any], exc: Exception) -> BufferUnavailableError:
        url = self.base_url + call.path
        attempts = f"{self.max_attempts} attempt{'s' if self.max_attempts > 1 else ''}"
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
