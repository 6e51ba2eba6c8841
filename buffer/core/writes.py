"""The write path: a trajectory checked and encoded, recognised if seen before, kept, grouped.

``RolloutBuffer.write_many`` checks the store and finds each trajectory's task, then, under
the buffer's lock:

1. ``prepare`` makes each trajectory's ``Record``: the scalar reward (``reward_key`` of a dict
   of named rewards), a uid if it has none, its JSON encoded once, small fields first
   (``encoding.dumps_parted``: a finished group's default hooks decode those alone). A batch is checked whole
   before anything is written: a bad trajectory refuses it all;
2. ``WritePath.check_room`` refuses a batch that would take the buffer past its limit, when
   a task it opens groups of holds more than its fair share of that limit;
3. ``WritePath.apply`` writes each: a uid seen before is counted as a duplicate and nothing
   more; any other is kept (a ``w`` record, before the group it fills can log its outcome),
   added to its task's group, shown to the observers and to the recent list.

``WritePath`` owns what writes leave behind: the uids it recognises, the recent list, the
duplicates and refusals counted. A restart replays the ``w`` and ``dup`` records (``replay``).
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from buffer import encoding
from buffer.core.records import Event, encode
from buffer.core.task import InstanceId, Record, TaskBuffer
from buffer.errors import BatchTooLarge, BufferFull, InvalidInput

if TYPE_CHECKING:
    from buffer.store.base import Store

#: One trajectory checked and encoded, with its task: what ``apply`` writes.
Prepared = tuple[TaskBuffer, InstanceId, Record]
#: A recent write: (seq, task, instance_id, uid, reward, wall-clock time).
Recent = tuple[int, str, InstanceId, str, float, float]
DUPLICATE = encode({"e": "dup"})


@dataclass(frozen=True, slots=True)
class WriteResult:
    uid: str
    task_type: str
    duplicate: bool


def prepare(prefix: str, item: Mapping[str, Any], reward_key: str | None) -> tuple[InstanceId, Record]:
    """The record of one validated trajectory; errors name the field as ``<prefix><field>``."""
    reward = item["reward"]
    if isinstance(reward, dict):
        scalar = scalar_reward(prefix + "reward", reward, reward_key)
        item = {**item, "reward": scalar, "rewards": reward}
        reward = scalar
    uid = item.get("uid")
    if not uid:
        uid = str(uuid.uuid4())
        item = {**item, "uid": uid}
    if "extra_info" not in item:
        item = {**item, "extra_info": {}}
    try:
        raw, head = encoding.dumps_parted(item)
    except encoding.EncodeError as exc:  # validation cannot see it: an integer beyond 64 bits
        path = encoding.huge_integer_at(item)
        if path is None:
            raise InvalidInput.one(prefix.rstrip(".") or "body", f"cannot be stored: {exc}") from None
        field = prefix + ".".join(str(part) for part in path)
        limits = f"{encoding.INT64_MIN} to {encoding.INT64_MAX}"
        raise InvalidInput.one(field, f"must be a 64-bit integer, {limits}") from None
    return item["instance_id"], Record(uid, float(reward), raw, head)


def scalar_reward(field: str, reward: dict[str, Any], reward_key: str | None) -> float:
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


class WritePath:
    """``dedup_window`` bounds how many uids of trajectories no longer buffered are
    remembered; ``recent`` how many writes the recent list shows."""

    def __init__(self, dedup_window: int, recent: int) -> None:
        self._uids: set[str] = set()
        self._uid_order: deque[str] = deque()
        self._dedup_window = dedup_window
        self.duplicates = 0
        self.refused_full = 0  # writes refused with BufferFull or BatchTooLarge
        #: The last trajectories written, newest last.
        self.recent: deque[Recent] = deque(maxlen=recent)
        self._written_seq = 0

    def check_room(
        self, prepared: list[Prepared], held: int, max_buffered: int, tasks: Iterable[TaskBuffer] = ()
    ) -> None:
        """Refuse, whole, a write whose trajectories beyond what the open groups lack would take
        the buffer past ``max_buffered`` (``held`` now), unless each task it opens groups of
        stays within its fair share: ``max_buffered`` over the tasks holding trajectories
        (``tasks``, the buffer's, this write's counted). One task's flood so never locks
        another out: the flood is refused, and the other's groups are taken while it holds less
        than its share (the buffer then holds more than ``max_buffered``, never twice as
        many). What fills a group already open is always taken, so groups
        can finish while the trainer catches up; a batch is taken all or none, as its validation
        is. O(1) when it fits anyway, else O(batch + tasks)."""
        if held + len(prepared) <= max_buffered:
            return
        lacking: dict[tuple[str, InstanceId], int] = {}
        uids: set[str] = set()
        adding: dict[TaskBuffer, int] = {}
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
                adding[task] = adding.get(task, 0) + 1
        total = sum(adding.values())
        if total > max_buffered:
            self.refused_full += 1
            raise BatchTooLarge(total, max_buffered)
        if not total or held + total <= max_buffered:
            return
        holding = {task for task in tasks if _held(task)} | set(adding)
        share = max_buffered / len(holding)
        if any(_held(task) + count > share for task, count in adding.items()):
            self.refused_full += 1
            raise BufferFull(held, max_buffered, total)

    def apply(
        self,
        prepared: list[Prepared],
        items: Sequence[Mapping[str, Any]],
        store: Store | None,
        now: float,
        wall: float,
        observers: Sequence[Callable[[str, Mapping[str, Any]], None]],
    ) -> tuple[list[WriteResult], set[TaskBuffer]]:
        """Write a prepared batch (``items`` as given, for the observers); returns the results
        and the tasks written to."""
        results = []
        touched: set[TaskBuffer] = set()
        for (task, instance_id, record), item in zip(prepared, items, strict=True):
            if record.uid in self._uids:
                self.duplicates += 1
                if store is not None:
                    store.append(DUPLICATE)
                results.append(WriteResult(record.uid, task.task_type, duplicate=True))
                continue
            self._remember(record.uid)
            if store is not None:  # before add(): a group it fills logs its outcome
                header: dict[str, Any] = {"e": "w", "t": task.task_type, "i": instance_id}
                header.update(u=record.uid, r=record.reward, at=wall, h=record.head)
                store.append(encode(header, [record.raw]))
            task.add(instance_id, record, now)
            for observe in observers:
                observe(task.task_type, item)
            self._written_seq += 1
            self.recent.append(
                (self._written_seq, task.task_type, instance_id, record.uid, record.reward, wall)
            )
            touched.add(task)
            results.append(WriteResult(record.uid, task.task_type, duplicate=False))
        return results, touched

    def _remember(self, uid: str) -> None:
        self._uids.add(uid)
        self._uid_order.append(uid)
        if len(self._uid_order) > self._dedup_window:
            self._uids.discard(self._uid_order.popleft())

    # -- a restart -----------------------------------------------------------------------

    def replay(self, task: TaskBuffer, event: Event, monotonic_of: Callable[[float], float]) -> None:
        """Apply a ``w`` record (the group's outcome is the next record's: nothing finishes)."""
        header = event.header
        instance_id, wall = header["i"], header["at"]
        record = Record(header["u"], header["r"], event.payload, header.get("h", 0))
        self._remember(record.uid)
        task.add(instance_id, record, monotonic_of(wall), finish=False)
        self._written_seq += 1
        self.recent.append((self._written_seq, task.task_type, instance_id, record.uid, record.reward, wall))

    def replay_duplicate(self) -> None:
        self.duplicates += 1

    def state(self) -> dict[str, Any]:
        """What a snapshot's ``state`` record keeps of the writes; the uids it keeps in chunks
        (``uids_after``, ``core.snapshots.UidCapture``)."""
        return {
            "duplicates": self.duplicates,
            "written_seq": self._written_seq,
            "recent": list(self.recent),
        }

    def uids_after(self, number: int) -> tuple[int, int, list[str]]:
        """The numbers of the first and the last uid remembered (the n-th uid remembered, that
        is the n-th trajectory written, is n) and the uids numbered above ``number``, oldest
        first: O(those)."""
        last, order = self._written_seq, self._uid_order
        count = max(0, min(len(order), last - number))
        uids = list(itertools.islice(reversed(order), count))
        uids.reverse()
        return last - len(order) + 1, last, uids

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take what ``state`` kept back, from a snapshot's ``state`` record (the uids too, in
        a snapshot of the former format)."""
        self.duplicates, self._written_seq = state["duplicates"], state["written_seq"]
        self.recent.extend(tuple(entry) for entry in state["recent"])
        self.restore_uids(state.get("uids", ()))

    def restore_uids(self, uids: Iterable[str]) -> None:
        """Remember ``uids`` (a snapshot's chunk of them, oldest first)."""
        for uid in uids:
            self._remember(uid)


def _held(task: TaskBuffer) -> int:
    return task.pending_items + task.ready_items
