"""The errors the client raises when the buffer does not answer a request usably.

    BufferClientError              the base: url, status_code, message, errors, body
    ├── BufferRequestError         a 4xx other than 429: the request is wrong (not retried)
    └── BufferUnavailableError     transport errors, timeouts, 429 and 5xx, once retries run out

A 429 or 5xx is first raised as ``RetryableStatus`` (``buffer.trainer.client.retries``), an internal
signal to retry that becomes ``BufferUnavailableError`` when the attempts run out.
"""

from __future__ import annotations

from typing import Any


class BufferClientError(Exception):
    """The buffer did not answer a request usably.

    ``message`` is the server's own message when it sent one; ``status_code`` is the last
    HTTP status (``None`` when no answer came); ``errors`` the fields the server named
    (``[{"field", "reason"}]`` on a 422); ``body`` the decoded error answer, if any.
    """

    def __init__(
        self,
        description: str,
        *,
        url: str,
        status_code: int | None = None,
        message: str = "",
        errors: list[Any] | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(description)
        self.url = url
        self.status_code = status_code
        self.message = message or description
        self.errors = errors or []
        self.body = body


class BufferRequestError(BufferClientError):
    """A 4xx other than 429: the request is wrong (an unknown task, an invalid field); not retried."""


class BufferUnavailableError(BufferClientError):
    """Transport errors, timeouts, 429 or 5xx, still failing once the retries ran out."""
