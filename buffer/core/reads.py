"""The read path: which ready groups a read takes, what it reports, and how it is kept.

``RolloutBuffer.read`` checks the store, picks the tasks and finishes their timed-out groups,
then hands over to ``ReadPath.read`` (under the buffer's lock), which in order:

1. sets aside the groups past their task's ``max_staleness`` (``stale_groups``; a ``stale``
   record);
2. chooses the groups: oldest first across the tasks (``choose``), or shared between tasks
   by weight (``choose_mixed``, ``buffer.core.mixing``), one group per ``instance_id``;
3. takes them off their tasks' queues and counts what was served (lags, admissions);
4. reports the statistics window (``meta_info``) and closes it, and the statistics of the
   groups it returns (``served``);
5. with the replay pool on (``buffer.core.replay_pool``), mixes in groups served before, at
   most the read's ``replay_ratio`` of them, and keeps the good fresh groups in the pool;
6. keeps the read in the store: its ``read`` record (with the pool's change) and export rows
   together, with the way to take it back (``_unread``) should the store fail to keep it.

A restart replays the ``read`` and ``stale`` records (``replay_read``, ``TaskBuffer.drop_ready``)
to the same state. Everything here runs under the buffer's lock.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from buffer import encoding
from buffer.core.hooks import EVALUATION_SOURCE
from buffer.core.mixing import allocate, fill_shortfall
from buffer.core.pipeline import served_rewards
from buffer.core.records import encode, export_rows
from buffer.core.replay_pool import PoolChange, PoolEntry, ReplayPool, ReplaySettings, replay_count
from buffer.core.stats import RewardStats
from buffer.core.task import InstanceId, ReadyGroup, TaskBuffer, Window
from buffer.errors import InvalidInput
from buffer.policy.state import Policy
from buffer.policy.versions import group_versions

if TYPE_CHECKING:
    from collections.abc import Callable

    from buffer.store.base import Store

#: The reason a group past its task's ``max_staleness`` is counted under.
STALE = "stale"
#: Why a read asking for replay is refused while the pool is off.
REPLAY_OFF = "the replay pool is off: start the service with --replay-capacity N"


@dataclass(slots=True)
class ReadResult:
    groups: list[ReadyGroup]  #: the fresh groups, then those replayed from the pool
    meta_info: dict[str, Any]
    replayed: int = 0  #: how many of ``groups`` (the last) the replay pool served again

    @property
    def num_items(self) -> int:
        return sum(len(group.items) for group in self.groups)


def span_of(group: ReadyGroup, cache: dict[int, tuple[int, int] | None]) -> tuple[int, int] | None:
    """A ready group's (lowest, highest) version, parsed once per group."""
    if group.seq not in cache:
        cache[group.seq] = group_versions(group.items)
    return cache[group.seq]


def stale_groups(task: TaskBuffer, policy: Policy, cache: dict[int, tuple[int, int] | None]) -> list[int]:
    """The seqs of the task's ready groups whose lag is past its ``max_staleness``."""
    bound = task.settings.max_staleness
    if bound is None or policy.version is None:
        return []
    stale = []
    for group in task.ready:
        lag = policy.lag_of(span_of(group, cache))
        if lag is not None and lag > bound:
            stale.append(group.seq)
    return stale


