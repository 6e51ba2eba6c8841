"""The buffer over all tasks: routing writes, deduplicating, and reading whole groups.

Plain Python, no HTTP and no event loop: the API and in-process generators both call it.
A lock serialises every call, so generator threads may write while the event loop reads;
each call holds it for O(1) work per trajectory written and O(groups) per group returned.

With a journal attached (``--data-dir``), every change is appended to it under that lock, in
the order it was made: a write (``w``), a group's outcome (``fin``), a read (``read``), a
task's settings (``task``), a duplicate (``dup``). ``restore`` replays them through the same
code; ``snapshot`` writes the state out as records (``open``, ``ready``, ``aside``,
``task_state``, ``state``) that ``restore`` reads back the same way. Extensions (the
gateway's sessions) journal their own events beside these (``add_extension``, ``log_event``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from buffer import encoding
from buffer.core import reads as policy_reads
from buffer.core.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE, Hooks
from buffer.core.stats import RewardStats
from buffer.core.task import InstanceId, ReadyGroup, Record, SetAsideGroup, Tally, TaskBuffer, TaskSettings
from buffer.errors import BatchTooLarge, BufferFull, InvalidInput, StorageFailed, TooManyTasks
from buffer.policy.state import Policy
from buffer.store import export
from buffer.store.sqlite import Event, Journal, encode, refuse_non_finite

DEFAULT_TASK = "default"
#: The journal event kinds of extensions (``add_extension``) start with it.
EXTENSION_PREFIX = "x:"


class Extension(Protocol):
    """State kept beside the buffer and journaled with it (the gateway's sessions): changed only
    by ``apply`` of its own events, so a restart replays it through the same code."""

    def apply(self, header: dict[str, Any], parts: Sequence[bytes]) -> None: ...

    def snapshot(self) -> Iterator[bytes]: ...


@dataclass(frozen=True, slots=True)
class WriteResult:
    uid: str
    task_type: str
    duplicate: bool


@dataclass(slots=True)
class ReadResult:
    groups: list[ReadyGroup]
    meta_info: dict[str, Any]

    @property
    def num_items(self) -> int:
        return sum(len(group.items) for group in self.groups)


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
    ) -> None:
        """``hooks_for`` gives the hooks of a task first met through a write, or restored,
        by the name of its generator; ``dedup_window`` bounds how many uids of trajectories no
        longer buffered are remembered; a write that would take the trajectories held past
        ``max_buffered`` (0: no limit) by opening groups raises ``BufferFull``; a write or a
        start that would create a task past ``max_tasks`` (0: no limit) raises ``TooManyTasks``;
        ``one_group_per_instance``: a read returns at most one group of each ``instance_id``;
        with ``strict_tasks`` a write to a task never configured (``configure_task``, or
        restored) is refused rather than grouped by the default settings."""
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
        self._journal: Journal | None = None
        self.max_buffered = max_buffered
        self.max_tasks = max_tasks
        self.one_group_per_instance = one_group_per_instance
        self._held = Tally()  # trajectories held over all tasks, kept by the tasks themselves
        #: Task names, the most recently written last: which tasks the dashboard follows.
        self._activity: OrderedDict[str, None] = OrderedDict()
        self._seq = 0  # the order of ready groups across tasks
        self.reads = 0  # reads that returned groups: the export's read_id
        self.refused_full = 0  # writes refused with BufferFull
        #: The generator jobs running, by buffer task: what started each, to start it again
        #: after a restart (``job_started``, ``job_ended``).
        self.jobs: dict[str, dict[str, Any]] = {}
        self._uids: set[str] = set()
        self._uid_order: deque[str] = deque()
        self._dedup_window = dedup_window
        self._listeners: list[Callable[[], None]] = []
        self.duplicates = 0
        self.total_read = 0
        #: The last trajectories written, newest last: (seq, task, instance_id, uid, reward, time).
        self.recent: deque[tuple[int, str, InstanceId, str, float, float]] = deque(maxlen=recent)
        self._written_seq = 0
        self._extensions: dict[str, Extension] = {}
        self._unclaimed: list[bytes] = []  # events of extensions not added: a compaction keeps them
        #: The trainer's policy version, the gate of in-process generators, their admissions.
        self.policy = Policy()
        self._spans: dict[int, tuple[int, int] | None] = {}  # group versions, by ready seq

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
                log=self._journal.append if self._journal else None,
                tally=self._held,
            )
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

    # -- writes ------------------------------------------------------------------------

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
                self._check_room(prepared)
            results = []
            touched: set[TaskBuffer] = set()
            for (task, instance_id, record), item in zip(prepared, items, strict=True):
                if record.uid in self._uids:
                    self.duplicates += 1
                    if journal is not None:
                        journal.append(_DUPLICATE)
                    results.append(WriteResult(record.uid, task.task_type, duplicate=True))
                    continue
                self._remember(record.uid)
                if journal is not None:  # before add(): a group it fills logs its outcome
                    header: dict[str, Any] = {"e": "w", "t": task.task_type, "i": instance_id}
                    header.update(u=record.uid, r=record.reward, at=wall)
                    journal.append(encode(header, [record.raw]))
                task.add(instance_id, record, now)
                for observe in self.write_observers:
                    observe(task.task_type, item)
                self._written_seq += 1
                self.recent.append(
                    (self._written_seq, task.task_type, instance_id, record.uid, record.reward, wall)
                )
                touched.add(task)
                results.append(WriteResult(record.uid, task.task_type, duplicate=False))
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
        reward = item["reward"]
        if isinstance(reward, dict):
            scalar = _scalar_reward(prefix + "reward", reward, task.settings.reward_key)
            item = {**item, "reward": scalar, "rewards": reward}
            reward = scalar
        uid = item.get("uid")
        if not uid:
            uid = str(uuid.uuid4())
            item = {**item, "uid": uid}
        if "extra_info" not in item:
            item = {**item, "extra_info": {}}
        try:
            raw = encoding.dumps(item)
        except encoding.EncodeError as exc:  # validation cannot see it: an integer beyond 64 bits
            path = encoding.huge_integer_at(item)
            if path is None:
                raise InvalidInput.one(prefix.rstrip(".") or "body", f"cannot be stored: {exc}") from None
            field = prefix + ".".join(str(part) for part in path)
            limits = f"{encoding.INT64_MIN} to {encoding.INT64_MAX}"
            raise InvalidInput.one(field, f"must be a 64-bit integer, {limits}") from None
        return task, item["instance_id"], Record(uid, float(reward), raw)

    def _check_room(self, prepared: list[tuple[TaskBuffer, InstanceId, Record]]) -> None:
        """Refuse, whole, a write whose trajectories beyond what the open groups lack would take
        the buffer past ``max_buffered``. What fills a group already open is always taken, so
        groups can finish while the trainer catches up; a batch is taken all or none, as its
        validation is. O(1) when it fits anyway, else O(batch)."""
        held = self._held.items
        if held + len(prepared) <= self.max_buffered:
            return
        lacking: dict[tuple[str, InstanceId], int] = {}
        uids: set[str] = set()
        adding = 0
        for task, instance_id, record in prepared:
            if record.uid in self._uids or record.uid in uids:
                continue  # a duplicate adds nothing
            uids.add(record.uid)
            key = (task.task_type, instance_id)
            left = lacking.get(key)
            if left is None:
                group = task.open.get(instance_id)
                left = group.size - len(group.records) if group is not None else 0
            if left > 0:
                lacking[key] = left - 1
            else:
                lacking[key] = 0
                adding += 1
        if adding > self.max_buffered:
            self.refused_full += 1
            raise BatchTooLarge(adding, self.max_buffered)
        if adding and held + adding > self.max_buffered:
            self.refused_full += 1
            raise BufferFull(held, self.max_buffered, adding)

    def buffered_items(self) -> int:
        """Trajectories held: in open groups and in ready ones."""
        return self._held.items

    def _remember(self, uid: str) -> None:
        self._uids.add(uid)
        self._uid_order.append(uid)
        if len(self._uid_order) > self._dedup_window:
            self._uids.discard(self._uid_order.popleft())

    # -- reads -------------------------------------------------------------------------

    def read(
        self,
        task_type: str | None = None,
        max_items: int | None = None,
        *,
        mix: Mapping[str, float] | None = None,
    ) -> ReadResult:
        """Take ready groups, oldest first, whole: as many as fit in ``max_items`` (all when
        ``None``) but at least one. With ``one_group_per_instance``, a later group of an
        instance already taken stays for the next read (slime's trainer merges one read's
        groups by ``instance_id``). A read that returns groups starts a new statistics window;
        one that returns none reports the statistics so far and keeps them.

        ``mix`` (task: weight), or the tasks' own weights when no ``task_type`` is named and a
        task has one, shares the read between tasks (``buffer.core.reads.choose_mixed``).
        Groups past their task's ``max_staleness`` are set aside first, never served."""
        with self._lock:
            journal = self._journal
            if journal is not None and journal.failing is not None:
                raise StorageFailed(journal.failing)  # nothing is taken that could not be kept
            tasks = self._covered(task_type) if mix is None else [self._task(name) for name in mix]
            self._expire(tasks)
            stale = self._set_stale_aside(tasks)
            weights = dict(mix) if mix is not None else self._task_weights(task_type, tasks)
            mixed: dict[str, Any] | None = None
            if weights is not None and max_items is not None:
                by_name = {task.task_type: task for task in tasks}
                chosen, mixed = policy_reads.choose_mixed(
                    by_name, weights, max_items, self.policy, self.one_group_per_instance
                )
            else:
                chosen = self._choose(tasks, max_items)
            by_task: dict[str, list[int]] = {}
            for group in chosen:
                by_task.setdefault(group.task_type, []).append(group.seq)
            for name, seqs in by_task.items():
                self._tasks[name].take_ready(seqs)
            groups = chosen
            taken = sum(len(group.items) for group in groups)
            lags = self._account_served(tasks, groups, max_items)
            meta = self._meta_info(tasks)
            if not groups:
                meta["finished_groups"] = []
                meta["discarded_groups"] = {}
                if stale:
                    meta["stale_groups"] = stale
                return ReadResult([], meta)
            finished: list[InstanceId] = []
            discarded: Counter[str] = Counter()
            windows = [_Window.of(task) for task in tasks] if journal is not None else []
            for task in tasks:
                task_finished, task_discarded = task.reset_window()
                finished.extend(task_finished)
                discarded.update(task_discarded)
            meta["finished_groups"] = finished
            meta["discarded_groups"] = dict(discarded)
            meta["returned_groups"] = len(groups)
            if stale:
                meta["stale_groups"] = stale
            if mixed is not None:
                meta["mix"] = mixed
            if self.policy.version is not None:
                meta["policy_version"] = self.policy.version
                if lags:
                    meta["version_lag"] = {"min": min(lags), "max": max(lags)}
            served_at = self._wall_clock()
            for group in groups:
                self._tasks[group.task_type].record_served(group, served_at)
            self.total_read += taken
            self.reads += 1
            if journal is not None:
                wall = self._wall_clock()
                header: dict[str, Any] = {
                    "e": "read",
                    "t": task_type,
                    "seqs": [group.seq for group in groups],
                }
                if task_type is None:  # which task each group came from: a read may pass groups over
                    header["ts"] = [group.task_type for group in groups]
                read_id = self.reads
                journal.read(
                    encode({**header, "at": wall, "id": read_id}),
                    lambda: export.rows(groups, wall, read_id),
                    lambda: self._unread(groups, taken, windows),
                )
            return ReadResult(groups, meta)

    # -- the policy's part in reads (buffer.policy) ----------------------------------------

    def _set_stale_aside(self, tasks: list[TaskBuffer]) -> dict[str, int]:
        """Take every ready group past its task's ``max_staleness`` off the queue (journaled)."""
        counts: dict[str, int] = {}
        for task in tasks:
            seqs = policy_reads.stale_groups(task, self.policy, self._spans)
            if not seqs:
                continue
            policy_reads.drop(task, seqs)
            for seq in seqs:
                self._spans.pop(seq, None)
            counts[task.task_type] = len(seqs)
            self.policy.count_stale(task.task_type, len(seqs))
            if self._journal is not None:
                self._journal.append(encode({"e": "stale", "t": task.task_type, "seqs": seqs}))
        if counts:
            self.policy.notify()
        return counts

    def _task_weights(self, task_type: str | None, tasks: list[TaskBuffer]) -> dict[str, float] | None:
        """The tasks' weights for a read naming no task, if any task has one."""
        if task_type is not None or not any(task.settings.weight is not None for task in tasks):
            return None
        return {
            task.task_type: 1.0 if task.settings.weight is None else task.settings.weight
            for task in tasks
            if not task.hooks_source or task.hooks_source != EVALUATION_SOURCE
        }

    def consumed_groups(self, task_type: str) -> int:
        """Groups of the task that have left the buffer: served, discarded (the filter,
        timeouts, stale) or set aside; what admission counts against."""
        with self._lock:
            task = self._tasks.get(task_type)
            if task is None:
                return 0
            return task.delivered_groups + sum(task.discarded.values()) + task.set_aside_total

    def _lag(self, group: ReadyGroup) -> int | None:
        if self.policy.version is None:
            return None
        return self.policy.lag_of(policy_reads.span_of(group, self._spans))

    def _account_served(
        self, tasks: list[TaskBuffer], groups: list[ReadyGroup], max_items: int | None
    ) -> list[int]:
        """Count what a read served (shares, lags) and tell the admissions about the demand;
        returns the lags that are known."""
        lags = []
        for group in groups:
            lag = self._lag(group)
            self._spans.pop(group.seq, None)
            self.policy.served(group.task_type, len(group.items), lag)
            if lag is not None:
                lags.append(lag)
        for task in tasks:
            admission = self.policy.admission(task.task_type)
            if admission is not None and max_items is not None:
                admission.saw_read(-(-max_items // max(1, task.settings.group_size)))
        self.policy.notify()
        return lags

    def _unread(self, groups: list[ReadyGroup], taken: int, windows: list[_Window]) -> None:
        """Give back the groups of a read the journal could not commit (under the lock, newest
        read first): they go back to the head of their tasks, never counted as delivered, and
        the statistics windows it closed are open again: the state a restart would replay."""
        popped = Counter(group.task_type for group in groups)
        for window in windows:
            window.reopen(popped[window.task.task_type])
        for name in popped:
            task = self._tasks[name]
            back = [group for group in groups if group.task_type == name]
            # in their places again: a read may have passed groups over, so not all at the head
            task.ready = deque(heapq.merge(task.ready, back, key=lambda group: group.seq))
            for group in back:
                task.ready_items += len(group.items)
                task.delivered_items -= len(group.items)
                task.delivered_groups -= 1
        self.total_read -= taken
        self.reads -= 1

    def peek(self, task_type: str | None = None, max_items: int | None = None) -> list[ReadyGroup]:
        """The groups a read would return, left in place."""
        with self._lock:
            tasks = self._covered(task_type)
            self._expire(tasks)
            return self._choose(tasks, max_items)

    def _choose(self, tasks: list[TaskBuffer], max_items: int | None) -> list[ReadyGroup]:
        """The groups a read takes, oldest first across ``tasks``, merged through a heap of
        each task's next group: O(groups looked at x log tasks), nothing moved. The groups
        looked at are those returned, and the later groups of their instances passed over."""
        iterators = [iter(task.ready) for task in tasks if task.ready]
        heap: list[tuple[int, int, ReadyGroup]] = []
        for index, iterator in enumerate(iterators):
            head = next(iterator)
            heap.append((head.seq, index, head))
        heapq.heapify(heap)
        chosen: list[ReadyGroup] = []
        instances: set[InstanceId] = set()
        taken = 0
        while heap and (max_items is None or taken < max_items):
            _, index, group = heap[0]
            if not (self.one_group_per_instance and group.instance_id in instances):
                size = len(group.items)
                if chosen and max_items is not None and taken + size > max_items:
                    break
                chosen.append(group)
                instances.add(group.instance_id)
                taken += size
            following = next(iterators[index], None)
            if following is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (following.seq, index, following))
        return chosen

    def ready_items(self, task_type: str | None = None) -> int:
        with self._lock:
            tasks = self._covered(task_type)
            self._expire(tasks)
            return sum(task.ready_items for task in tasks)

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

    def _meta_info(self, tasks: list[TaskBuffer]) -> dict[str, Any]:
        active = [
            task for task in tasks if task.window.count or "get_group_data_meta_info" in task.hooks.overridden
        ]
        if len(active) == 1:
            return active[0].window_meta_info()
        merged = RewardStats()
        for task in active:
            merged = merged.merge(task.window)
        meta = merged.meta_info(sum(len(task.window_instances) for task in active))
        if len(active) > 1:
            meta["tasks"] = {task.task_type: task.window_meta_info() for task in active}
        return meta

    # -- observation -------------------------------------------------------------------

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (under the buffer's lock: keep it short) whenever a group becomes ready."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()

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

    # -- generator jobs ----------------------------------------------------------------

    def job_started(self, task_type: str, generator: str, data: dict[str, Any]) -> None:
        """Remember that ``generator`` runs as ``task_type`` with ``data``, across restarts,
        and count the groups of the task that finish from now on (``resume_point``)."""
        with self._lock:
            self.jobs[task_type] = {"generator": generator, "data": data, "crashes": 0}
            self._task(task_type).job_finished = Counter()
            if self._journal is not None:
                self._journal.append(encode({"e": "job", "t": task_type, "g": generator, "data": data}))

    def job_ended(self, task_type: str) -> None:
        """The task's job finished, failed or was cancelled: a restart leaves it ended."""
        with self._lock:
            if self.jobs.pop(task_type, None) is not None and self._journal is not None:
                self._journal.append(encode({"e": "job_end", "t": task_type}))
            if (task := self._tasks.get(task_type)) is not None:
                task.job_finished = None

    def job_paused(self, task_type: str) -> None:
        """The service is shutting down cleanly with the task's job running: it resumes after
        the restart, and this stop is no crash."""
        with self._lock:
            spec = self.jobs.get(task_type)
            if spec is not None:
                spec["paused"] = True
                if self._journal is not None:
                    self._journal.append(encode({"e": "job_pause", "t": task_type}))

    def crashes_if_resumed(self, task_type: str) -> int:
        """How many times in a row the service has stopped without shutting down while the
        task's job ran, counting the stop just before this start: 0 after a clean stop."""
        with self._lock:
            spec = self.jobs[task_type]
            return 0 if spec.get("paused") else int(spec.get("crashes", 0)) + 1

    def job_resumed(self, task_type: str, crashes: int) -> None:
        """The task's job runs again after a restart; ``crashes`` as ``crashes_if_resumed``."""
        with self._lock:
            spec = self.jobs[task_type]
            spec["crashes"], spec["paused"] = crashes, False
            if self._journal is not None:
                self._journal.append(encode({"e": "job_resume", "t": task_type, "crashes": crashes}))

    def resume_point(self, task_type: str) -> dict[str, Any]:
        """What the task's job has produced since it started, for the job resumed to make only
        what is missing: ``finished_groups``, ``[instance_id, groups]`` finished (delivered,
        ready, discarded or set aside); ``open_groups``, ``[instance_id, repeats]`` with the
        ``extra_info.repeat`` of each trajectory an open group holds (``None`` where absent).
        Groups that timed out while the service was down finish first, as they would have."""
        with self._lock:
            task = self._task(task_type)
            task.expire(self._clock())
            finished = task.job_finished or Counter()
            return {
                "finished_groups": [[instance_id, count] for instance_id, count in finished.items()],
                "open_groups": [
                    [group.instance_id, [_repeat_of(record.raw) for record in group.records]]
                    for group in task.open.values()
                ],
            }

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

    # -- the journal -------------------------------------------------------------------

    def restore(self, events: Iterable[Event]) -> int:
        """Rebuild the state from journal records (before ``attach``); returns how many.
        Open groups keep their age: their last write is dated by the wall clock."""
        offset = self._clock() - self._wall_clock()

        def monotonic_of(wall: float) -> float:
            return wall + offset

        count = 0
        with self._lock:
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
            task, instance_id, wall = self._task(header["t"]), header["i"], header["at"]
            record = Record(header["u"], header["r"], event.payload)
            self._remember(record.uid)
            task.add(instance_id, record, monotonic_of(wall), finish=False)
            self._written_seq += 1
            self.recent.append(
                (self._written_seq, task.task_type, instance_id, record.uid, record.reward, wall)
            )
        elif kind == "fin":
            self._tasks[header["t"]].replay_finish(event)
            self._seq = max(self._seq, header.get("seq", -1) + 1)
        elif kind == "dup":
            self.duplicates += 1
        elif kind == "stale":
            policy_reads.drop(self._tasks[header["t"]], header["seqs"])
        elif kind == "nop":  # a read the journal took back, a compaction
            pass
        elif kind == "read":
            tasks = self._covered(header["t"])
            if header["t"] is None and "ts" not in header:
                # Recorded before a read could pass groups over: each group it took was a head.
                for seq in header["seqs"]:
                    task = next(task for task in tasks if task.ready and task.ready[0].seq == seq)
                    self.total_read += len(task.take_ready([seq])[0].items)
            else:
                names = header.get("ts") or [header["t"]] * len(header["seqs"])
                by_task: dict[str, list[int]] = {}
                for name, seq in zip(names, header["seqs"], strict=True):
                    by_task.setdefault(name, []).append(seq)
                for name, seqs in by_task.items():
                    self.total_read += sum(len(group.items) for group in self._tasks[name].take_ready(seqs))
            for task in tasks:
                task.reset_window()
            self.reads = header["id"]
        elif kind == "job":
            self.jobs[header["t"]] = {"generator": header["g"], "data": header["data"], "crashes": 0}
            self._task(header["t"]).job_finished = Counter()
        elif kind == "job_end":
            self.jobs.pop(header["t"], None)
            if (ended := self._tasks.get(header["t"])) is not None:
                ended.job_finished = None
        elif kind == "job_pause":
            self.jobs[header["t"]]["paused"] = True
        elif kind == "job_resume":
            self.jobs[header["t"]].update(crashes=header["crashes"], paused=False)
        elif kind == "task":
            source = header["h"]
            settings = TaskSettings(**header["s"])
            self._configure(header["t"], settings, self._hooks_of(source), source, current=header["current"])
        elif kind == "state":
            self._current_task = header["current"]
            self._seq = max(self._seq, header["seq"])
            self.duplicates, self.total_read = header["duplicates"], header["total_read"]
            self.reads, self._written_seq = header["reads"], header["written_seq"]
            self.recent.extend(tuple(entry) for entry in header["recent"])
            self.jobs = header.get("jobs", {})
            for task_type, spec in self.jobs.items():
                finished = spec.pop("finished", None)
                if finished is not None:
                    self._task(task_type).job_finished = Counter({iid: count for iid, count in finished})
            for uid in header["uids"]:
                self._remember(uid)
        else:
            self._tasks[header["t"]].restore(event, monotonic_of)
            if kind == "ready":
                self._seq = max(self._seq, header["seq"] + 1)

    def attach(self, journal: Journal) -> None:
        """Log every change from now on to ``journal`` and let it compact through ``snapshot``.
        Finishes the groups a restore left full but open."""
        with self._lock:
            self._journal = journal
            journal.start(self.snapshot, lock=self._lock)
            for task in self._tasks.values():
                task.log = journal.append
                task.finish_full()

    @property
    def journal(self) -> Journal | None:
        return self._journal

    async def wait_durable(self) -> None:
        """Return once every change made so far is on disk (at once without a journal)."""
        if self._journal is not None:
            await self._journal.wait_durable()

    def _job_record(self, task_type: str, spec: dict[str, Any]) -> dict[str, Any]:
        """A job as the snapshot keeps it: with the groups its task finished since it started."""
        task = self._tasks.get(task_type)
        finished = task.job_finished if task is not None else None
        return {**spec, "finished": list(map(list, finished.items())) if finished is not None else None}

    def snapshot(self) -> tuple[int, Iterator[bytes]]:
        """The journal's position and the records of the state as of it: the references are
        copied under the lock, the encoding happens as they are read."""
        assert self._journal is not None
        with self._lock:
            position = self._journal.position()
            offset = self._wall_clock() - self._clock()
            tasks = [task.snapshot(lambda monotonic: monotonic + offset) for task in self._tasks.values()]
            state = {
                "e": "state",
                "current": self._current_task,
                "seq": self._seq,
                "duplicates": self.duplicates,
                "total_read": self.total_read,
                "reads": self.reads,
                "written_seq": self._written_seq,
                "recent": list(self.recent),
                "jobs": {name: self._job_record(name, spec) for name, spec in self.jobs.items()},
                "uids": list(self._uid_order),
            }
            extensions = [extension.snapshot() for extension in self._extensions.values()]
            extensions.append(iter(list(self._unclaimed)))

        def records() -> Iterator[bytes]:
            for task in tasks:
                yield from task()
            yield encode(state)
            for extension in extensions:
                yield from extension

        return position, records()


@dataclass(frozen=True, slots=True)
class _Window:
    """A task's statistics window as a read closes it, to reopen if the read is taken back."""

    task: TaskBuffer
    stats: RewardStats
    instances: set[InstanceId]
    records: list[tuple[InstanceId, Record]]
    finished: list[InstanceId]
    discarded: Counter[str]

    @classmethod
    def of(cls, task: TaskBuffer) -> _Window:
        return cls(
            task, task.window, task.window_instances, task.window_records,
            task.finished_instance_ids, task.window_discarded,
        )  # fmt: skip

    def reopen(self, popped: int) -> None:
        """Merge it back in front of what the task gathered since; ``popped``: groups the
        read took from this task, whose ids its pops added to ``finished``."""
        task = self.task
        task.window = self.stats.merge(task.window)
        task.window_instances = self.instances | task.window_instances
        task.window_records = self.records + task.window_records
        task.finished_instance_ids = self.finished[: len(self.finished) - popped] + task.finished_instance_ids
        task.window_discarded = self.discarded + task.window_discarded


_DUPLICATE = encode({"e": "dup"})


def _repeat_of(raw: bytes) -> int | None:
    """A trajectory's ``extra_info.repeat``, where the toolkit wrote one."""
    extra_info = encoding.loads(raw).get("extra_info")
    repeat = extra_info.get("repeat") if isinstance(extra_info, dict) else None
    return repeat if isinstance(repeat, int) and not isinstance(repeat, bool) else None


def _scalar_reward(field: str, reward: dict[str, Any], reward_key: str | None) -> float:
    """The number a dict of named rewards is trained on: ``reward_key``'s, or the only one."""
    if reward_key is not None:
        if reward_key not in reward:
            raise InvalidInput.one(
                field, f"has no key {reward_key!r} (the task's reward_key); keys: {sorted(reward)}"
            )
        value = reward[reward_key]
    elif len(reward) == 1:
        (value,) = reward.values()
    else:
        raise InvalidInput.one(
            field,
            f"names several rewards {sorted(reward)}; set reward_key in /start_rollout to choose one",
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput.one(field, f"the chosen reward {value!r} is not a finite number")
    return float(value)
