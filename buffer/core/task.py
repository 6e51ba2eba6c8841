"""One task's groups: filling, finishing by size or timeout, and waiting whole to be read.

A group collects the trajectories of one ``instance_id``. It finishes when it reaches its
size (a later trajectory of the same instance opens a new group, so none is ever over-full)
or when no trajectory has arrived for ``group_timeout_s``. A finished group goes through the
read pipeline at once and then waits, encoded, in finishing order.

Open groups sit in an ``OrderedDict`` kept in order of their last write, so the groups that
time out are always at its front: a timeout check costs O(groups that expire), never a scan.
Each is kept as one flat tuple of atoms (``Stored``), which CPython's collector stops tracking
the first time it looks (a tuple exactly, not a subclass such as a ``NamedTuple``, nor one
holding a tuple it still tracks): a million pending groups add nothing to a full collection,
which would otherwise stop the event loop for seconds. ``TaskBuffer.open`` shows them as
``OpenGroup``s. A snapshot captures them in O(1) and encodes them outside the buffer's lock
(``open_table``).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from buffer import encoding
from buffer.core.hooks import Hooks
from buffer.core.open_table import OpenTable
from buffer.core.pipeline import (
    TIMEOUT_TOO_SMALL,
    Discarded,
    GroupRules,
    Outcome,
    Ready,
    SetAside,
    hook_item,
    process_group,
    reads_small_fields,
)
from buffer.core.records import Event, encode
from buffer.core.stats import RewardStats

logger = logging.getLogger(__name__)

InstanceId = str | int

#: A group a job made, as its task counts it: its instance and its epoch, the
#: ``extra_info.epoch`` its trajectories all say (None where they do not: a generator not
#: written with the toolkit, or one group of several epochs' trajectories).
JobGroup = tuple[InstanceId, int | None]


@dataclass(frozen=True, slots=True)
class TaskSettings:
    """How a task groups and judges its trajectories; set by ``/start_rollout``."""

    group_size: int = 16
    group_timeout_s: float = 300.0
    min_valid_group_size_ratio: float = 1.0
    min_valid_item_size_ratio: float = 0.7
    min_timeout_group_size_ratio: float = 0.7
    reward_key: str | None = None
    #: The bound on a group's version lag when served (None: no bound; ``buffer.policy``).
    max_staleness: int | None = None
    #: The task's share in mixed reads (None: 1, and the task takes part only when named).
    weight: float | None = None


class Record(NamedTuple):
    """One buffered trajectory: its JSON, and the two fields the buffer itself reads; ``head``:
    where its small fields end in ``raw`` (``encoding.dumps_parted``; 0: not parted, as in a
    journal written before)."""

    uid: str
    reward: float
    raw: bytes
    head: int = 0


class OpenGroup(NamedTuple):
    """A group still filling, as ``TaskBuffer.open`` shows it."""

    instance_id: InstanceId
    size: int
    last_write_s: float
    records: tuple[Record, ...]


#: An open group as kept: ``(instance_id, size, last_write_s, *fields)``, ``fields`` the fields of
#: its records (a ``Record``'s, one record after another); past ``_TUPLE_FIELDS`` (a tuple grows
#: by a copy) ``(instance_id, size, last_write_s, [*fields])``.
Stored = tuple[Any, ...]
_FIELDS = len(Record._fields)
_TUPLE_FIELDS = 64 * _FIELDS


def _fields(group: Stored) -> Sequence[Any]:
    return group[3] if type(group[3]) is list else group[3:]


def _view(group: Stored) -> OpenGroup:
    fields = _fields(group)
    records = tuple(Record(*fields[at : at + _FIELDS]) for at in range(0, len(fields), _FIELDS))
    return OpenGroup(group[0], group[1], group[2], records)


class OpenGroups(Mapping[InstanceId, OpenGroup]):
    """The open groups of a task, oldest write first, as ``OpenGroup``s made on access."""

    def __init__(self, groups: OpenTable[InstanceId]) -> None:
        self._groups = groups

    def __getitem__(self, instance_id: InstanceId) -> OpenGroup:
        group = self._groups.get(instance_id)
        if group is None:
            raise KeyError(instance_id)
        return _view(group)

    def __iter__(self) -> Iterator[InstanceId]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)


@dataclass(slots=True)
class ReadyGroup:
    seq: int
    task_type: str
    instance_id: InstanceId
    items: list[bytes]
    ready_at: float = 0.0  # wall-clock seconds it finished; 0: unknown (restored from a snapshot)
    #: The raw rewards of its items that are no padded copy (``pipeline.served_rewards``);
    #: None where not known yet (restored from a snapshot: the read decodes the items).
    rewards: tuple[float, ...] | None = None


@dataclass(slots=True)
class SetAsideGroup:
    """A group a hook failed on, kept for inspection."""

    task_type: str
    instance_id: InstanceId
    hook: str
    error: str
    traceback: str
    at: float
    items: list[bytes]


@dataclass(frozen=True, slots=True)
class Window:
    """A task's statistics since the last read that returned groups: what the next read's
    ``meta_info`` reports. A read closes it (``close_window``) and gives it back if the read
    is taken back (``reopen_window``)."""

    stats: RewardStats
    instances: set[InstanceId]
    records: list[tuple[InstanceId, Record]]
    finished: list[InstanceId]
    discarded: Counter[str]
    log: list[InstanceId]  # the instances in order (``TaskBuffer.window_log``), and their window
    epoch: int


@dataclass(slots=True)
class Tally:
    """Trajectories held by every task together (open groups and ready ones), kept as each
    task's counts change, so the buffer's limit costs O(1) on each write, whatever the tasks."""

    items: int = 0


class TaskBuffer:
    """The groups of one task type. Not thread-safe: ``RolloutBuffer`` serialises access.

    It owns its queues and counters: other modules read them and change them only through
    its methods, so each count has one place that keeps it right."""

    def __init__(
        self,
        task_type: str,
        settings: TaskSettings,
        hooks: Hooks,
        *,
        hooks_source: str | None = None,
        sequence: Callable[[], int],
        on_ready: Callable[[], None],
        log: Callable[[bytes], None] | None = None,
        keep_set_aside: int = 100,
        tally: Tally | None = None,
    ) -> None:
        """``hooks_source`` names where the hooks came from, for a restart to find them again;
        ``log`` receives a journal record for every group that finishes; ``tally`` follows
        ``pending_items + ready_items``, shared by the buffer's tasks."""
        self.task_type = task_type
        self.tally = tally or Tally()
        self._pending_items = 0
        self._ready_items = 0
        self.reconfigure(settings, hooks, hooks_source)
        self._sequence = sequence
        self._on_ready = on_ready
        self.log = log
        self._open: OpenTable[InstanceId] = OpenTable()  # -> Stored
        self.open = OpenGroups(self._open)
        self.ready: deque[ReadyGroup] = deque()
        #: For incremental snapshots (``track``): the seqs of ready groups taken or dropped since
        #: the last capture, and the highest seq a capture held (``core.snapshots``).
        self.ready_left: set[int] | None = None
        self.ready_top = -1
        self.set_aside: deque[SetAsideGroup] = deque(maxlen=keep_set_aside)
        self.pending_items = 0
        self.ready_items = 0
        # Totals since the task was created.
        self.written = 0
        self.delivered_items = 0
        self.delivered_groups = 0
        self.discarded: Counter[str] = Counter()
        self.set_aside_total = 0
        #: While a generator job runs for this task: the groups finished since it started,
        #: whatever their outcome, by instance and epoch (``JobGroup``), for a resumed job to
        #: skip (see ``RolloutBuffer.resume_point``). One entry per (instance, epoch).
        self.job_finished: Counter[JobGroup] | None = None
        self.rewards = RewardStats()  # every raw reward written, for metrics and the dashboard
        # How long the groups reads took had waited since they finished: the trainer's lag.
        # Kept since the service started (not restored: Prometheus reads a restart as a reset).
        self.served_age_s_sum = 0.0
        self.served_age_count = 0
        # Since the last successful read: what meta_info reports.
        self.window = RewardStats()
        self.window_instances: set[InstanceId] = set()
        #: The same instances in the order they came (a snapshot writes them in chunks, those
        #: changed since the last capture); the windows closed so far; and (for a delta) the
        #: window and count the snapshot holds (None: not known).
        self.window_log: list[InstanceId] = []
        self.window_epoch = 0
        self.window_base: tuple[int, int] | None = (0, 0)
        self.window_records: list[tuple[InstanceId, Record]] = []
        self.finished_instance_ids: list[InstanceId] = []
        self.window_discarded: Counter[str] = Counter()

    @property
    def pending_items(self) -> int:
        """Trajectories in open groups."""
        return self._pending_items

    @pending_items.setter
    def pending_items(self, value: int) -> None:
        self.tally.items += value - self._pending_items
        self._pending_items = value

    @property
    def ready_items(self) -> int:
        """Trajectories in finished groups waiting to be read."""
        return self._ready_items

    @ready_items.setter
    def ready_items(self, value: int) -> None:
        self.tally.items += value - self._ready_items
        self._ready_items = value

    def reconfigure(self, settings: TaskSettings, hooks: Hooks, hooks_source: str | None = None) -> None:
        """New settings apply to groups opened from now on; open groups keep their size."""
        self.settings = settings
        self.hooks = hooks
        self.hooks_source = hooks_source or self.task_type
        # A custom meta hook needs the trajectories written since the last read; the default doesn't.
        self._keep_window_records = "get_group_data_meta_info" in hooks.overridden
        # The defaults read only the small fields: a finished group decodes those alone.
        self._small_fields = reads_small_fields(hooks)

    def log_to(self, log: Callable[[bytes], None] | None) -> None:
        """Send the record of every group that finishes from now on to ``log`` (a store's
        ``append``; None: keep none)."""
        self.log = log

    def start_job_count(self, finished: Iterable[tuple[JobGroup, int]] = ()) -> None:
        """Count the groups of each instance and epoch that finish from now on
        (``job_finished``), starting from ``finished``: a job runs for this task."""
        self.job_finished = Counter(dict(finished))

    def stop_job_count(self) -> None:
        self.job_finished = None

    def add(self, instance_id: InstanceId, record: Record, now: float, *, finish: bool = True) -> None:
        """Add to the instance's open group; finish it when full (unless replaying the
        journal, whose next record says how it finished)."""
        group = self._open.get(instance_id)
        if group is None:
            size = self.settings.group_size
            group = (instance_id, size, now, *record)
        else:
            size, fields = group[1], group[3]
            if type(fields) is list:
                if self._open.capturing:  # the captured group keeps its records
                    fields = [*fields, *record]
                else:
                    fields.extend(record)
                group = (instance_id, size, now, fields)
            elif len(group) - 3 < _TUPLE_FIELDS:
                group = (instance_id, size, now, *group[3:], *record)
            else:
                group = (instance_id, size, now, [*group[3:], *record])
        self._open.put(instance_id, group)
        self.pending_items += 1
        self.written += 1
        self.window.add(record.reward)
        self.rewards.add(record.reward)
        if instance_id not in self.window_instances:
            self.window_instances.add(instance_id)
            self.window_log.append(instance_id)
        if self._keep_window_records:
            self.window_records.append((instance_id, record))
        if finish and len(_fields(group)) >= size * _FIELDS:
            self._open.pop(instance_id)
            self._finish(group, timed_out=False)

    def expire(self, now: float) -> int:
        """Finish every group with no write for ``group_timeout_s``; returns how many."""
        timeout_s = self.settings.group_timeout_s
        expired = 0
        while (oldest := self._open.oldest()) is not None:
            instance_id, group = oldest
            if now - group[2] < timeout_s:
                break
            self._open.pop(instance_id)
            self._finish(group, timed_out=True)
            expired += 1
        return expired

    def finish_full(self) -> None:
        """Finish the groups that are full but open: after a restart cut the journal between
        a group's last write and its outcome."""
        for group in [g for g in self._open.values() if len(_fields(g)) >= g[1] * _FIELDS]:
            self._open.pop(group[0])
            self._finish(group, timed_out=False)

    def _finish(self, stored: Stored, *, timed_out: bool) -> None:
        group = _view(stored)
        self.pending_items -= len(group.records)
        settings = self.settings
        # The hooks see whole items where the task defines any; else the small fields alone.
        small = self._small_fields
        items = [hook_item(record.raw, record.head if small else 0) for record in group.records]
        epoch = epoch_of(items)  # before the hooks, which may change the items
        if timed_out and len(group.records) / group.size < settings.min_timeout_group_size_ratio:
            outcome: Outcome = Discarded(TIMEOUT_TOO_SMALL)
        else:
            rules = GroupRules(
                group.size, settings.min_valid_group_size_ratio, settings.min_valid_item_size_ratio
            )
            outcome = process_group(
                self.task_type, group.instance_id, items, rules, self.hooks, timed_out=timed_out
            )
        seq = self._sequence() if isinstance(outcome, Ready) else -1
        at = time.time()
        if self.log is not None:
            self.log(_finish_record(self.task_type, group, outcome, seq, at, epoch))
        self._settle(group, outcome, seq, at, epoch)
        if isinstance(outcome, Discarded):
            logger.debug(
                "task %s: discarded group %r (%s)", self.task_type, group.instance_id, outcome.reason
            )
        elif isinstance(outcome, SetAside):
            logger.warning(
                "task %s: set group %r aside: hook %s failed: %s\n%s",
                self.task_type,
                group.instance_id,
                outcome.hook,
                outcome.error,
                outcome.traceback,
            )

    def _settle(self, group: OpenGroup, outcome: Outcome, seq: int, at: float, epoch: int | None) -> None:
        """Put a finished group where its outcome says: ready, counted as discarded, or aside;
        ``epoch``: the one its trajectories say (``epoch_of``)."""
        if self.job_finished is not None:
            self.job_finished[group.instance_id, epoch] += 1
        if isinstance(outcome, Ready):
            self.ready.append(
                ReadyGroup(seq, self.task_type, group.instance_id, outcome.items, at, outcome.rewards)
            )
            self.ready_items += len(outcome.items)
            self._on_ready()
            return
        self.finished_instance_ids.append(group.instance_id)
        if isinstance(outcome, Discarded):
            self.discarded[outcome.reason] += 1
            self.window_discarded[outcome.reason] += 1
            return
        self.set_aside_total += 1
        self.window_discarded[f"hook_error:{outcome.hook}"] += 1
        self.set_aside.append(
            SetAsideGroup(
                self.task_type,
                group.instance_id,
                outcome.hook,
                outcome.error,
                outcome.traceback,
                at,
                [record.raw for record in group.records],
            )
        )

    def replay_finish(self, event: Event) -> None:
        """Apply a journal record of ``_finish``."""
        header = event.header
        group = _view(self._open.pop(header["i"]))
        self.pending_items -= len(group.records)
        kind = header["o"]
        if kind == "ready":
            outcome: Outcome = Ready(event.parts())
        elif kind == "discarded":
            outcome = Discarded(header["reason"])
        else:
            outcome = SetAside(header["hook"], header["error"], header["tb"])
        self._settle(group, outcome, header.get("seq", -1), header["at"], header.get("ep"))

    # -- snapshots -------------------------------------------------------------------

    def settings_record(self, *, current: bool) -> bytes:
        """The journal record of this task's settings and hooks (``current``: unlabelled
        writes go to it), as a change and in a snapshot alike."""
        header = {"e": "task", "t": self.task_type, "s": asdict(self.settings), "h": self.hooks_source}
        return encode({**header, "current": current})

    def track(self, on: bool) -> None:
        """Note what changes from now on for incremental snapshots: a snapshot captures the
        task in O(1) for its open groups and O(changes) for the rest (``core.snapshots``,
        which reads these, under the buffer's lock; ``release_capture`` once read)."""
        self._open.track(on)
        self.ready_left = set() if on else None

    @property
    def can_delta(self) -> bool:
        """Whether everything changed since the last capture is known (tracked, not too much)."""
        return self._open.touched is not None and self.ready_left is not None and self.window_base is not None

    def release_capture(self) -> None:
        """The records of ``snapshot`` are read: the open groups may change in place again
        (call under the buffer's lock)."""
        self._open.release()

    def fold_capture(self) -> bool:
        """Fold a slice of what changed during the last capture back into the open groups
        (call under the buffer's lock, again while it returns True)."""
        return self._open.fold()

    def restore(self, event: Event, monotonic_of: Callable[[float], float]) -> None:
        """Apply a snapshot record (``open``, ``ready``, ``aside``, ``task_state``, ``wi``)."""
        header, kind = event.header, event.header["e"]
        if kind == "open":
            parts = event.parts()
            heads = header.get("h") or [0] * len(parts)  # none in a snapshot written before
            fields = [
                field
                for record in zip(header["u"], header["r"], parts, heads, strict=True)
                for field in record
            ]
            instance_id, size, last = header["i"], header["size"], monotonic_of(header["last"])
            kept = (*fields,) if len(fields) <= _TUPLE_FIELDS else (fields,)
            self._open.put(instance_id, (instance_id, size, last, *kept), touch=False)
            self.pending_items += len(parts)
        elif kind == "ready":
            items = event.parts()
            self.ready.append(ReadyGroup(header["seq"], self.task_type, header["i"], items))
            self.ready_top = max(self.ready_top, header["seq"])
            self.ready_items += len(items)
        elif kind == "aside":
            self.set_aside.append(
                SetAsideGroup(
                    self.task_type,
                    header["i"],
                    header["hook"],
                    header["error"],
                    header["tb"],
                    header["at"],
                    event.parts(),
                )
            )
        elif kind == "task_state":
            self.written = header["written"]
            self.delivered_items = header["delivered_items"]
            self.delivered_groups = header["delivered_groups"]
            self.discarded = Counter(header["discarded"])
            self.set_aside_total = header["set_aside_total"]
            self.rewards = RewardStats.from_json(header["rewards"])
            self.window = RewardStats.from_json(header["window"])
            if "window_instances" in header:  # a former snapshot's: not in chunks ("wi")
                self.window_instances.clear()  # the same set: a frozen one stays frozen (see close_window)
                self.window_instances.update(header["window_instances"])
                self.window_log[:] = self.window_instances
                self.window_base = None
            else:
                self.window_base = (self.window_epoch, header["wn"])
            self.finished_instance_ids = header["finished"]
            self.window_discarded = Counter(header["window_discarded"])
            self.window_records = [
                (iid, Record(uid, reward, raw))
                for (iid, uid, reward), raw in zip(header["window_records"], event.parts(), strict=True)
            ]
        elif kind == "wi":  # a chunk of the window's instances, in order
            self.window_instances.update(header["i"])
            self.window_log.extend(header["i"])
        else:
            raise ValueError(f"not a task snapshot record: {kind!r}")

    def pop_ready(self) -> ReadyGroup:
        """Take the oldest ready group."""
        return self.take_ready([self.ready[0].seq])[0]

    def take_ready(self, seqs: Collection[int]) -> list[ReadyGroup]:
        """Take the ready groups numbered ``seqs`` (a read's choice), oldest first; the groups
        before them that the read passed over keep their places at the front. O(groups up to
        the last one taken)."""
        wanted = set(seqs)
        taken: list[ReadyGroup] = []
        passed: list[ReadyGroup] = []
        while wanted:
            group = self.ready.popleft()
            if group.seq in wanted:
                wanted.discard(group.seq)
                taken.append(group)
            else:
                passed.append(group)
        self.ready.extendleft(reversed(passed))
        if self.ready_left is not None:
            self.ready_left.update(group.seq for group in taken)
        for group in taken:
            self.ready_items -= len(group.items)
            self.delivered_items += len(group.items)
            self.delivered_groups += 1
            self.finished_instance_ids.append(group.instance_id)
        return taken

    def give_back(self, groups: list[ReadyGroup]) -> None:
        """Undo ``take_ready`` for ``groups`` (a read that could not be kept): each goes back
        to its place by ``seq``, waiting again, no longer counted as delivered."""
        self.ready = deque(heapq.merge(self.ready, groups, key=lambda group: group.seq))
        if self.ready_left is not None:
            self.ready_left.difference_update(group.seq for group in groups)
        for group in groups:
            self.ready_items += len(group.items)
            self.delivered_items -= len(group.items)
            self.delivered_groups -= 1

    def drop_ready(self, seqs: Collection[int], reason: str) -> None:
        """Take the ready groups ``seqs`` off the queue, counted as discarded for ``reason``
        (reported with the next read, as a group the pipeline discarded is)."""
        wanted = set(seqs)
        kept = []
        for group in self.ready:
            if group.seq in wanted:
                if self.ready_left is not None:
                    self.ready_left.add(group.seq)
                self.ready_items -= len(group.items)
                self.finished_instance_ids.append(group.instance_id)
                self.discarded[reason] += 1
                self.window_discarded[reason] += 1
            else:
                kept.append(group)
        self.ready.clear()
        self.ready.extend(kept)

    def record_served(self, group: ReadyGroup, now: float) -> None:
        """Count the wait of a group a read took (live reads only: a replayed read would
        measure the restart, not the trainer)."""
        if group.ready_at > 0:
            self.served_age_s_sum += max(0.0, now - group.ready_at)
            self.served_age_count += 1

    def window_meta_info(self) -> dict[str, Any]:
        """Statistics since the last successful read, by the task's meta hook if it has one."""
        if "get_group_data_meta_info" not in self.hooks.overridden:
            return self.window.meta_info(len(self.window_instances))
        temp_data: dict[InstanceId, list[dict[str, Any]]] = {}
        for instance_id, record in self.window_records:
            temp_data.setdefault(instance_id, []).append(encoding.loads(record.raw))
        try:
            meta = dict(self.hooks.get_group_data_meta_info(temp_data))
        except Exception as exc:
            logger.exception(
                "task %s: get_group_data_meta_info failed; reporting the defaults", self.task_type
            )
            meta = self.window.meta_info(len(self.window_instances))
            meta["meta_info_error"] = f"{type(exc).__name__}: {exc}"
        return meta

    def close_window(self) -> Window:
        """Start a new statistics window (a read returned groups); returns the one closed."""
        closed = Window(
            self.window,
            set(self.window_instances),
            self.window_records,
            self.finished_instance_ids,
            self.window_discarded,
            self.window_log,
            self.window_epoch,
        )
        self.window = RewardStats()
        # Emptied, not replaced: the service freezes a task's containers (``gc.freeze``) so a full
        # collection never visits the million instance ids a long window can hold; a new set would not be.
        self.window_instances.clear()
        self.window_log = []
        self.window_epoch += 1
        self.window_records = []
        self.finished_instance_ids = []
        self.window_discarded = Counter()
        return closed

    def reopen_window(self, closed: Window, popped: int) -> None:
        """Merge a window ``close_window`` returned back in front of what was gathered since
        (the read that closed it was taken back); ``popped``: the groups that read took from
        this task, whose ids ``take_ready`` had added to its finished ids."""
        self.window = closed.stats.merge(self.window)
        since = [instance for instance in self.window_log if instance not in closed.instances]
        self.window_instances |= closed.instances
        self.window_log = closed.log + since  # the window closed goes on (a snapshot appends)
        self.window_epoch = closed.epoch
        self.window_records = closed.records + self.window_records
        finished = closed.finished[: len(closed.finished) - popped]
        self.finished_instance_ids = finished + self.finished_instance_ids
        self.window_discarded = closed.discarded + self.window_discarded

    def counters(self) -> dict[str, Any]:
        return {
            "task_type": self.task_type,
            "group_size": self.settings.group_size,
            "pending_groups": len(self.open),
            "pending_items": self.pending_items,
            "ready_groups": len(self.ready),
            "ready_items": self.ready_items,
            "total_written": self.written,
            "delivered_groups": self.delivered_groups,
            "delivered_items": self.delivered_items,
            "discarded_groups": dict(self.discarded),
            "set_aside_groups": self.set_aside_total,
            "reward_count": self.rewards.count,
            "reward_sum": self.rewards.mean * self.rewards.count,
            "reward_mean": self.rewards.mean if self.rewards.count else 0.0,
            "reward_std": self.rewards.sample_std,
            # The trainer's lag: the seconds the groups read had waited once finished, and how many.
            "served_age_s_sum": self.served_age_s_sum,
            "served_age_count": self.served_age_count,
            "hooks_overridden": sorted(self.hooks.overridden),
        }


