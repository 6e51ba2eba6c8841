"""Where a generator's slots spend the time generation is not paused (the benchmark's breakdown).

A run has ``num_process`` slots. While the gate is open each slot-second is one of:

- ``held``: a sample's task holds it: at the engine (the gate's ``busy_s``, its requests in
  flight) or not (its reward, its write, the client between two requests);
- ``admission``: free, while the run waits on admission's answer though there was room (a
  round trip to the service, for a generator in another process);
- ``bound``: free, while admission had no room: the trainer will not read another group in
  time (the staleness bound);
- ``plan``: free, while the run waits for its next sample (a worker claims its samples from
  the service in chunks, ``buffer.toolkit.leased``);
- ``other``: free for another reason (the event loop has not yet run the run's loop, the plan
  is spent).

The time paused is no slot's: the gate's ``paused_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from buffer.policy.gate import Gate

T = TypeVar("T")
KINDS = ("held", "admission", "bound", "plan", "other")


class SlotTime:
    """The integral of a run's slots over the gate's open time, by what they did; thread-safe."""

    def __init__(self, gate: Gate | None, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._gate = gate
        self._slots = slots
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()
        self.held = 0
        self._waiting: str | None = None  # what the run's loop awaits: "admission", "plan"
        self._admitting_from = 0.0
        self._admitting_at = 0.0
        self.seconds = dict.fromkeys(KINDS, 0.0)

    def _account(self, now: float) -> None:
        span = now - self._since
        if self._gate is not None and span > 0:
            span -= self._gate.paused_between(self._since, now)
        self._since = now
        if span <= 0:
            return
        self.seconds["held"] += span * self.held
        free = max(0, self._slots - self.held)
        self.seconds[self._waiting or "other"] += span * free

    def took(self) -> None:
        """A sample's task took a slot."""
        with self._lock:
            self._account(self._clock())
            self.held += 1

    def freed(self) -> None:
        with self._lock:
            self._account(self._clock())
            self.held -= 1

    def admitting(self) -> None:
        """The run waits on admission from now."""
        with self._lock:
            self._account(self._clock())
            self._waiting = "admission"
            self._admitting_from = self.seconds["admission"]
            self._admitting_at = self._since

    def admitted(self, bound_s: float) -> None:
        """Admission answered; it had no room for ``bound_s`` of the wait: that share of the
        wait's free slot-seconds was the bound's, the rest its round trip."""
        with self._lock:
            self._account(self._clock())
            self._waiting = None
            waited_s = self._since - self._admitting_at
            share = min(1.0, bound_s / waited_s) if waited_s > 0 else 0.0
            moved = (self.seconds["admission"] - self._admitting_from) * share
            self.seconds["admission"] -= moved
            self.seconds["bound"] += moved

    async def samples(self, samples: AsyncIterator[T]) -> AsyncIterator[T]:
        """``samples``, the time waited for each counted as the plan's."""
        while True:
            self._wait("plan")
            try:
                sample = await anext(samples)
            except StopAsyncIteration:
                return
            finally:
                self._wait(None)
            yield sample

    def _wait(self, kind: str | None) -> None:
        with self._lock:
            self._account(self._clock())
            self._waiting = kind

    def snapshot(self) -> dict[str, float]:
        """Slot-seconds by kind, while open; ``open`` is their sum (``slots`` x open seconds)."""
        with self._lock:
            self._account(self._clock())
            seconds = {kind: round(value, 4) for kind, value in self.seconds.items()}
        return {**seconds, "open": round(sum(self.seconds.values()), 4)}
