"""Failing a run fast when the engine is misconfigured, not one trajectory at a time.

A wrong model name (vLLM answers 404), a wrong key (401/403) or a request every answer refuses
with the same 4xx is no trajectory's fault: without this, a run wrote each of its samples as a
failed trajectory (24,519 in 20 s) and the engine's message was logged nowhere. Now the run stops
with ``MisconfiguredEngine``, whose message (the engine's own words) the job shows. A 500 the
engine gave a request the same way every time (``llm.RetryPolicy.same_error_limit``) counts as
such a refusal too.
"""

from __future__ import annotations

from buffer.toolkit.llm import LLMError

#: Statuses no later request will answer differently: fatal at once.
FATAL_STATUS = frozenset({401, 403, 404})


class MisconfiguredEngine(Exception):
    """The policy server refuses every request: the run stops."""


class FailFast:
    """Watches the outcome of each trajectory's requests.

    Fatal: a 401, 403 or 404; or, before any trajectory of the run has succeeded, ``after`` in
    a row failing with the same other refusal (a 4xx, or a 500 the engine gives the same way
    every time). Once one has succeeded, the engine is known to work: a 400 for an over-long
    prompt is that prompt's, and stays that trajectory's failure."""

    def __init__(self, after: int = 20) -> None:
        self.after = after
        self.status: int | None = None
        self.in_a_row = 0
        self.ever_succeeded = False

    def succeeded(self) -> None:
        self.status, self.in_a_row = None, 0
        self.ever_succeeded = True

    def failed(self, error: BaseException) -> MisconfiguredEngine | None:
        """The error that ends the run, if ``error`` shows the engine is misconfigured."""
        if not isinstance(error, LLMError) or error.status is None or not 400 <= error.status < 600:
            self.status, self.in_a_row = None, 0  # not a refusal: an outage has its own retries
            return None
        if error.status == self.status:
            self.in_a_row += 1
        else:
            self.status, self.in_a_row = error.status, 1
        if error.status in FATAL_STATUS or (self.in_a_row >= self.after and not self.ever_succeeded):
            times = "" if self.in_a_row == 1 else f" ({self.in_a_row} requests in a row)"
            said = error.engine_message or str(error)
            return MisconfiguredEngine(
                f"the policy server refused the request with HTTP {error.status}{times}: {said}"
            )
        return None
