"""One task's groups: filling, finishing by size or timeout, and waiting whole to be read.

A group collects the trajectories of one ``instance_id``. It finishes when it reaches its
size (a later trajectory of the same instance opens a new group, so none is ever over-full)
or when no trajectory has arrived for ``group_timeout_s``. A finished group goes through the
read pipeline at once and then waits, encoded, in finishing order.

Open groups sit in an ``OrderedDict`` kept in order of their last write, so the groups that
time out are always at its front: a timeout check costs O(groups that expire), never a scan.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from buffer import encoding
from buffer.hooks import Hooks
from buffer.pipeline import TIMEOUT_TOO_SMALL, Discarded, GroupRules, Ready, SetAside, process_group
from buffer.stats import RewardStats

logger = logging.getLogger(__name__)

InstanceId = str | int


@dataclass(frozen=True, slots=True)
class TaskSettings:
    """How a task groups and judges its trajectories; set by ``/start_rollout``."""

    group_size: int = 16
    group_timeout_s: float = 300.0
    min_valid_group_size_ratio: float = 1.0
    min_valid_item_size_ratio: float = 0.7
    min_timeout_group_size_ratio: float = 0.7
    reward_key: str | None = None


class Record(NamedTuple):
    """One buffered trajectory: its JSON, and the two fields the buffer itself reads.

    A tuple of atomic values, so the garbage collector stops tracking it: a buffer of a
    million trajectories adds nothing to each full collection.
    """

    uid: str
    reward: float
    raw: bytes


@dataclass(slots=True)
class OpenGroup:
    instance_id: InstanceId
    size: int
    last_write_s: float
    records: list[Record] = field(default_factory=list)


@dataclass(slots=True)
class ReadyGroup:
    seq: int
    task_type: str
    instance_id: InstanceId
    items: list[bytes]


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


class TaskBuffer:
    """The groups of one task type. Not thread-safe: ``RolloutBuffer`` serialises access."""

    def __init__(
        self,
        task_type: str,
        settings: TaskSettings,
        hooks: Hooks,
        *,
        sequence: Iterator[int],
        on_ready: Callable[[], None],
        keep_set_aside: int = 100,
    ) -> None:
        self.task_type = task_type
        self.reconfigure(settings, hooks)
        self._sequence = sequence
        self._on_ready = on_ready
        self.open: OrderedDict[InstanceId, OpenGroup] = OrderedDict()
        self.ready: deque[ReadyGroup] = deque()
        self.set_aside: deque[SetAsideGroup] = deque(maxlen=keep_set_aside)
        self.pending_items = 0
        self.ready_items = 0
        # Totals since the task was created.
        self.written = 0
        self.delivered_items = 0
        self.delivered_groups = 0
        self.discarded: Counter[str] = Counter()
        self.set_aside_total = 0
        self.rewards = RewardStats()  # every raw reward written, for metrics and the dashboard
        # Since the last successful read: what meta_info reports.
        self.window = RewardStats()
        self.window_instances: set[InstanceId] = set()
        self.window_records: list[tuple[InstanceId, Record]] = []
        self.finished_instance_ids: list[InstanceId] = []
        self.window_discarded: Counter[str] = Counter()

    def reconfigure(self, settings: TaskSettings, hooks: Hooks) -> None:
        """New settings apply to groups opened from now on; open groups keep their size."""
        self.settings = settings
        self.hooks = hooks
        # A custom meta hook needs the trajectories written since the last read; the default doesn't.
        self._keep_window_records = "get_group_data_meta_info" in hooks.overridden

    def add(self, instance_id: InstanceId, record: Record, now: float) -> None:
        group = self.open.get(instance_id)
        if group is None:
            group = self.open[instance_id] = OpenGroup(instance_id, self.settings.group_size, now)
        else:
            self.open.move_to_end(instance_id)
            group.last_write_s = now
        group.records.append(record)
        self.pending_items += 1
        self.written += 1
        self.window.add(record.reward)
        self.rewards.add(record.reward)
        self.window_instances.add(instance_id)
        if self._keep_window_records:
            self.window_records.append((instance_id, record))
        if len(group.records) >= group.size:
            del self.open[instance_id]
            self._finish(group, timed_out=False)

    def expire(self, now: float) -> int:
        """Finish every group with no write for ``group_timeout_s``; returns how many."""
        timeout_s = self.settings.group_timeout_s
        expired = 0
        while self.open:
            group = next(iter(self.open.values()))
            if now - group.last_write_s < timeout_s:
                break
            self.open.popitem(last=False)
            self._finish(group, timed_out=True)
            expired += 1
        return expired

    def _finish(self, group: OpenGroup, *, timed_out: bool) -> None:
        self.pending_items -= len(group.records)
        settings = self.settings
        if timed_out and len(group.records) / group.size < settings.min_timeout_group_size_ratio:
            outcome: Ready | Discarded | SetAside = Discarded(TIMEOUT_TOO_SMALL)
        else:
            rules = GroupRules(
                group.size, settings.min_valid_group_size_ratio, settings.min_valid_item_size_ratio
            )
            items = [encoding.loads(record.raw) for record in group.records]
            outcome = process_group(
                self.task_type, group.instance_id, items, rules, self.hooks, timed_out=timed_out
            )
        if isinstance(outcome, Ready):
            self.ready.append(
                ReadyGroup(next(self._sequence), self.task_type, group.instance_id, outcome.items)
            )
            self.ready_items += len(outcome.items)
            self._on_ready()
            return
        self.finished_instance_ids.append(group.instance_id)
        if isinstance(outcome, Discarded):
            self.discarded[outcome.reason] += 1
            self.window_discarded[outcome.reason] += 1
            logger.debug(
                "task %s: discarded group %r (%s)", self.task_type, group.instance_id, outcome.reason
            )
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
                time.time(),
                [record.raw for record in group.records],
            )
        )
        logger.warning(
            "task %s: set group %r aside: hook %s failed: %s\n%s",
            self.task_type,
            group.instance_id,
            outcome.hook,
            outcome.error,
            outcome.traceback,
        )

    def pop_ready(self) -> ReadyGroup:
        group = self.ready.popleft()
        self.ready_items -= len(group.items)
        self.delivered_items += len(group.items)
        self.delivered_groups += 1
        self.finished_instance_ids.append(group.instance_id)
        return group

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

    def reset_window(self) -> tuple[list[InstanceId], Counter[str]]:
        """Start a new read window; returns the finished instance ids and discards it held."""
        finished, discarded = self.finished_instance_ids, self.window_discarded
        self.window = RewardStats()
        self.window_instances = set()
        self.window_records = []
        self.finished_instance_ids = []
        self.window_discarded = Counter()
        return finished, discarded

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
            "reward_mean": self.rewards.mean if self.rewards.count else 0.0,
            "reward_std": self.rewards.sample_std,
            "hooks_overridden": sorted(self.hooks.overridden),
        }
