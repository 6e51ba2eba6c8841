"""The replay pool: good groups kept after their read, served again beside fresh ones.

Off unless the service is started with ``--replay-capacity N`` (``ReplaySettings.capacity``);
off, nothing here runs and reads are what they were. On:

- **What is kept.** A group a read serves fresh that carries a learning signal: it passed the
  task's filters (it was ready) and its raw rewards (padded copies left out) are not all equal.
  Evaluation tasks are never kept. An entry holds the group's stored bytes as first served
  (rewards, logprobs and versions untouched), its lowest and highest policy version, its
  advantage magnitude, the read that first served it, and how many times it was replayed.
- **Priority** (highest first): the fresher policy version first, then the larger advantage
  magnitude; ties go to the entry replayed fewer times, then the later group::

      priority(g) = (v_low(g), |A|(g), -uses(g), seq(g))      compared left to right
      |A|(g)      = mean_i |r_i - mean(r)|                      over g's raw rewards

  ``v_low`` is the lowest version any of the group's tokens was sampled under (-1 when none
  is known). When the pool holds more than ``capacity`` groups, the lowest priority leaves
  (a new group lower than every kept one is not kept).
- **Leaving.** A group ``max_uses`` times replayed leaves (``uses``); one whose lag (the
  trainer's version minus ``v_low``) is past ``max_lag`` is never served and leaves at the next
  read that returns groups (``lag``); one pushed out by a better one leaves (``capacity``).
- **Mixing** (``replay_ratio`` r of a read, 0 <= r < 1): a read of B groups (``max_items`` over
  the smallest group size of its tasks) takes up to floor(r * B) groups from the pool, highest
  priority first, the rest fresh; never more than the share r of what it returns
  (floor(r * F / (1 - r)) for F fresh groups), so a read with no fresh group returns nothing and
  the pool never stands in for generation. Only the read's tasks' groups, one per instance.
- **Marked.** A replayed trajectory's ``extra_info.replay`` says ``{"uses": k, "first_read":
  <wall time of its fresh read>, "read_id": <that read's id>, "version_lag": <lag now>}``; the
  read's ``meta_info.replayed`` counts the groups. Fresh groups are counted as before
  (``total_read``, ``delivered_*``, ``finished_groups``): replay is never a delivery.
- **Durable.** What a read changes in the pool goes in its ``read`` record, under ``pool``
  (``PoolChange.record``): the read and the pool's change are kept together or not at all,
  taken back together (``undo``), and a restart replays them (``replay``) whatever the pool's
  settings now. A snapshot writes one ``pool`` record per entry (``snapshot``, ``restore``).

Plain Python, under the buffer's lock like the rest of the read path.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from buffer import encoding
from buffer.core.records import Event, encode
from buffer.core.task import InstanceId, ReadyGroup

#: Why a group leaves the pool.
LAG, USES, CAPACITY = "lag", "uses", "capacity"
REASONS = (LAG, USES, CAPACITY)
#: Tolerance of the ratio's floor: r * B is 2.0000000000000004 or 1.9999999999999998 alike.
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """``capacity`` groups kept (0: the pool is off); a group leaves after ``max_uses``
    replays, or once more than ``max_lag`` versions behind the trainer's."""

    capacity: int = 0
    max_uses: int = 2
    max_lag: int = 4


@dataclass(slots=True)
class PoolEntry:
    seq: int  #: the ready group's number: one entry per group
    task_type: str
    instance_id: InstanceId
    items: list[bytes]  #: as the fresh read served them
    low: int | None  #: the lowest and highest policy version of its trajectories
    high: int | None
    advantage: float  #: mean |r - mean(r)| over its raw rewards
    first_read: float  #: wall time of the read that served it fresh
    read_id: int  #: that read's id (the export's ``read_id``)
    uses: int = 0  #: times replayed

    def priority(self) -> tuple[int, float, int, int]:
        return (-1 if self.low is None else self.low, self.advantage, -self.uses, self.seq)

    def lag(self, version: int | None) -> int | None:
        if version is None or self.low is None:
            return None
        return max(0, version - self.low)


@dataclass(slots=True)
class PoolChange:
    """What one read changed in the pool, in the order it is applied and replayed."""

    lagged: list[PoolEntry] = field(default_factory=list)
    used: list[PoolEntry] = field(default_factory=list)
    spent: list[PoolEntry] = field(default_factory=list)  #: used ``max_uses`` times
    added: list[PoolEntry] = field(default_factory=list)
    evicted: list[PoolEntry] = field(default_factory=list)

    def record(self) -> dict[str, Any] | None:
        """The ``pool`` field of the read's record; None when nothing changed."""
        out: dict[str, Any] = {}
        for key, entries in (("lag", self.lagged), ("use", self.used), ("spent", self.spent)):
            if entries:
                out[key] = [entry.seq for entry in entries]
        if self.added:
            out["add"] = [[e.seq, e.task_type, e.low, e.high, e.advantage] for e in self.added]
        if self.evicted:
            out["evict"] = [entry.seq for entry in self.evicted]
        return out or None


