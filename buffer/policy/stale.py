"""Stale work cancelled in flight: a group the trainer can no longer be served is not finished.

A group whose lowest version is ``low`` is stale, set aside unserved, once the trainer's
version passes ``low + max_staleness`` (``buffer.core.reads``). The version a request starts
under is the gate's (the trajectory's lowest is at most that: an engine's own ``weight_version``
only lowers it), so a group whose requests started at ``low`` can no longer be served the moment
the version exceeds ``low + S``, and nothing more of it is worth an engine's time:

- a request about to start, at the gate, under such a version: ``StaleWork`` instead (an
  aborted answer waiting for the resume is continued under the new version, so it is stopped
  there, before it reaches the engine);
- its samples' tasks with requests in flight: cancelled when the version changes. Cancelling
  the task closes its HTTP request, which SGLang and vLLM take for an abort.

Only groups of which nothing was written yet: a group partly in the buffer runs to its end,
is set aside as stale at read and counted there (the buffer has no way to close a group before
its timeout, and a half-written one would hold its place in admission until then). A cancelled
sample is never written, so never counted as made: the run moves on (the prompt comes back in
its next epoch), and a job resumed or started again on the same plan makes it, as it makes
whatever is missing, when admission says the trainer wants it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

from buffer.policy.gate import Gate, guard

if TYPE_CHECKING:
    from buffer.policy.admission import Admits

logger = logging.getLogger(__name__)


class Kept:
    """Whether a sample's outcome is to be written: false once its group was cancelled as stale."""

    def __init__(self) -> None:
        self.value = True

    def __bool__(self) -> bool:
        return self.value


class StaleGroups:
    """One run's groups in flight under ``max_staleness``: their lowest versions, their tasks.

    Without a gate (no policy followed) or a bound, it does nothing. ``admission`` is told of
    each group cancelled: its place is free again."""

    def __init__(
        self, gate: Gate | None, max_staleness: int | None, group_size: int, admission: Admits | None = None
    ) -> None:
        self.gate = gate
        self._admission = admission
        self.max_staleness = None if max_staleness is None else int(max_staleness)
        self.group_size = group_size
        self._low: dict[Hashable, int] = {}
        self._tasks: dict[Hashable, set[asyncio.Task[None]]] = {}
        self._started: dict[Hashable, int] = {}
        self._written: set[Hashable] = set()
        self._cancelled: set[Hashable] = set()
        #: Groups and samples cancelled so far.
        self.groups = 0
        self.samples = 0

    @contextlib.contextmanager
    def sample(self, key: Hashable) -> Iterator[Kept]:
        """Around one sample's rollout, in its own task: false (and the task's cancellation
        taken back) when its group was cancelled as stale."""
        kept = Kept()
        if self.gate is None or self.max_staleness is None:
            yield kept
            return
        self.begin(key)
        try:
            yield kept
        except asyncio.CancelledError:
            if not self.end(key):
                raise
            kept.value = False
        else:
            kept.value = not self.end(key)

    def begin(self, key: Hashable) -> None:
        """The current task runs a sample of group ``key``: its requests are checked at the gate."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.setdefault(key, set()).add(task)
        self._started[key] = self._started.get(key, 0) + 1
        guard(lambda version: self._check(key, version))

    def _check(self, key: Hashable, version: int) -> bool:
        """True (and the group cancelled) when a request of ``key`` starting under ``version``
        can no longer be served; else the group's lowest version is kept."""
        if key in self._cancelled:
            return True
        low = self._low.get(key)
        assert self.max_staleness is not None
        if low is not None and version - low > self.max_staleness and key not in self._written:
            self._cancel(key, version)
            return True
        self._low[key] = version if low is None else min(low, version)
        return False

    def end(self, key: Hashable) -> bool:
        """The current task's sample of ``key`` ended; True when it was cancelled as stale (the
        task's own cancellation is taken back: it returns normally, nothing written). False:
        it is written, and the group, partly in the buffer from now, runs to its end."""
        task = asyncio.current_task()
        tasks = self._tasks.get(key, set())
        tasks.discard(task)
        cancelled = key in self._cancelled
        if cancelled:
            self.samples += 1
            if task is not None and task.cancelling():
                task.uncancel()
        else:
            self._written.add(key)
        if not tasks and (cancelled or self._started.get(key, 0) >= self.group_size):
            self._forget(key)
        return cancelled

    def _forget(self, key: Hashable) -> None:
        for table in (self._low, self._tasks, self._started):
            table.pop(key, None)
        self._written.discard(key)

    def _cancel(self, key: Hashable, version: int) -> None:
        if key in self._cancelled:
            return
        self._cancelled.add(key)
        self.groups += 1
        if self._admission is not None:  # its place in admission is free again
            self._admission.cancelled(1)
        logger.debug("group %r: stale at version %d (lowest %s), cancelled", key, version, self._low.get(key))
        current = asyncio.current_task()
        for task in self._tasks.get(key, ()):
            if task is not current:
                task.cancel("stale")

    def is_cancelled(self, key: Hashable) -> bool:
        return key in self._cancelled

    async def watch(self) -> None:
        """Cancel the groups in flight that each new version leaves unservable; run as a task."""
        gate, bound = self.gate, self.max_staleness
        if gate is None or bound is None:
            return
        while True:
            ticket = gate.versioned.ticket()
            version = gate.version
            if version is not None:
                for key, low in list(self._low.items()):
                    stale = version - low > bound
                    if stale and key not in self._written and self._tasks.get(key):
                        self._cancel(key, version)
            await ticket.wait()