def choose_mixed(
    tasks: Mapping[str, TaskBuffer],
    weights: Mapping[str, float],
    max_items: int,
    policy: Policy,
    one_group_per_instance: bool,
) -> tuple[list[ReadyGroup], dict[str, Any]]:
    """The groups one mixed read of at most ``max_items`` items takes (at least one group),
    left in place: each task's share by largest remainder over the run, a short task made up
    by the others. With ``one_group_per_instance``, a later group of an instance already
    chosen waits for the next read, as in an unmixed read."""
    sizes = [task.settings.group_size for task in tasks.values()] or [1]
    total = max(1, max_items // max(1, min(sizes)))
    eligible: dict[str, list[ReadyGroup]] = {}
    seen: set[Any] = set()
    for name, task in tasks.items():
        eligible[name] = []
        for group in task.ready:
            if one_group_per_instance and group.instance_id in seen:
                continue
            seen.add(group.instance_id)
            eligible[name].append(group)
    served = {name: policy.served_groups.get(name, 0) for name in tasks}
    quota = allocate(weights, served, total)
    requested = dict(quota)
    available = {name: len(groups) for name, groups in eligible.items()}
    short = fill_shortfall(quota, available, weights)
    chosen: list[ReadyGroup] = []
    taken = 0
    returned: dict[str, int] = dict.fromkeys(tasks, 0)
    # Round-robin across tasks so a batch cut short by max_items still holds every share.
    progress = True
    while progress:
        progress = False
        for name in tasks:
            if returned[name] >= quota.get(name, 0) or returned[name] >= len(eligible[name]):
                continue
            group = eligible[name][returned[name]]
            size = len(group.items)
            if chosen and taken + size > max_items:
                continue
            chosen.append(group)
            taken += size
            returned[name] += 1
            progress = True
    meta: dict[str, Any] = {"weights": dict(weights), "requested": requested, "returned": returned}
    if short:
        meta["short"] = short
        meta["message"] = "made up by other tasks: " + ", ".join(
            f"{name} had {available.get(name, 0)} of {requested[name]}" for name in sorted(short)
        )
    return chosen, meta


def choose(tasks: list[TaskBuffer], max_items: int | None, one_group_per_instance: bool) -> list[ReadyGroup]:
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
        if not (one_group_per_instance and group.instance_id in instances):
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


def meta_info(tasks: list[TaskBuffer]) -> dict[str, Any]:
    """The statistics a read reports: of the one task with any, or merged over several
    (with each task's under ``tasks``)."""
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


def served_meta_info(groups: list[ReadyGroup]) -> dict[str, Any]:
    """The statistics of what a read returns (``meta_info["served"]``): the raw rewards of its
    items, padded copies left out. The top-level figures are slime's, over what was written
    since the previous read, which is nothing while a trainer drains a backlog."""
    stats = RewardStats()
    for group in groups:
        rewards = group.rewards
        if rewards is None:  # restored from a snapshot: the items say
            rewards = group.rewards = served_rewards([encoding.loads(raw) for raw in group.items])
        for reward in rewards:
            stats.add(reward)
    return stats.meta_info(len(groups))


def task_weights(task_type: str | None, tasks: list[TaskBuffer]) -> dict[str, float] | None:
    """The tasks' weights for a read naming no task, if any task has one."""
    if task_type is not None or not any(task.settings.weight is not None for task in tasks):
        return None
    return {
        task.task_type: 1.0 if task.settings.weight is None else task.settings.weight
        for task in tasks
        if not task.hooks_source or task.hooks_source != EVALUATION_SOURCE
    }


@dataclass(slots=True)
class _Replay:
    """What a read may take from the replay pool, planned before its fresh groups are chosen."""

    lagged: list[PoolEntry]  #: past ``max_lag``: leave with this read
    ranked: list[PoolEntry]  #: what it may serve, highest priority first
    batch: int | None = None  #: the read's batch in groups (None: no batch asked)
    most: int = 0  #: at most this many groups (with a batch)
    reserved: int | None = None  #: items kept from the fresh groups for them (with a batch)


class ReadPath:
    """The reads of one buffer: takes groups for them, and owns what reads count (``reads``,
    the export's ``read_id``; ``total_read``, the trajectories delivered), the versions
    parsed of ready groups (``span_of``'s cache) and the replay pool."""

    def __init__(
        self, policy: Policy, wall_clock: Callable[[], float], replay: ReplaySettings | None = None
    ) -> None:
        self.policy = policy
        self._wall_clock = wall_clock
        self.pool = ReplayPool(replay)
        self.reads = 0  # reads that returned groups: the export's read_id
        self.total_read = 0
        self._spans: dict[int, tuple[int, int] | None] = {}  # group versions, by ready seq

    def read(
        self,
        tasks: list[TaskBuffer],
        task_type: str | None,
        max_items: int | None,
        mix: Mapping[str, float] | None,
        one_group_per_instance: bool,
        store: Store | None,
        replay_ratio: float = 0.0,
    ) -> ReadResult:
        """A read of ``tasks`` (their timed-out groups finished already): see the module's
        docstring. ``task_type`` is what the read named (None: every task); ``replay_ratio``:
        the share of the groups returned that may come from the replay pool."""
        if replay_ratio and not self.pool.enabled:
            raise InvalidInput.one("replay_ratio", REPLAY_OFF)
        by_name = {task.task_type: task for task in tasks}
        stale = self._set_stale_aside(tasks, store)
        weights = dict(mix) if mix is not None else task_weights(task_type, tasks)
        replay = self._plan_replay(tasks, max_items, replay_ratio) if self.pool.active else None
        fresh_max = max_items
        if fresh_max is not None and replay is not None and replay.reserved:
            fresh_max -= replay.reserved  # the items of the groups the pool may serve
        mixed: dict[str, Any] | None = None
        if weights is not None and fresh_max is not None:
            groups, mixed = choose_mixed(by_name, weights, fresh_max, self.policy, one_group_per_instance)
        else:
            groups = choose(tasks, fresh_max, one_group_per_instance)
        by_task: dict[str, list[int]] = {}
        for group in groups:
            by_task.setdefault(group.task_type, []).append(group.seq)
        for name, seqs in by_task.items():
            by_name[name].take_ready(seqs)
        taken = sum(len(group.items) for group in groups)
        spans = {group.seq: span_of(group, self._spans) for group in groups} if self.pool.enabled else {}
        lags = self._account_served(tasks, groups, max_items)
        meta = meta_info(tasks)
        if not groups:
            meta["finished_groups"] = []
            meta["discarded_groups"] = {}
            if stale:
                meta["stale_groups"] = stale
            return ReadResult([], meta)
        closed = [(task, task.close_window()) for task in tasks]
        finished: list[InstanceId] = []
        discarded: Counter[str] = Counter()
        for _, window in closed:
            finished.extend(window.finished)
            discarded.update(window.discarded)
        meta["finished_groups"] = finished
        meta["discarded_groups"] = dict(discarded)
        served_at = self._wall_clock()
        for group in groups:
            by_name[group.task_type].record_served(group, served_at)
        self.total_read += taken
        self.reads += 1
        read_id = self.reads
        wall = self._wall_clock()
        returned, change = groups, None
        if replay is not None:
            served_meta_info(groups)  # the rewards of each group, for the pool to judge it
            returned, change = self._replay(replay, replay_ratio, by_name, groups, spans, wall, read_id)
        if replay_ratio:
            meta["replayed"] = len(returned) - len(groups)
        meta["returned_groups"] = len(returned)
        meta["served"] = served_meta_info(returned)
        if stale:
            meta["stale_groups"] = stale
        if mixed is not None:
            meta["mix"] = mixed
        if self.policy.version is not None:
            meta["policy_version"] = self.policy.version
            if lags:
                meta["version_lag"] = {"min": min(lags), "max": max(lags)}
        if store is not None:
            header: dict[str, Any] = {"e": "read", "t": task_type, "seqs": [group.seq for group in groups]}
            if task_type is None:  # which task each group came from: a read may pass groups over
                header["ts"] = [group.task_type for group in groups]
            if change is not None and (pool := change.record()) is not None:
                header["pool"] = pool
            store.read(
                encode({**header, "at": wall, "id": read_id}),
                lambda: export_rows(returned, wall, read_id),
                lambda: self._unread(groups, taken, closed, change),
            )
        return ReadResult(returned, meta, len(returned) - len(groups))

    def _plan_replay(self, tasks: list[TaskBuffer], max_items: int | None, ratio: float) -> _Replay:
        """What a read may take from the pool (before its fresh groups are chosen): the items
        of the best floor(ratio * batch) groups are kept from the fresh ones, as long as one
        fresh group still fits."""
        lagged = self.pool.lagged(self.policy.version)
        if not ratio or not self.pool.enabled:
            return _Replay(lagged, [])
        names = {task.task_type for task in tasks if task.hooks_source != EVALUATION_SOURCE}
        plan = _Replay(lagged, self.pool.ranked(names, lagged))
        if max_items is None:
            return plan
        smallest = min((task.settings.group_size for task in tasks), default=1)
        plan.batch = max(1, max_items // smallest)
        most = replay_count(ratio, plan.batch, plan.batch)  # floor(ratio * batch)
        chosen = self.pool.pick(plan.ranked, most, None)
        while chosen and max_items - sum(len(entry.items) for entry in chosen) < smallest:
            chosen.pop()
        plan.most = len(chosen)
        plan.reserved = sum(len(entry.items) for entry in chosen)
        return plan

    def _replay(
        self,
        plan: _Replay,
        ratio: float,
        by_name: Mapping[str, TaskBuffer],
        fresh: list[ReadyGroup],
        spans: Mapping[int, tuple[int, int] | None],
        wall: float,
        read_id: int,
    ) -> tuple[list[ReadyGroup], PoolChange]:
        """The groups a read returns, the fresh ones and then those replayed (never more than
        the share ``ratio``, none of an instance the fresh ones have), and the pool's change."""
        count = replay_count(ratio, len(fresh), plan.batch)
        if plan.batch is not None:
            count = min(count, plan.most)
        instances = {group.instance_id for group in fresh}
        used = self.pool.pick(plan.ranked, count, plan.reserved, instances) if count else []
        kept = [group for group in fresh if by_name[group.task_type].hooks_source != EVALUATION_SOURCE]
        change = self.pool.apply(plan.lagged, used, kept, spans, wall, read_id)
        replayed = [self.pool.serve(entry, self.policy.version) for entry in used]
        return fresh + replayed, change

    def _set_stale_aside(self, tasks: list[TaskBuffer], store: Store | None) -> dict[str, int]:
        """Take every ready group past its task's ``max_staleness`` off the queue (kept as a
        ``stale`` record)."""
        counts: dict[str, int] = {}
        for task in tasks:
            seqs = stale_groups(task, self.policy, self._spans)
            if not seqs:
                continue
            task.drop_ready(seqs, STALE)
            for seq in seqs:
                self._spans.pop(seq, None)
            counts[task.task_type] = len(seqs)
            self.policy.count_stale(task.task_type, len(seqs))
            if store is not None:
                store.append(encode({"e": "stale", "t": task.task_type, "seqs": seqs}))
        if counts:
            self.policy.notify()
        return counts

    def _lag(self, group: ReadyGroup) -> int | None:
        if self.policy.version is None:
            return None
        return self.policy.lag_of(span_of(group, self._spans))

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

    def _unread(
        self,
        groups: list[ReadyGroup],
        taken: int,
        closed: list[tuple[TaskBuffer, Window]],
        change: PoolChange | None = None,
    ) -> None:
        """Give back the groups of a read the store could not keep (under the buffer's lock,
        newest read first): they go back to their places in their tasks, never counted as
        delivered, the statistics windows it closed are open again and the replay pool is as
        before it: the state a restart would replay."""
        if change is not None:
            self.pool.undo(change)
        popped = Counter(group.task_type for group in groups)
        for task, window in closed:
            task.reopen_window(window, popped[task.task_type])
        for task, _ in closed:
            back = [group for group in groups if group.task_type == task.task_type]
            if back:
                task.give_back(back)
        self.total_read -= taken
        self.reads -= 1

    # -- a restart -----------------------------------------------------------------------

    def replay_read(
        self, header: dict[str, Any], covered: list[TaskBuffer], tasks: Mapping[str, TaskBuffer]
    ) -> None:
        """Apply a ``read`` record: ``covered`` are the tasks the read named (all for None)."""
        taken: list[ReadyGroup] = []
        if header["t"] is None and "ts" not in header:
            # Recorded before a read could pass groups over: each group it took was a head.
            for seq in header["seqs"]:
                task = next(task for task in covered if task.ready and task.ready[0].seq == seq)
                taken.extend(task.take_ready([seq]))
        else:
            names = header.get("ts") or [header["t"]] * len(header["seqs"])
            by_task: dict[str, list[int]] = {}
            for name, seq in zip(names, header["seqs"], strict=True):
                by_task.setdefault(name, []).append(seq)
            for name, seqs in by_task.items():
                taken.extend(tasks[name].take_ready(seqs))
        self.total_read += sum(len(group.items) for group in taken)
        for task in covered:
            task.close_window()
        self.reads = header["id"]
        if "pool" in header:
            self.pool.replay(
                header["pool"], {group.seq: group for group in taken}, header["at"], header["id"]
            )

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take the counters from a snapshot's ``state`` record."""
        self.total_read, self.reads = state["total_read"], state["reads"]
