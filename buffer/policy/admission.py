"""Demand-driven generation: a generator starts a group only when the trainer will want it.

Like AReaL's staleness manager (capacity ``(max_head_offpolicyness + version + 1) *
batch_size`` minus what is accepted or running) the bound is counted in trainer steps of
``batch_groups`` groups: a group started now, at version V, is served after the groups
*pending* before it (admitted, not yet served nor dropped), and the trainer serves what is left
of its batch at V, then one batch at each of V + 1 ... V + S; later it is stale. So a group is
admitted while::

    pending + served_at_this_version < (max_staleness + 1) * batch_groups

``served_at_this_version`` counts the trainer's current batch from the last version change (a
trainer that reads another batch at the same version reports no version per step: the count
starts again, never stopping generation for good). Before the trainer says any version nothing
is stale and it is 0: at most ``(S + 1) * batch_groups`` pending, as before.

``batch_groups`` is the trainer's batch: declared (``rollout_batch_size`` on ``/start_rollout``
or ``POST /policy``; slime's adapter sends it), else its largest read; before either, a first
guess (the job's ``num_process`` in groups) that the first read replaces. A group the dynamic
filter drops stops being pending at once and another is admitted in its place: generation
over-samples by exactly what the filter discards, at its measured rate, and no more. A
group the generator cancelled as stale in flight (``buffer.policy.stale``), nothing of it
written, stops being pending when the generator says so (``report_cancelled``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from buffer.signal import Signal


class Admits(Protocol):
    """What a generator awaits before each group: ``Admission``, or ``RemoteAdmission``."""

    async def admit(self) -> None: ...

    def cancelled(self, groups: int) -> None:
        """``groups`` more of the admitted groups were cancelled, nothing of them written."""


class Admission:
    """The admission of one task's generator; thread-safe."""

    def __init__(
        self,
        max_staleness: int | None,
        batch_groups: int,
        consumed: Callable[[], int],
        served: Callable[[], int] = lambda: 0,
        paused: Callable[[], bool] = lambda: False,
        *,
        declared: bool = False,
        versioned: bool = False,
    ) -> None:
        self.max_staleness = max_staleness
        self.batch_groups = max(1, batch_groups)
        #: The batch was declared by the trainer; otherwise a guess until its first read.
        self.declared = declared
        self._guess = not declared
        self._consumed = consumed
        self._served = served
        self._paused = paused
        self._baseline = consumed()
        self._served_base = served()
        #: The trainer has said a version: the served count is anchored at its changes.
        self._versioned = versioned
        self._lock = threading.Lock()
        self._signal = Signal()
        self.admitted = 0
        self.waits = 0
        #: Groups cancelled as stale in flight, by who cancelled them (each reports its total).
        self._cancelled: dict[str, int] = {}

    @property
    def capacity(self) -> int | None:
        """Groups pending and served at this version at most; None: no bound."""
        if self.max_staleness is None:
            return None
        return (self.max_staleness + 1) * self.batch_groups

    @property
    def cancelled_stale(self) -> int:
        return sum(self._cancelled.values())

    def outstanding(self) -> int:
        """Groups admitted and not yet gone: served, dropped, set aside, or cancelled."""
        return self.admitted - (self._consumed() - self._baseline) - self.cancelled_stale

    def served_at_version(self) -> int:
        """Groups of the trainer's current batch served since the version last changed: past one
        batch at the same version, the trainer reads another without saying a version. None
        while generation is paused: what is admitted then starts under the next version."""
        if not self._versioned or self._paused():
            return 0
        served = self._served() - self._served_base
        return 0 if served <= 0 else (served - 1) % self.batch_groups + 1

    def try_admit(self) -> bool:
        with self._lock:
            capacity = self.capacity
            if capacity is not None and self.outstanding() + self.served_at_version() >= capacity:
                return False
            self.admitted += 1
            return True

    async def admit(self) -> None:
        """Wait until one more group may start, and count it."""
        waited = False
        while True:
            ticket = self._signal.ticket()  # before the check: a notify cannot slip past
            if self.try_admit():
                ticket.cancel()
                return
            if not waited:
                self.waits += 1
                waited = True
            await ticket.wait(1.0)

    def cancelled(self, groups: int) -> None:
        """This process's generator cancelled ``groups`` more groups (``Admits``)."""
        with self._lock:
            self._cancelled["local"] = self._cancelled.get("local", 0) + groups
        self._signal.notify()

    def report_cancelled(self, worker: str, total: int) -> None:
        """``worker`` has cancelled ``total`` groups so far (a total: a report sent twice counts once)."""
        with self._lock:
            self._cancelled[worker] = max(total, self._cancelled.get(worker, 0))
        self._signal.notify()

    def declare(self, batch_groups: int) -> None:
        """The trainer says its batch: ``batch_groups`` groups a step."""
        with self._lock:
            self.batch_groups = max(1, batch_groups)
            self.declared = True
            self._guess = False
        self._signal.notify()

    def new_version(self) -> None:
        """The trainer's version changed: its next batch is counted from here."""
        with self._lock:
            self._versioned = True
            self._served_base = self._served()
        self._signal.notify()

    def saw_read(self, groups: int) -> None:
        """The trainer asked for ``groups`` groups: the batch is at least that (its first read
        replaces the guess; a declared batch stays)."""
        with self._lock:
            if not self.declared and (self._guess or groups > self.batch_groups):
                self.batch_groups = max(1, groups)
                self._guess = False
        self._signal.notify()

    def notify(self) -> None:
        """Something left the buffer: a waiting generator may go on."""
        self._signal.notify()

    def snapshot(self) -> dict[str, int | bool | None]:
        return {
            "max_staleness": self.max_staleness,
            "batch_groups": self.batch_groups,
            "batch_declared": self.declared,
            "capacity": self.capacity,
            "admitted": self.admitted,
            "outstanding": self.outstanding(),
            "served_at_version": self.served_at_version(),
            "cancelled_stale": self.cancelled_stale,
            "waits": self.waits,
        }