def advantage_of(rewards: Collection[float]) -> float | None:
    """A group's advantage magnitude, mean |r - mean(r)|; None when the rewards are all equal
    (or fewer than two): no learning signal, not kept."""
    if len(rewards) < 2 or max(rewards) == min(rewards):
        return None
    mean = math.fsum(rewards) / len(rewards)
    return math.fsum(abs(reward - mean) for reward in rewards) / len(rewards)


def replay_count(ratio: float, fresh: int, batch: int | None) -> int:
    """How many groups a read with ``fresh`` fresh groups may take from the pool: at most
    floor(ratio * batch) (``batch`` in groups; None: no batch asked) and never past the share
    ``ratio`` of what it returns."""
    if ratio <= 0 or fresh <= 0:
        return 0
    count = math.floor(ratio * fresh / (1 - ratio) + _EPSILON)
    if batch is not None:
        count = min(count, math.floor(ratio * batch + _EPSILON))
    return count


def marked(raw: bytes, mark: dict[str, Any]) -> bytes:
    """A stored trajectory with ``extra_info.replay`` set to ``mark``; nothing else changes."""
    item = encoding.loads(raw)
    info = item.get("extra_info")
    item["extra_info"] = {**(info if isinstance(info, dict) else {}), "replay": mark}
    return encoding.dumps(item)


