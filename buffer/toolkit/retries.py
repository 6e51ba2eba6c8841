"""How a failed request to the policy server is retried, and when it is not.

- transport errors (a refused or dropped connection), timeouts, 408, 409, 425, 429, 502, 503
  and 504 are retried (tenacity) for as long as ``RetryPolicy.max_retry_s`` allows, two minutes
  by default, so a policy server that restarts or is overloaded for a while is waited out; each
  wait is random (full jitter) up to an exponential backoff capped at ``max_backoff_s``, so a
  thousand requests in flight do not come back at once, and never shorter than a
  ``Retry-After``. Time the buffer's gate was closed (a weight update) spends no budget;
- a 500 is retried too, unless it comes back the same (status and the engine's message)
  ``RetryPolicy.same_error_limit`` times in a row, 3 by default: that is an error the engine
  gives the request every time (a validation error raised as a 500), which fails at once with
  the engine's message (``LLMError.status``, ``engine_message``) instead of for two minutes;
- any other 4xx is not retried: it is the request, or the engine's configuration.

The HTTP exchange itself is ``llm.EngineClient``'s; this module decides only what is tried again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_before_delay,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from buffer.policy.gate import Gate
from buffer.toolkit.engines import error_message
from buffer.toolkit.transport import Reply, Unreachable

#: Statuses retried however often they come: the server is restarting, overloaded, or asks to wait.
TRANSIENT_STATUS = frozenset({408, 409, 425, 429, 502, 503, 504})
#: Statuses retried: those, and a 500 while it does not come back the same (``RetryPolicy.same_error_limit``).
RETRYABLE_STATUS = TRANSIENT_STATUS | {500}
RETRY_AFTER_CAP_S = 60.0  # a server's Retry-After is honoured up to this


class LLMError(Exception):
    """The policy server did not answer usably, after any retries.

    ``status`` is the HTTP status of a refused request (a 4xx, not retried, or a 500 the engine
    gave the same way every time) and ``engine_message`` the engine's own words for it; both
    ``None`` for other failures (retries spent on an outage, an answer that is no JSON)."""

    def __init__(self, message: str, *, status: int | None = None, engine_message: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.engine_message = engine_message


class RetryableStatus(Exception):
    """An answer whose status is retried (``RETRYABLE_STATUS``)."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(f"HTTP {reply.status}: {reply.text[:300]}")
        self.status = reply.status
        self.said = error_message(reply.body)
        self.retry_after_s = retry_after_s(reply.retry_after)


class SameError:
    """One request's failed attempts in a row: a 500 answered the same way ``limit`` times is
    the engine's answer to that request, not an outage (``RetryPolicy.same_error_limit``)."""

    __slots__ = ("count", "last", "limit")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.last: tuple[int, str] | None = None
        self.count = 0

    def check(self, exc: BaseException) -> None:
        """Count ``exc``; raise the ``LLMError`` to fail with once it is the same ``limit`` times."""
        if self.limit is None or not isinstance(exc, RetryableStatus) or exc.status in TRANSIENT_STATUS:
            self.last, self.count = None, 0
            return
        said = (exc.status, exc.said)
        self.count = self.count + 1 if said == self.last else 1
        self.last = said
        if self.count >= self.limit:
            times = "once" if self.count == 1 else f"{self.count} times in a row"
            raise LLMError(
                f"HTTP {exc.status} from the policy server, the same {times} (an error it gives this "
                f"request every time, not an outage): {exc.said}",
                status=exc.status,
                engine_message=exc.said,
            ) from exc


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failed request is retried: until ``max_retry_s`` have passed since it first failed
    (no further attempt starts after that), and at most ``max_attempts`` attempts if set. The
    n-th wait is random, between 0 and ``backoff_s * 2 ** (n - 1)`` capped at ``max_backoff_s``:
    the cap bounds how long a request waits after the server is back. ``max_retry_s=0``: no retry.

    A 500 answered the same way (status and the engine's message) ``same_error_limit`` times in
    a row is an error the engine gives that request every time: it fails then, with the engine's
    message (``None``: a 500 is retried as long as a 503).
    """

    max_retry_s: float = 120.0
    max_attempts: int | None = None
    backoff_s: float = 0.5
    max_backoff_s: float = 5.0
    same_error_limit: int | None = 3


def retrying(policy: RetryPolicy, gate: Gate | None, sent: list[int]) -> AsyncRetrying:
    """Tenacity's loop for one request under ``policy``: ``sent`` counts its HTTP requests, and
    time ``gate`` was closed is not counted."""
    stop: stop_base = stop_before_delay(policy.max_retry_s) if gate is None else StopOpenTime(policy, gate)
    if policy.max_attempts is not None:
        stop = stop | StopAfterSent(sent, policy.max_attempts)
    return AsyncRetrying(
        stop=stop,
        wait=Wait(policy.backoff_s, policy.max_backoff_s),
        retry=retry_if_exception(is_retryable),
        reraise=True,
    )


class StopOpenTime(stop_base):
    """``stop_before_delay`` on the time the gate was open: a pause spends no retry budget."""

    def __init__(self, policy: RetryPolicy, gate: Gate, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_s = policy.max_retry_s
        self._gate = gate
        self._clock = clock  # the gate's: ``paused_between`` takes its times
        self._started = clock()

    def __call__(self, retry_state: RetryCallState) -> bool:
        now = self._clock()
        open_s = now - self._started - self._gate.paused_between(self._started, now)
        return open_s + (retry_state.upcoming_sleep or 0.0) >= self._max_s


class Wait:
    """Exponential backoff with full jitter, but never shorter than the server's Retry-After."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self._jitter = wait_random_exponential(multiplier=backoff_s, max=max_backoff_s)

    def __call__(self, state: RetryCallState) -> float:
        wait: float = self._jitter(state)
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        if isinstance(error, RetryableStatus) and error.retry_after_s is not None:
            wait = max(wait, min(error.retry_after_s, RETRY_AFTER_CAP_S))
        return wait


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, (RetryableStatus, Unreachable))


class StopAfterSent(stop_base):
    """Stop once ``max_attempts`` HTTP requests were made (a move to another engine counts)."""

    def __init__(self, sent: list[int], max_attempts: int) -> None:
        self.sent = sent
        self.max_attempts = max_attempts

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.sent[0] >= self.max_attempts


def retry_after_s(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