def extra_int(item: Any, key: str) -> int | None:
    """A trajectory's ``extra_info[key]`` where it is an integer (the toolkit writes
    ``epoch`` and ``repeat``); else None."""
    extra_info = item.get("extra_info") if isinstance(item, dict) else None
    value = extra_info.get(key) if isinstance(extra_info, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def epoch_of(items: Iterable[Any]) -> int | None:
    """The epoch a group's trajectories say (``extra_info.epoch``) when they all say the same
    one; None when one says none or they differ (its instance's groups are then counted
    whatever their epoch)."""
    epochs = {extra_int(item, "epoch") for item in items}
    return epochs.pop() if len(epochs) == 1 else None


def _finish_record(
    task_type: str, group: OpenGroup, outcome: Outcome, seq: int, at: float, epoch: int | None
) -> bytes:
    header: dict[str, Any] = {"e": "fin", "t": task_type, "i": group.instance_id, "at": at}
    if epoch is not None:
        header["ep"] = epoch  # for a replay to count the group as the run did
    if isinstance(outcome, Ready):
        return encode({**header, "o": "ready", "seq": seq}, outcome.items)
    if isinstance(outcome, Discarded):
        return encode({**header, "o": "discarded", "reason": outcome.reason})
    aside = {**header, "o": "aside", "hook": outcome.hook, "error": outcome.error, "tb": outcome.traceback}
    return encode(aside, [record.raw for record in group.records])
