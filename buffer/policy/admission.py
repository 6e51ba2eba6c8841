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
guess (the job's ``num_process`` in groups) that the first read replaces.

What counts is the groups that will be *served*: a group in flight is served only if the filters
(zero variance, ``is_valid_group``, a hook) keep it, so it counts as the measured keep-rate
``k`` (groups kept over groups made in full, the last ``KEEP_WINDOW``; 1 before any is made,
at least ``KEEP_FLOOR``), a ready group as 1, and a group is admitted while::

    ready + (in_flight + 1) * k + served_at_this_version <= (max_staleness + 1) * batch_groups

A filter that drops half the groups doubles what may be in flight (at most ``1 / KEEP_FLOOR``
times the need); one that keeps all leaves it the need. A dropped group stops being pending
at once. A group the generator cancelled as stale in flight (``buffer.policy.stale``), nothing
of it written, stops being pending when the generator says so (``report_cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from buffer.signal import Signal

#: The keep-rate is measured over the last this many groups made in full.
KEEP_WINDOW = 64
#: ... and taken as at least this: what may be in flight is at most 1 / KEEP_FLOOR times the need.
KEEP_FLOOR = 0.25
#: How many standard deviations of the count kept are left free: more groups kept than the
#: keep-rate says would be served late, stale (a binomial count; 1.5: about 1 time in 15).
KEEP_MARGIN_SD = 1.5
#: Outcomes of a task's groups made in full, as totals: (ready, kept, dropped) (``group_outcomes``).
Outcomes = Callable[[], tuple[int, int, int]]


class KeepRate:
    """The share of a task's groups made in full that its filters keep, over the last ``window``."""

    def __init__(self, window: int = KEEP_WINDOW, floor: float = KEEP_FLOOR) -> None:
        self.floor = floor
        self._recent: deque[bool] = deque(maxlen=window)
        self._seen: tuple[int, int] | None = None  # the totals last observed: counted from there

    def observe(self, kept: int, dropped: int) -> None:
        """The task's totals now: the groups kept and dropped since the last call join the window."""
        if self._seen is not None:
            new_kept, new_dropped = max(0, kept - self._seen[0]), max(0, dropped - self._seen[1])
            size = self._recent.maxlen or 0
            if new_kept + new_dropped > size:  # more than the window at once: in proportion
                new_kept = round(size * new_kept / (new_kept + new_dropped))
                new_dropped = size - new_kept
            self._recent.extend([False] * new_dropped)
            self._recent.extend([True] * new_kept)
        self._seen = (kept, dropped)

    @property
    def measured(self) -> int:
        return len(self._recent)

    @property
    def rate(self) -> float:
        """Kept over made in full in the window; 1 before any group is made, never below the floor."""
        if not self._recent:
            return 1.0
        return max(self.floor, sum(self._recent) / len(self._recent))


def in_flight_at_most(free: float, keep_rate: float) -> int:
    """The most groups ``n`` that may be in flight when ``free`` more may be served: those kept
    of ``n``, ``n k`` on average, plus ``KEEP_MARGIN_SD`` standard deviations ``sqrt(n k (1 - k))``,
    fit in ``free`` (the larger root of ``k x^2 + z sqrt(k (1 - k)) x - free`` for ``x = sqrt(n)``)."""
    if free <= 0:
        return 0
    k = keep_rate
    spread = KEEP_MARGIN_SD * math.sqrt(k * (1 - k))
    root = (-spread + math.sqrt(spread * spread + 4 * k * free)) / (2 * k)
    return math.floor(root * root + 1e-9)


class Admits(Protocol):
    """What a generator awaits before each group: ``Admission``, or ``RemoteAdmission``."""

    async def admit(self, want: int = 1) -> float:
        """Wait until one more group may start; returns the seconds it waited for room. ``want``:
        how many the generator could start now (one answer may admit them all)."""

    def cancelled(self, groups: int) -> None:
        """``groups`` more of the admitted groups were cancelled, nothing of them written."""

    def offer(self, groups: int) -> None:
        """The run could start ``groups`` groups now (a slot was freed): a generator elsewhere
        may ask for them ahead; here, nothing to do."""


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
        outcomes: Outcomes | None = None,
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
        #: Of the admitted, those granted down worker processes' admission sockets (``channel``).
        self.pushed = 0
        #: Called at each notify on their loops (``listen``): the admission sockets' services.
        self._listeners: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        #: Groups cancelled as stale in flight, by who cancelled them (each reports its total).
        self._cancelled: dict[str, int] = {}
        #: The task's groups made in full, by outcome (None: every group pending counts as served).
        self._outcomes = outcomes
        self.keep = KeepRate()
        if outcomes is not None:
            self.keep.observe(*outcomes()[1:])  # counted from now

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

    def _room(self, capacity: int, consumed: int, served: int, outcomes: tuple[int, int, int]) -> int:
        """How many more groups fit: those ready count as served, those in flight as the
        keep-rate ``k`` each, and ``KEEP_MARGIN_SD`` standard deviations of how many of them are
        kept are left free (more kept than ``k`` says would go stale)."""
        ready, kept, dropped = outcomes
        if self._outcomes is not None:
            self.keep.observe(kept, dropped)
        pending = max(0, self.admitted - (consumed - self._baseline) - self.cancelled_stale)
        ready = min(ready, pending)
        return max(0, in_flight_at_most(capacity - served - ready, self.keep.rate) - (pending - ready))

    def _counts(self) -> tuple[int, int, tuple[int, int, int]]:
        """The buffer's counts admission needs: asked before taking this admission's lock (a
        read tells ``saw_read`` holding the buffer's lock: one order of the two locks only)."""
        outcomes = self._outcomes() if self._outcomes is not None else (0, 0, 0)
        return self._consumed(), self.served_at_version(), outcomes

    def try_admit(self, groups: int = 1) -> int:
        """Admit up to ``groups`` groups now; how many were."""
        counts = self._counts()
        with self._lock:
            capacity = self.capacity
            admitted = groups if capacity is None else min(groups, self._room(capacity, *counts))
            self.admitted += admitted
            return admitted

    async def admit(self, want: int = 1) -> float:
        """Wait until one more group may start, and count it; returns the seconds it waited
        (``want`` is no matter here: asking again costs no round trip)."""
        began: float | None = None
        while True:
            ticket = self._signal.ticket()  # before the check: a notify cannot slip past
            if self.try_admit():
                ticket.cancel()
                return 0.0 if began is None else time.monotonic() - began
            if began is None:
                self.waits += 1
                began = time.monotonic()
            await ticket.wait(1.0)

    def offer(self, groups: int) -> None:
        """Nothing to ask ahead: ``admit`` is a call (``Admits``)."""

    def release(self, groups: int) -> None:
        """``groups`` admitted groups will never start (granted to a worker that ended before
        it took them): they stop counting at once."""
        if groups <= 0:
            return
        with self._lock:
            self.admitted -= groups
        self._notify()

    def listen(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Have ``wake`` called on the running loop after each notify, from whatever thread (room
        may have appeared): one loop turn, where a ticket's waiter takes three. Returns what
        stops it."""
        entry = (asyncio.get_running_loop(), wake)
        with self._lock:
            self._listeners.append(entry)

        def stop() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._listeners.remove(entry)

        return stop

    def _notify(self) -> None:
        self._signal.notify()
        with self._lock:
            listeners = list(self._listeners)
        for loop, wake in listeners:
            with contextlib.suppress(RuntimeError):  # a loop that has closed
                loop.call_soon_threadsafe(wake)

    def cancelled(self, groups: int) -> None:
        """This process's generator cancelled ``groups`` more groups (``Admits``)."""
        with self._lock:
            self._cancelled["local"] = self._cancelled.get("local", 0) + groups
        self._notify()

    def report_cancelled(self, worker: str, total: int) -> None:
        """``worker`` has cancelled ``total`` groups so far (a total: a report sent twice counts once)."""
        with self._lock:
            self._cancelled[worker] = max(total, self._cancelled.get(worker, 0))
        self._notify()

    def declare(self, batch_groups: int) -> None:
        """The trainer says its batch: ``batch_groups`` groups a step."""
        with self._lock:
            self.batch_groups = max(1, batch_groups)
            self.declared = True
            self._guess = False
        self._notify()

    def new_version(self) -> None:
        """The trainer's version changed: its next batch is counted from here."""
        with self._lock:
            self._versioned = True
            self._served_base = self._served()
        self._notify()

    def saw_read(self, groups: int) -> None:
        """The trainer asked for ``groups`` groups: the batch is at least that (its first read
        replaces the guess; a declared batch stays)."""
        with self._lock:
            if not self.declared and (self._guess or groups > self.batch_groups):
                self.batch_groups = max(1, groups)
                self._guess = False
        self._notify()

    def notify(self) -> None:
        """Something left the buffer: a waiting generator may go on."""
        self._notify()

    def snapshot(self) -> dict[str, float | int | bool | None]:
        if self._outcomes is not None:
            outcomes = self._outcomes()
            with self._lock:
                self.keep.observe(*outcomes[1:])
        return {
            "max_staleness": self.max_staleness,
            "batch_groups": self.batch_groups,
            "batch_declared": self.declared,
            "capacity": self.capacity,
            "admitted": self.admitted,
            "outstanding": self.outstanding(),
            "served_at_version": self.served_at_version(),
            "keep_rate": round(self.keep.rate, 4),
            "keep_measured": self.keep.measured,
            "cancelled_stale": self.cancelled_stale,
            "waits": self.waits,
            "pushed": self.pushed,
        }