class ReplayPool:
    """The pool of one buffer (see the module's docstring). Not thread-safe: the buffer's
    lock serialises it, as the rest of the read path."""

    def __init__(self, settings: ReplaySettings | None = None) -> None:
        self.settings = settings or ReplaySettings()
        self.entries: dict[int, PoolEntry] = {}
        #: Since the process started (Prometheus reads a restart as a reset), by task.
        self.replayed: Counter[str] = Counter()
        self.dropped: Counter[tuple[str, str]] = Counter()

    @property
    def enabled(self) -> bool:
        return self.settings.capacity > 0

    @property
    def active(self) -> bool:
        """Whether a read has anything to do here: the pool is on, or holds groups (kept
        before a restart that turned it off or shrank it, which the next read lets go)."""
        return self.enabled or bool(self.entries)

    # -- a read --------------------------------------------------------------------------

    def lagged(self, version: int | None) -> list[PoolEntry]:
        """The entries past ``max_lag`` versions behind ``version``: never served again."""
        bound = self.settings.max_lag
        return [e for e in self.entries.values() if (lag := e.lag(version)) is not None and lag > bound]

    def ranked(self, tasks: Collection[str], excluded: Collection[PoolEntry]) -> list[PoolEntry]:
        """The entries of ``tasks`` a read may serve, highest priority first."""
        skip = {entry.seq for entry in excluded}
        eligible = [e for e in self.entries.values() if e.task_type in tasks and e.seq not in skip]
        eligible.sort(key=PoolEntry.priority, reverse=True)
        return eligible

    def pick(
        self,
        ranked: list[PoolEntry],
        count: int,
        max_items: int | None,
        instances: Collection[InstanceId] = (),
    ) -> list[PoolEntry]:
        """Up to ``count`` entries of ``ranked``, in order, one per instance and none of
        ``instances``, of at most ``max_items`` items together (None: any)."""
        chosen: list[PoolEntry] = []
        seen = set(instances)
        items = 0
        for entry in ranked:
            if len(chosen) >= count:
                break
            if entry.instance_id in seen:
                continue
            if max_items is not None and items + len(entry.items) > max_items:
                continue
            chosen.append(entry)
            seen.add(entry.instance_id)
            items += len(entry.items)
        return chosen

    def apply(
        self,
        lagged: list[PoolEntry],
        used: list[PoolEntry],
        fresh: list[ReadyGroup],
        spans: Mapping[int, tuple[int, int] | None],
        first_read: float,
        read_id: int,
    ) -> PoolChange:
        """Change the pool for a read that is being kept: ``lagged`` leave, ``used`` were
        replayed once more, the good groups of ``fresh`` (with their version ``spans`` by seq)
        come in, and the lowest leave past the capacity."""
        change = PoolChange(lagged=lagged)
        for entry in lagged:
            del self.entries[entry.seq]
        for entry in used:
            entry.uses += 1
            change.used.append(entry)
            if entry.uses >= self.settings.max_uses:
                del self.entries[entry.seq]
                change.spent.append(entry)
        if self.enabled:
            for group in fresh:
                advantage = advantage_of(group.rewards or ())
                if advantage is None:
                    continue
                span = spans.get(group.seq)
                low, high = (None, None) if span is None else span
                entry = PoolEntry(
                    group.seq,
                    group.task_type,
                    group.instance_id,
                    group.items,
                    low,
                    high,
                    advantage,
                    first_read,
                    read_id,
                )
                self.entries[entry.seq] = entry
                change.added.append(entry)
        self._trim(change)
        self._count(change, 1)
        return change

    def _trim(self, change: PoolChange) -> None:
        """Let the lowest-priority entries go past the capacity: an entry added by this very
        change is simply not kept (not counted as evicted)."""
        excess = len(self.entries) - self.settings.capacity
        if excess <= 0:
            return
        lowest = sorted(self.entries.values(), key=PoolEntry.priority)[:excess]
        added = {entry.seq for entry in change.added}
        for entry in lowest:
            del self.entries[entry.seq]
            if entry.seq in added:
                change.added.remove(entry)
            else:
                change.evicted.append(entry)

    def undo(self, change: PoolChange) -> None:
        """Take back ``change`` (its read could not be kept): the pool as before it."""
        for entry in change.added:
            del self.entries[entry.seq]
        for entry in change.used:
            entry.uses -= 1
        for entry in (*change.evicted, *change.spent, *change.lagged):
            self.entries[entry.seq] = entry
        self._count(change, -1)

    def _count(self, change: PoolChange, sign: int) -> None:
        for entries, reason in ((change.lagged, LAG), (change.spent, USES), (change.evicted, CAPACITY)):
            for entry in entries:
                self.dropped[entry.task_type, reason] += sign
        for entry in change.used:
            self.replayed[entry.task_type] += sign

    def serve(self, entry: PoolEntry, version: int | None) -> ReadyGroup:
        """The group a read returns for ``entry`` (its uses counted already): the stored
        trajectories, each marked ``extra_info.replay``."""
        mark = {
            "uses": entry.uses,
            "first_read": entry.first_read,
            "read_id": entry.read_id,
            "version_lag": entry.lag(version),
        }
        items = [marked(raw, mark) for raw in entry.items]
        return ReadyGroup(entry.seq, entry.task_type, entry.instance_id, items)

    # -- a restart -----------------------------------------------------------------------

    def replay(
        self, record: Mapping[str, Any], taken: Mapping[int, ReadyGroup], first_read: float, read_id: int
    ) -> None:
        """Apply a ``read`` record's ``pool`` field; ``taken``: the groups the read served
        fresh, by seq. What it says, whatever the settings are now."""
        for seq in record.get("lag", ()):
            del self.entries[seq]
        for seq in record.get("use", ()):
            self.entries[seq].uses += 1
        for seq in record.get("spent", ()):
            del self.entries[seq]
        for seq, task_type, low, high, advantage in record.get("add", ()):
            group = taken[seq]
            self.entries[seq] = PoolEntry(
                seq, task_type, group.instance_id, group.items, low, high, advantage, first_read, read_id
            )
        for seq in record.get("evict", ()):
            del self.entries[seq]

    def snapshot(self) -> Iterator[bytes]:
        """The ``pool`` records of the entries as they are now (their headers made at once,
        under the buffer's lock, O(entries); encoded as read)."""
        headers = [
            (
                {
                    "e": "pool",
                    "t": e.task_type,
                    "i": e.instance_id,
                    "seq": e.seq,
                    "lo": e.low,
                    "hi": e.high,
                    "adv": e.advantage,
                    "first": e.first_read,
                    "rid": e.read_id,
                    "uses": e.uses,
                },
                e.items,
            )
            for e in self.entries.values()
        ]
        return (encode(header, items) for header, items in headers)

    def restore(self, event: Event) -> None:
        """Apply a snapshot's ``pool`` record."""
        h = event.header
        self.entries[h["seq"]] = PoolEntry(
            h["seq"],
            h["t"],
            h["i"],
            event.parts(),
            h["lo"],
            h["hi"],
            h["adv"],
            h["first"],
            h["rid"],
            h["uses"],
        )

    # -- what metrics read ---------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """The pool's size by task, groups replayed by task, and dropped by task and reason."""
        size: Counter[str] = Counter(entry.task_type for entry in self.entries.values())
        dropped: dict[str, dict[str, int]] = {}
        for (task, reason), count in (+self.dropped).items():  # a read taken back leaves zeros
            dropped.setdefault(task, {})[reason] = count
        return {
            "capacity": self.settings.capacity,
            "groups": dict(size),
            "replayed": dict(+self.replayed),
            "dropped": dropped,
        }
