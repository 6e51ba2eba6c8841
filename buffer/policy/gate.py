"""The gate every engine request passes: closed while the trainer updates the weights."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from buffer.signal import Signal

#: The versions the requests of the current rollout started under, in order (``recording``).
_versions: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("policy_versions", default=None)
#: Whether a request starting under a version can still be served (``guard``).
_guard: contextvars.ContextVar[Callable[[int], bool] | None] = contextvars.ContextVar(
    "stale_guard", default=None
)


class StaleWork(asyncio.CancelledError):
    """The request's group can no longer be served: the trainer is more than ``max_staleness``
    versions past the lowest version it started under. A cancellation (``CancelledError``), so
    no ``except Exception`` of a rollout takes it for a failure."""


def recording() -> list[int]:
    """Start recording, in this context (one rollout's task), the version each engine request
    starts under; the list returned fills as requests pass the gate."""
    versions: list[int] = []
    _versions.set(versions)
    return versions


def guard(is_stale: Callable[[int], bool]) -> None:
    """In this context (one sample's task), ``is_stale(version)`` is asked before each engine
    request starts: True raises ``StaleWork`` at the gate, before anything reaches the engine."""
    _guard.set(is_stale)


@dataclass(slots=True)
class GateStats:
    """Time paused, and how full the engines were kept while open (for the benchmark)."""

    pauses: int = 0
    paused_s: float = 0.0
    open_s: float = 0.0
    #: The integral of requests in flight over open time: ``busy_s / open_s`` is the mean.
    busy_s: float = 0.0
    requests: int = 0


class Gate:
    """Pause and resume for the engine clients of in-process generators.

    ``enter`` waits while paused and returns the policy version the request starts under;
    ``leave`` ends it. ``paused_between`` tells a retry budget how much of a span was paused,
    so no wall-clock budget runs out while the trainer holds the engines."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._opened = Signal()
        self._idle = Signal()
        #: Notified when the version changes (a run's stale work is cancelled then).
        self.versioned = Signal()
        self._version: int | None = None  # until the trainer says one
        #: Pauses so far, never reset (``reset_stats`` resets ``stats``): an answer aborted while
        #: this moved was aborted by a pause, which no continuation budget counts.
        self.closures = 0
        self.paused = False
        self.in_flight = 0
        self.stats = GateStats()
        self._since = clock()
        #: (start, end) of each pause, end None while paused; for ``paused_between``.
        self._pauses: list[tuple[float, float | None]] = []

    @property
    def version(self) -> int | None:
        return self._version

    @version.setter
    def version(self, version: int | None) -> None:
        changed = version != self._version
        self._version = version
        if changed:
            self.versioned.notify()

    def _account(self, now: float) -> None:
        span = now - self._since
        if self.paused:
            self.stats.paused_s += span
        else:
            self.stats.open_s += span
            self.stats.busy_s += span * self.in_flight
        self._since = now

    async def enter(self) -> int | None:
        """Wait until the gate is open, count the request in flight, return the version."""
        while True:
            with self._lock:
                if not self.paused:
                    self._account(self._clock())
                    self.in_flight += 1
                    self.stats.requests += 1
                    version = self.version
                    break
                ticket = self._opened.ticket()  # under the lock: a resume cannot slip past
            await ticket.wait(5.0)
        if version is not None and (is_stale := _guard.get()) is not None and is_stale(version):
            self.leave()
            raise StaleWork(f"the trainer is at version {version}: this group can no longer be served")
        if (versions := _versions.get()) is not None:
            versions.append(0 if version is None else version)  # 0: before the trainer said one
        return version

    def leave(self) -> None:
        with self._lock:
            self._account(self._clock())
            self.in_flight -= 1
            idle = self.in_flight == 0
        if idle:
            self._idle.notify()

    def pause(self) -> bool:
        """Close the gate; False when it already was."""
        with self._lock:
            if self.paused:
                return False
            now = self._clock()
            self._account(now)
            self.paused = True
            self.stats.pauses += 1
            self.closures += 1
            self._pauses.append((now, None))
            del self._pauses[:-1000]
            return True

    def resume(self, version: int | None = None) -> None:
        with self._lock:
            if version is not None:
                self.version = version
            if self.paused:
                now = self._clock()
                self._account(now)
                self.paused = False
                start, _ = self._pauses[-1]
                self._pauses[-1] = (start, now)
        self._opened.notify()

    def is_paused(self) -> bool:
        return self.paused

    async def wait_resumed(self, timeout_s: float) -> bool:
        """True once the gate is open, False when ``timeout_s`` passed first (the gateway's
        ``PauseGate``: a call waits that long, then answers 503)."""
        deadline = self._clock() + timeout_s
        while True:
            with self._lock:
                if not self.paused:
                    return True
                ticket = self._opened.ticket()  # under the lock: a resume cannot slip past
            left = deadline - self._clock()
            if left <= 0:
                ticket.cancel()
                return False
            await ticket.wait(min(left, 0.5))

    async def drained(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for no request to be in flight."""
        idle = self._idle
        return await idle.wait_until(lambda: self.in_flight <= 0, timeout_s, clock=self._clock, poll_s=0.5)

    def paused_between(self, start: float, end: float) -> float:
        """Seconds of [start, end] (``time.monotonic``) the gate was closed."""
        with self._lock:
            pauses = list(self._pauses)
        total = 0.0
        for begun, ended in reversed(pauses):
            stop = end if ended is None else min(ended, end)
            if stop <= start:
                break
            total += max(0.0, stop - max(begun, start))
        return total

    def reset_stats(self) -> None:
        """Count from now (a generator starts: the time before it is no idle engine)."""
        with self._lock:
            self.stats = GateStats(requests=0)
            self._since = self._clock()

    def snapshot(self) -> dict[str, float | int | bool]:
        with self._lock:
            self._account(self._clock())
            stats = self.stats
            return {
                "paused": self.paused,
                "in_flight": self.in_flight,
                "pauses": stats.pauses,
                "paused_s": round(stats.paused_s, 4),
                "open_s": round(stats.open_s, 4),
                "mean_in_flight_open": round(stats.busy_s / stats.open_s, 4) if stats.open_s else 0.0,
                "requests": stats.requests,
            }
