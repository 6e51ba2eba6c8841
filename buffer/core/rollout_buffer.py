"""The buffer over all tasks: one lock, and the façade over the write path, the read path,
the jobs' ledger and the store.

Plain Python, no HTTP and no event loop: the API and in-process generators both call it.
A lock serialises every call, so generator threads may write while the event loop reads;
each call holds it for O(1) work per trajectory written and O(groups) per group returned.

Where each part lives:

    core/writes.py    a write: checked, encoded, deduplicated, within the buffer's room
    core/task.py      one task's groups: filling, finishing, waiting to be read
    core/reads.py     a read: stale groups aside, the groups chosen (mixed by weight), kept
    core/ledger.py    the generator jobs running, to resume after a restart
    core/records.py   the record of each change, as a store keeps it

With a store attached (``attach``; ``buffer.store.base.Store``), every change is appended to
it under the lock, in the order it was made: a write (``w``), a group's outcome (``fin``), a
read (``read``), a task's settings (``task``), a duplicate (``dup``), the jobs' records.
``restore`` replays them through the same code; ``snapshot`` writes the state out as records
(``open``, ``ready``, ``aside``, ``task_state``, ``state``, the replay pool's ``pool``) that
``restore`` reads back the same way. Extensions (the gateway's sessions) keep their own
records beside these (``add_extension``, ``log_event``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from buffer.core import reads as read_path
from buffer.core import writes as write_path
from buffer.core.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE, Hooks
from buffer.core.ledger import KINDS as JOB_KINDS
from buffer.core.ledger import JobLedger, Log
from buffer.core.reads import ReadPath, ReadResult
from buffer.core.records import HEAD, Capture, Event, Piece, encode, refuse_non_finite
from buffer.core.replay_pool import ReplaySettings
from buffer.core.snapshots import TaskCapture, UidCapture, in_order
from buffer.core.task import InstanceId, ReadyGroup, Record, SetAsideGroup, Tally, TaskBuffer, TaskSettings
from buffer.core.writes import Recent, WritePath, WriteResult
from buffer.errors import InvalidInput, StorageFailed, TooManyTasks
from buffer.policy.state import Policy
from buffer.policy.versions import versioned

if TYPE_CHECKING:
    from buffer.store.base import Store

DEFAULT_TASK = "default"
#: The record kinds of extensions (``add_extension``) start with it.
EXTENSION_PREFIX = "x:"


class Extension(Protocol):
    """State kept beside the buffer and journaled with it (the gateway's sessions): changed only
    by ``apply`` of its own events, so a restart replays it through the same code."""

    def apply(self, header: dict[str, Any], parts: Sequence[bytes]) -> None: ...

    def snapshot(self) -> Iterator[bytes]: ...


class RolloutBuffer:
    def __init__(
        self,
        default_settings: TaskSettings | None = None,
        *,
        hooks_for: Callable[[str], Hooks] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        dedup_window: int = 1_000_000,
        recent: int = 1000,
        max_buffered: int = 0,
        max_tasks: int = 0,
        one_group_per_instance: bool = True,
        strict_tasks: bool = False,
        replay: ReplaySettings | None = None,
    ) -> None:
        """``hooks_for`` gives the hooks of a task first met through a write, or restored,
        by the name of its generator; ``dedup_window`` bounds how many uids of trajectories no
        longer buffered are remembered; a write that would take the trajectories held past
        ``max_buffered`` (0: no limit) by opening groups raises ``BufferFull``; a write or a
        start that would create a task past ``max_tasks`` (0: no limit) raises ``TooManyTasks``;
        ``one_group_per_instance``: a read returns at most one group of each ``instance_id``;
        with ``strict_tasks`` a write to a task never configured (``configure_task``, or
        restored) is refused rather than grouped by the default settings; ``replay``: the
        replay pool's settings (``buffer.core.replay_pool``; default off)."""
        self.strict_tasks = strict_tasks
        #: Called (under the lock: keep it short) with the task and each new trajectory as written.
        self.write_observers: list[Callable[[str, Mapping[str, Any]], None]] = []
        self.default_settings = default_settings or TaskSettings()
        self._hooks_for = hooks_for or (lambda task_type: Hooks())
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.RLock()
        self._tasks: dict[str, TaskBuffer] = {}
        self._current_task = DEFAULT_TASK
        self._journal: Store | None = None
        self.max_buffered = max_buffered
        self.max_tasks = max_tasks
        self.one_group_per_instance = one_group_per_instance
        self._held = Tally()  # trajectories held over all tasks, kept by the tasks themselves
        #: Task names, the most recently written last: which tasks the dashboard follows.
        self._activity: OrderedDict[str, None] = OrderedDict()
        self._seq = 0  # the order of ready groups across tasks
        self._listeners: list[Callable[[], None]] = []
        self._extensions: dict[str, Extension] = {}
        self._unclaimed: list[bytes] = []  # events of extensions not added: a compaction keeps them
        #: The trainer's policy version, the gate of in-process generators, their admissions.
        self.policy = Policy(outcomes=self.group_outcomes)
        self.write_observers.append(self.policy.written)  # a group made in full: admission may go on
        self._writes = WritePath(dedup_window, recent)
        self._reads = ReadPath(self.policy, wall_clock, replay)
        self._ledger = JobLedger()
        self._capturing = False  # a snapshot's records being read (``snapshot``)
        #: Whether the tasks note what changes for incremental snapshots (``core.snapshots``):
        #: from a restore (what the store's snapshot holds is then known) while the store
        #: attached takes deltas.
        self._tracking = False
        #: The uids the store's snapshot holds: the last one's number and its first chunk
        #: (``core.snapshots.UidCapture``; None: not known, the next snapshot is whole).
        self._uid_base: tuple[int, int] | None = (0, 0)

    # -- what the parts own, read here ---------------------------------------------------

    @property
    def reads(self) -> int:
        """Reads that returned groups: the export's ``read_id``."""
        return self._reads.reads

    @property
    def total_read(self) -> int:
        return self._reads.total_read

    @property
    def duplicates(self) -> int:
        return self._writes.duplicates

    @property
    def refused_full(self) -> int:
        """Writes refused with ``BufferFull`` or ``BatchTooLarge``."""
        return self._writes.refused_full

    @property
    def recent(self) -> Sequence[Recent]:
        """The last trajectories written, newest last: (seq, task, instance_id, uid, reward, time)."""
        return self._writes.recent

    @property
    def jobs(self) -> dict[str, dict[str, Any]]:
        """The generator jobs running, by buffer task: what started each, to start it again
        after a restart (``job_started``, ``job_ended``); the unfinished ones left out."""
        return self._ledger.running()

    # -- tasks -------------------------------------------------------------------------

    def configure_task(
        self, task_type: str, settings: TaskSettings, hooks: Hooks, *, hooks_source: str | None = None
    ) -> None:
        """Create or re-configure a task and make it the one unlabelled writes go to.

        Never drops anything buffered: open groups keep their size, ready groups stay.
        ``hooks_source`` names the generator the hooks come from (default: ``task_type``;
        ``EVALUATION_SOURCE`` for ``EVALUATION_HOOKS``), for a restart to find them again.
        """
        with self._lock:
            if task_type not in self._tasks:
                self._check_task_room("task_type", task_type)
            self._configure(task_type, settings, hooks, hooks_source, current=True)

    def _configure(
        self, task_type: str, settings: TaskSettings, hooks: Hooks, hooks_source: str | None, *, current: bool
    ) -> TaskBuffer:
        if self._journal is not None:  # before anything changes: the record must be storable
            refuse_non_finite(asdict(settings), "settings")
        task = self._tasks.get(task_type)
        if task is None:
            task = self._tasks[task_type] = TaskBuffer(
                task_type,
                settings,
                hooks,
                hooks_source=hooks_source,
                sequence=self._next_seq,
                on_ready=self._notify,
                log=self._log,
                tally=self._held,
            )
            task.track(self._tracking)  # a new task: no row of it in the store's snapshot
        else:
            task.reconfigure(settings, hooks, hooks_source)
        if current:
            self._current_task = task_type
        if self._journal is not None:
            self._journal.append(task.settings_record(current=current))
        return task

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _hooks_of(self, source: str) -> Hooks:
        return EVALUATION_HOOKS if source == EVALUATION_SOURCE else self._hooks_for(source)

    @property
    def current_task(self) -> str:
        return self._current_task

    def task_types(self) -> list[str]:
        with self._lock:
            return list(self._tasks)

    def has_task(self, task_type: str) -> bool:
        return task_type in self._tasks

    def written(self, task_type: str) -> int:
        with self._lock:
            task = self._tasks.get(task_type)
            return task.written if task else 0

    def _task(self, task_type: str) -> TaskBuffer:
        task = self._tasks.get(task_type)
        if task is None:
            task = self._configure(
                task_type, self.default_settings, self._hooks_for(task_type), None, current=False
            )
        return task

    def _check_task_room(self, field: str, task_type: str) -> None:
        """Refuse a new task past ``max_tasks``: each task is kept for good (its counters, its
        dashboard history, its metrics), so task names a client makes up must not grow them."""
        if self.max_tasks and len(self._tasks) >= self.max_tasks:
            raise TooManyTasks(field, task_type, self.max_tasks)

    def active_tasks(self, limit: int) -> list[str]:
        """The ``limit`` tasks written to most recently, the most recent first."""
        with self._lock:
            return list(itertools.islice(reversed(self._activity), limit))

    # -- writes (core/writes.py) ---------------------------------------------------------

    def write(self, item: Mapping[str, Any]) -> WriteResult:
        """Buffer one validated trajectory. A uid seen before is accepted and not counted again."""
        return self.write_many([item], numbered=False)[0]

    def write_many(self, items: Iterable[Mapping[str, Any]], *, numbered: bool = True) -> list[WriteResult]:
        """Buffer many trajectories, all or none: a bad one raises before any is written.

        Errors name the field as ``<index>.<field>`` when ``numbered``."""
        with self._lock:
            journal = self._journal
            if journal is not None and journal.failure is not None:
                raise StorageFailed(journal.failure)
            now = self._clock()
            wall = self._wall_clock()
            items = list(items)
            prepared = [
                self._prepare(f"{index}." if numbered else "", item) for index, item in enumerate(items)
            ]
            if self.max_buffered:
                self._writes.check_room(prepared, self._held.items, self.max_buffered, self._tasks.values())
            results, touched = self._writes.apply(prepared, items, journal, now, wall, self.write_observers)
            for task in touched:
                task.expire(now)
                self._activity[task.task_type] = None
                self._activity.move_to_end(task.task_type)
            return results

    def _prepare(self, prefix: str, item: Mapping[str, Any]) -> tuple[TaskBuffer, InstanceId, Record]:
        task_type = item.get("task_type") or self._current_task
        if task_type not in self._tasks:  # checked here, not in _task: a restore creates what it finds
            if self.strict_tasks:
                reason = f"no task {task_type!r} is configured: PUT /tasks/{{name}} or /start_rollout first"
                raise InvalidInput.one(prefix + "task_type", reason)
            self._check_task_room(prefix + "task_type", task_type)
        task = self._task(task_type)
        item = versioned(item, self.policy.version)  # an unversioned one: the service's version
        instance_id, record = write_path.prepare(prefix, item, task.settings.reward_key)
        return task, instance_id, record

    def buffered_items(self) -> int:
        """Trajectories held: in open groups and in ready ones."""
        return self._held.items

    # -- reads (core/reads.py) -----------------------------------------------------------

    def read(
        self,
        task_type: str | None = None,
        max_items: int | None = None,
        *,
        mix: Mapping[str, float] | None = None,
        replay_ratio: float = 0.0,
    ) -> ReadResult:
        """Take ready groups, oldest first, whole: as many as fit in ``max_items`` (all when
        ``None``) but at least one. With ``one_group_per_instance``, a later group of an
        instance already taken stays for the next read (slime's trainer merges one read's
        groups by ``instance_id``). A read that returns groups starts a new statistics window;
        one that returns none reports the statistics so far and keeps them.

        ``mix`` (task: weight), or the tasks' own weights when no ``task_type`` is named and a
        task has one, shares the read between tasks (``buffer.core.reads.choose_mixed``).
        Groups past their task's ``max_staleness`` are set aside first, never served.
        ``replay_ratio``: the share of the groups returned that may be served again from the
        replay pool (``buffer.core.replay_pool``; a 422 while the pool is off)."""
        with self._lock:
            journal = self._journal
            if journal is not None and journal.failing is not None:
                raise StorageFailed(journal.failing)  # nothing is taken that could not be kept
            tasks = self._covered(task_type) if mix is None else [self._task(name) for name in mix]
            self._expire(tasks)
            return self._reads.read(
                tasks, task_type, max_items, mix, self.one_group_per_instance, journal, replay_ratio
            )

    def peek(self, task_type: str | None = None, max_items: int | None = None) -> list[ReadyGroup]:
        """The groups a read would return, left in place."""
        with self._lock:
            tasks = self._covered(task_type)
            self._expire(tasks)
            return read_path.choose(tasks, max_items, self.one_group_per_instance)

    def ready_items(self, task_type: str | None = None) -> int:
        with self._lock:
            tasks = self._covered(task_type)
            self._expire(tasks)
            return sum(task.ready_items for task in tasks)

    def consumed_groups(self, task_type: str) -> int:
        """Groups of the task that have left the buffer: served, discarded (the filter,
        timeouts, stale) or set aside; what admission counts against."""
        with self._lock:
            task = self._tasks.get(task_type)
            if task is None:
                return 0
            return task.delivered_groups + sum(task.discarded.values()) + task.set_aside_total

    def group_outcomes(self, task_type: str) -> tuple[int, int, int]:
        """The task's groups made in full: (ready to read; kept by the filters, ever: served,
        ready or set aside stale; dropped by them or a hook); admission's keep-rate."""
        with self._lock:
            task = self._tasks.get(task_type)
            if task is None:
                return 0, 0, 0
            stale = task.discarded.get(read_path.STALE, 0)
            kept = task.delivered_groups + len(task.ready) + stale
            return len(task.ready), kept, sum(task.discarded.values()) - stale + task.set_aside_total

    def expire(self) -> int:
        """Finish every group that has timed out, in every task; returns how many."""
        with self._lock:
            return self._expire(list(self._tasks.values()))

    def _expire(self, tasks: list[TaskBuffer]) -> int:
        now = self._clock()
        return sum(task.expire(now) for task in tasks)

    def _covered(self, task_type: str | None) -> list[TaskBuffer]:
        if task_type is None:
            return list(self._tasks.values())
        task = self._tasks.get(task_type)
        return [task] if task else []

    # -- observation -------------------------------------------------------------------

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (under the buffer's lock: keep it short) whenever a group becomes ready."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()

    @property
    def replay_enabled(self) -> bool:
        """Whether the replay pool is on (``--replay-capacity``): a read may ask for replay."""
        return self._reads.pool.enabled

    def replay_pool(self) -> dict[str, Any]:
        """The replay pool's counters (``ReplayPool.counters``), for ``/metrics``."""
        with self._lock:
            return self._reads.pool.counters()

    def set_aside(self, task_type: str | None = None) -> list[SetAsideGroup]:
        with self._lock:
            return [group for task in self._covered(task_type) for group in task.set_aside]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._expire(list(self._tasks.values()))
            tasks = {name: task.counters() for name, task in self._tasks.items()}
            return {
                "current_task": self._current_task,
                "current_size": sum(t["ready_items"] for t in tasks.values()),
                "pending_items": sum(t["pending_items"] for t in tasks.values()),
                "total_written": sum(t["total_written"] for t in tasks.values()),
                "total_read": self.total_read,
                "duplicates": self.duplicates,
                "refused_full": self.refused_full,
                "journal": self._journal.counters() if self._journal else None,
                "tasks": tasks,
            }

    def summary(self, task_types: Iterable[str]) -> dict[str, Any]:
        """Totals over every task, and the counters of ``task_types`` only: what the dashboard's
        history keeps each second, at O(tasks) attribute reads rather than a dict per task."""
        with self._lock:
            tasks = self._tasks.values()
            return {
                "total_written": sum(task.written for task in tasks),
                "total_read": self.total_read,
                "pending_groups": sum(len(task.open) for task in tasks),
                "ready_groups": sum(len(task.ready) for task in tasks),
                "delivered_groups": sum(task.delivered_groups for task in tasks),
                "tasks": {name: self._tasks[name].counters() for name in task_types if name in self._tasks},
            }

    # -- generator jobs (core/ledger.py) -------------------------------------------------

    def job_started(
        self,
        task_type: str,
        generator: str,
        data: dict[str, Any],
        *,
        plan: str | None = None,
        resumed: bool = False,
    ) -> None:
        """Remember that ``generator`` runs as ``task_type`` with ``data`` (its ``plan``, a
        fingerprint), across restarts, and count the groups of the task that finish from now
        on (``resume_point``); ``resumed``: it continues the task's unfinished job
        (``job_continues``), whose count goes on."""
        with self._lock:
            self._ledger.started(
                self._task(task_type), generator, data, self._log, plan=plan, resumed=resumed
            )

    def job_ended(self, task_type: str, *, finished: bool = True) -> None:
        """The task's job made its whole plan (``finished``), or failed, was cancelled or not
        resumed: a restart leaves it ended; an unfinished one a later start may continue."""
        with self._lock:
            self._ledger.ended(task_type, self._tasks.get(task_type), self._log, finished=finished)

    def remote_run(self, task_type: str) -> bool:
        """Remote lease workers were granted work of the task: where nothing counts its finished
        groups (no job), count them from now on, kept across restarts, so that its
        ``resume_point`` says what they made (``JobLedger.remote``). False where something did."""
        with self._lock:
            return self._ledger.remote(self._task(task_type), self._log)

    def job_continues(self, task_type: str, generator: str, plan: str | None) -> bool:
        """Whether a job of ``generator`` and ``plan`` started now would continue the task's
        job that ended unfinished (the same generator and plan): its ``resume_point`` holds
        what that one made."""
        with self._lock:
            return self._ledger.continues(task_type, generator, plan)

    def job_paused(self, task_type: str) -> None:
        """The service is shutting down cleanly with the task's job running: it resumes after
        the restart, and this stop is no crash."""
        with self._lock:
            self._ledger.paused(task_type, self._log)

    def crashes_if_resumed(self, task_type: str) -> int:
        """How many times in a row the service has stopped without shutting down while the
        task's job ran and wrote nothing since its last start, counting the stop just before
        this start: 0 after a clean stop, 1 when the job wrote since its last start."""
        with self._lock:
            return self._ledger.crashes_if_resumed(self._task(task_type))

    def job_resumed(self, task_type: str, crashes: int) -> None:
        """The task's job runs again after a restart; ``crashes`` as ``crashes_if_resumed``."""
        with self._lock:
            self._ledger.resumed(self._task(task_type), crashes, self._log)

    def resume_point(self, task_type: str) -> dict[str, Any]:
        """What the task's job has produced since it started, for the job resumed to make only
        what is missing: ``finished_groups``, ``[instance_id, groups]`` finished (delivered,
        ready, discarded or set aside); ``open_groups``, ``[instance_id, repeats]`` with the
        ``extra_info.repeat`` of each trajectory an open group holds (``None`` where absent).
        Where the trajectories say their ``extra_info.epoch``, also ``finished_epochs``,
        ``[instance_id, epoch, groups]`` (a part of ``finished_groups``), and ``open_epochs``,
        ``[instance_id, epoch]`` of the open groups; absent when there are none.
        Groups that timed out while the service was down finish first, as they would have."""
        with self._lock:
            task = self._task(task_type)
            task.expire(self._clock())
            return self._ledger.resume_point(task)

    def known_resume_point(self, task_type: str) -> dict[str, Any] | None:
        """``resume_point`` of a task the buffer knows; None for any other (none is made)."""
        with self._lock:
            task = self._tasks.get(task_type)
            if task is None:
                return None
            task.expire(self._clock())
            return self._ledger.resume_point(task)

    # -- extensions --------------------------------------------------------------------

    def add_extension(self, kind: str, extension: Extension) -> None:
        """Journal ``extension``'s events (header ``{"e": kind, ...}``, ``kind`` starting with
        ``EXTENSION_PREFIX``) with the buffer's own; before ``restore``, for its events to be
        replayed. Events of an extension not added are kept as they are."""
        if not kind.startswith(EXTENSION_PREFIX):
            raise ValueError(f"an extension's event kind starts with {EXTENSION_PREFIX!r}: {kind!r}")
        self._extensions[kind] = extension

    def log_event(self, header: dict[str, Any], parts: Sequence[bytes] = ()) -> None:
        """Apply an extension's event and journal it, in one step under the lock: its state
        never holds what the journal would not replay. ``StorageFailed`` when the data folder
        cannot be written (nothing applied)."""
        extension = self._extensions[header["e"]]
        with self._lock:
            journal = self._journal
            if journal is not None and journal.failure is not None:
                raise StorageFailed(journal.failure)
            extension.apply(header, parts)
            if journal is not None:
                journal.append(encode(header, parts))

    # -- the store ---------------------------------------------------------------------

    @property
    def _log(self) -> Log:
        """Where records go: the store's ``append``, or None without a store."""
        return self._journal.append if self._journal is not None else None

    def restore(self, events: Iterable[Event]) -> int:
        """Rebuild the state from a store's records (before ``attach``); returns how many.
        Open groups keep their age: their last write is dated by the wall clock."""
        offset = self._clock() - self._wall_clock()

        def monotonic_of(wall: float) -> float:
            return wall + offset

        count = 0
        with self._lock:
            self._tracking = True  # tasks made from here on: what the store holds is replayed
            for event in events:
                self._apply(event, monotonic_of)
                count += 1
        return count

    def _apply(self, event: Event, monotonic_of: Callable[[float], float]) -> None:
        header = event.header
        kind = header["e"]
        if kind.startswith(EXTENSION_PREFIX):
            extension = self._extensions.get(kind)
            if extension is not None:
                extension.apply(header, event.parts())
            else:  # a tool that replays without the extension: kept, and written out again
                self._unclaimed.append(encode(header, event.parts()))
        elif kind == "w":
            self._writes.replay(self._task(header["t"]), event, monotonic_of)
        elif kind == "fin":
            self._tasks[header["t"]].replay_finish(event)
            self._seq = max(self._seq, header.get("seq", -1) + 1)
        elif kind == "dup":
            self._writes.replay_duplicate()
        elif kind == "stale":
            self._tasks[header["t"]].drop_ready(header["seqs"], read_path.STALE)
        elif kind == "nop":  # a read the store took back, a compaction
            pass
        elif kind == "read":
            self._reads.replay_read(header, self._covered(header["t"]), self._tasks)
        elif kind == "pool":  # a snapshot's replay pool entry
            self._reads.pool.restore(event)
        elif kind in JOB_KINDS:
            self._ledger.apply(header, self._task, self._tasks)
        elif kind == "task":
            source = header["h"]
            settings = TaskSettings(**header["s"])
            self._configure(header["t"], settings, self._hooks_of(source), source, current=header["current"])
        elif kind == "uids":  # a snapshot's chunk of the uids remembered
            self._writes.restore_uids(header["u"])
        elif kind == "state":
            self._uid_base = None if "uids" in header else (header["written_seq"], header["uf"])
            self._current_task = header["current"]
            self._seq = max(self._seq, header["seq"])
            self._writes.restore(header)
            self._reads.restore(header)
            self._ledger.restore(header.get("jobs", {}), self._task)
        else:
            self._tasks[header["t"]].restore(event, monotonic_of)
            if kind == "ready":
                self._seq = max(self._seq, header["seq"] + 1)

    def attach(self, journal: Store) -> None:
        """Keep every change from now on in ``journal`` (a store) and let it compact through
        ``snapshot``. Finishes the groups a restore left full but open."""
        with self._lock:
            self._journal = journal
            self._tracking = bool(getattr(journal, "incremental", False))
            if not self._tracking:
                for task in self._tasks.values():
                    task.track(False)
            journal.start(self.snapshot, lock=self._lock)
            for task in self._tasks.values():
                task.log_to(journal.append)
                task.finish_full()

    @property
    def journal(self) -> Store | None:
        """The store changes are kept in (None: none, nothing survives the process)."""
        return self._journal

    async def wait_durable(self) -> None:
        """Return once every change made so far is kept (at once without a store)."""
        if self._journal is not None:
            await self._journal.wait_durable()

    def snapshot(self, *, delta: bool = False) -> Capture:
        """The store's position and the pieces of the state as of it (``records.Capture``):
        whole, or with ``delta`` (when every task tracked its changes) only what changed since
        the previous capture (``core.snapshots``). Under the lock, with the collector paused:
        O(1) per task for its open groups (captured, not copied: ``core.open_table``) and copies
        of pointers for the rest, nothing per open group; the pieces are made and encoded as
        they are read, outside the lock. Once they are read (or the iterator closed or
        dropped), what changed meanwhile is folded back into the open groups, a slice per hold
        of the lock. One capture at a time."""
        assert self._journal is not None
        self._fold_captures()  # what a former capture left
        with self._lock, _collector_paused():
            if self._capturing:
                raise RuntimeError("a snapshot of the buffer is being read already")
            self._capturing = True
            position = self._journal.position()
            offset = self._wall_clock() - self._clock()

            def wall_of(monotonic: float) -> float:
                return monotonic + offset

            tasks = list(self._tasks.values())
            delta = delta and self._uid_base is not None and all(task.can_delta for task in tasks)
            if not delta and self._tracking:  # tracked from this whole snapshot on
                for task in tasks:
                    if not task.can_delta:
                        task.track(True)
            captures = [TaskCapture(task, wall_of, delta=delta) for task in tasks]
            uids = UidCapture(self._writes, self._uid_base if delta else None)
            self._uid_base = uids.base
            state = {
                "e": "state",
                "current": self._current_task,
                "seq": self._seq,
                "total_read": self._reads.total_read,
                "reads": self._reads.reads,
                **self._writes.state(),
                "uf": uids.first_chunk,
            }
            jobs = self._ledger.snapshot(self._tasks)
            extensions = [extension.snapshot() for extension in self._extensions.values()]
            extensions.append(iter(list(self._unclaimed)))
            extensions.append(self._reads.pool.snapshot())  # the replay pool's entries

        def pieces() -> Generator[Piece, None, None]:
            try:
                yield Piece(HEAD, None)  # taken below: from then on, closing ends the capture
                yield from in_order(captures, uids, lambda: encode({**state, "jobs": jobs()}), extensions)
            finally:
                with self._lock:
                    for task in tasks:
                        task.release_capture()
                    self._capturing = False
                self._fold_captures()

        stream = pieces()
        next(stream)
        return Capture(position, stream, delta)

    def _fold_captures(self) -> None:
        """Fold what changed during a capture back into the tasks' open groups, a slice per
        task per hold of the lock (``TaskBuffer.fold_capture``)."""
        more = True
        while more:
            with self._lock:
                more = False
                for task in self._tasks.values():
                    more = task.fold_capture() or more


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic collection meanwhile: one would stop every thread for as long as the heap is
    large (a second and more at a million buffered trajectories), here while the lock is held."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
