"""Demand-driven generation: a generator starts a group only when the trainer will want it.

Like AReaL's staleness manager (``max_head_offpolicyness``) the bound is counted in trainer
steps, but here the buffer sees both ends: a group is *outstanding* from the moment the
generator admits it until it leaves the buffer (served, discarded by the filter, timed out,
set aside or stale). At most ``(max_staleness + 1) * batch_groups`` groups are outstanding,
where ``batch_groups`` is the largest read the trainer has made (in groups). A group the
dynamic filter drops stops being outstanding at once, so admission makes up for it: the
over-sampling slime asks for with ``--over-sampling-batch-size`` happens by itself, at the
filter's real drop rate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from buffer.signal import Signal


class Admits(Protocol):
    """What a generator awaits before each group: ``Admission``, or ``RemoteAdmission``."""

    async def admit(self) -> None: ...


class Admission:
    """The admission of one task's generator; thread-safe."""

    def __init__(self, max_staleness: int | None, batch_groups: int, consumed: Callable[[], int]) -> None:
        self.max_staleness = max_staleness
        self.batch_groups = max(1, batch_groups)
        self._consumed = consumed
        self._baseline = consumed()
        self._lock = threading.Lock()
        self._signal = Signal()
        self.admitted = 0
        self.waits = 0

    @property
    def capacity(self) -> int | None:
        """Groups that may be outstanding at once; None: no bound."""
        if self.max_staleness is None:
            return None
        return (self.max_staleness + 1) * self.batch_groups

    def outstanding(self) -> int:
        return self.admitted - (self._consumed() - self._baseline)

    def try_admit(self) -> bool:
        with self._lock:
            capacity = self.capacity
            if capacity is not None and self.outstanding() >= capacity:
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

    def saw_read(self, groups: int) -> None:
        """The trainer asked for ``groups`` groups: the batch is at least that."""
        if groups > self.batch_groups:
            self.batch_groups = groups
        self._signal.notify()

    def notify(self) -> None:
        """Something left the buffer: a waiting generator may go on."""
        self._signal.notify()

    def snapshot(self) -> dict[str, int | None]:
        return {
            "max_staleness": self.max_staleness,
            "batch_groups": self.batch_groups,
            "capacity": self.capacity,
            "admitted": self.admitted,
            "outstanding": self.outstanding(),
            "waits": self.waits,
        }
