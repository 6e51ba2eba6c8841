"""Work leases: the service hands out a task's work items to the workers generating it, and
takes back those of a worker that stopped, so a lost worker's share still gets made, and
nothing is made twice into the buffer.

A work item is one trajectory of the plan: ``epoch|instance_id|repeat``. Every worker walks the
same (seeded) plan and offers the items it meets, in chunks; the board grants each item to one
worker at a time (``claim``). A worker's leases are renewed together, by any call it makes (a
heartbeat is an empty claim): one expiry per worker, not per item. An item is done once its
trajectory is in the buffer (the buffer's write observer, ``observe``), and is never granted
again.

Two kinds of holder. A worker the service started (``own``: a job's worker process or Ray actor)
keeps its leases past its expiry: the service sees it in ``expired``, stops it, and only then
``release``\\s its items to the others, so a hung worker cannot write an item after another was
given it. Any other worker (``rollout-buffer worker --leases``) loses its items to whoever asks
for ``orphans`` once it has been silent for its ``ttl_s``: one cut off rather than dead, writing
again later, can make an item twice; the heartbeat keeps that to workers that really stopped.

What is done is kept compactly and not for ever: per epoch, one bit mask of made repeats per
instance; workers report how many items each epoch of their plan has, and an epoch whose items
are all made is forgotten but for its number (any item of it is refused at once). A job's run
opens a board of its own for its task (``open``) and drops it when it ends (``close``).

Each board of a task has an ``identity``, new with every board (every ``open``, and every start
of the service, whose boards are in memory only). A worker names the one it claims from; one that
is not the task's board now is granted nothing and told the new identity: the new board knows
nothing of what was made before it, so the worker first learns the task's resume point and walks
its plan again from there (``buffer.toolkit.leased``), offering only items still to make.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from buffer.errors import InvalidInput
from buffer.lease_terms import item_key, split_key

#: What clients may make the board hold, all tasks together (claims come over HTTP): tasks with
#: leases, items held or released, workers, and epoch sizes of plans.
MAX_TASKS = 1000
MAX_ITEMS = 200_000
MAX_WORKERS = 10_000
MAX_EPOCHS = 1_000_000


@dataclass(slots=True)
class _Holder:
    expires: float
    keys: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Epoch:
    made: dict[str, int] = field(default_factory=dict)  # instance -> bit mask of made repeats
    count: int = 0  # items granted here and made


@dataclass(slots=True)
class _Section:
    """One task's leases."""

    held: dict[str, str] = field(default_factory=dict)  # key -> holder
    holders: dict[str, _Holder] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  # workers the service stops itself
    orphans: dict[str, None] = field(default_factory=dict)  # released, in the order released
    epochs: dict[str, _Epoch] = field(default_factory=dict)  # epochs in progress
    complete: set[str] = field(default_factory=set)  # epochs all made: their keys forgotten
    odd: set[str] = field(default_factory=set)  # made keys a plan does not make (never forgotten)
    sizes: dict[str, int] = field(default_factory=dict)  # epoch -> items in the workers' plan
    made: int = 0  # items granted here and made, all epochs
    identity: str = field(default_factory=lambda: uuid.uuid4().hex)  # this board's, new per board

    def is_made(self, key: str) -> bool:
        parts = split_key(key)
        if parts is None:
            return key in self.odd
        epoch, instance, repeat = parts
        if epoch in self.complete:
            return True
        state = self.epochs.get(epoch)
        return state is not None and bool(state.made.get(instance, 0) >> repeat & 1)

    def mark_made(self, key: str, granted: bool) -> None:
        parts = split_key(key)
        if parts is None:
            self.odd.add(key)
            return
        epoch, instance, repeat = parts
        if epoch in self.complete:
            return
        state = self.epochs.setdefault(epoch, _Epoch())
        mask = state.made.get(instance, 0)
        if mask >> repeat & 1:
            return
        state.made[instance] = mask | 1 << repeat
        if not granted:  # written by no worker of the board's: refused later, not counted
            return
        state.count += 1
        self.made += 1
        size = self.sizes.get(epoch, 0)
        if size and state.count >= size:
            del self.epochs[epoch]
            self.complete.add(epoch)

    def unmade(self) -> int:
        """Items of the plan neither made nor held by anyone (0 when the plan is unknown)."""
        return max(0, sum(self.sizes.values()) - self.made - len(self.held) - len(self.orphans))


class LeaseBoard:
    """The service's leases, by task. Its calls are short and take a lock: the routes call it on
    the event loop, the buffer's writes (``observe``) and an inline sync generator elsewhere."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, max_tasks: int = MAX_TASKS) -> None:
        self._tasks: dict[str, _Section] = {}
        self._max_tasks = max_tasks
        self._clock = clock
        self._lock = threading.Lock()

    def open(self, task_type: str) -> object:
        """A new run of the task: a board of its own, nothing held, nothing known as made.
        Returns what ``close`` takes, so a run never closes the board of the run after it."""
        with self._lock:
            section = self._tasks[task_type] = _Section()
            return section

    def close(self, task_type: str, opened: object) -> None:
        with self._lock:
            if self._tasks.get(task_type) is opened:
                del self._tasks[task_type]

    def identity(self, task_type: str) -> str | None:
        """The identity of the task's board now (None: it has none)."""
        with self._lock:
            section = self._tasks.get(task_type)
            return None if section is None else section.identity

    def own(self, task_type: str, worker: str) -> None:
        """``worker`` is the service's: its leases outlive their expiry until ``release``."""
        with self._lock:
            self._tasks.setdefault(task_type, _Section()).owned.add(worker)

    def observe(self, task_type: str, item: Mapping[str, Any]) -> None:
        """A trajectory reached the buffer: its item is done (for tasks with leases only)."""
        if task_type not in self._tasks:
            return
        try:
            extra = item["extra_info"]
            key = item_key(extra["epoch"], item["instance_id"], extra["repeat"])
        except (TypeError, KeyError):  # not a trajectory of a plan
            return
        with self._lock:
            section = self._tasks.get(task_type)
            if section is None:
                return
            holder = section.held.pop(key, None)
            if holder is not None:
                section.holders[holder].keys.discard(key)
                granted = True
            else:
                granted = key in section.orphans
                section.orphans.pop(key, None)
            section.mark_made(key, granted)

    def claim(
        self,
        task_type: str,
        worker: str,
        offer: Iterable[str],
        ttl_s: float,
        plan: Mapping[str, int] | None = None,
        board: str | None = None,
    ) -> list[str]:
        """Grant ``worker`` the offered items nobody holds and none has made; renew its leases.
        ``plan``: how many items each epoch of the worker's plan has (sent once). ``board``: the
        identity of the board the worker claims from; if it is not this one, nothing is granted
        (the worker walks its plan from the resume point first). A claim that would take the
        board past its bounds is refused whole (``InvalidInput``)."""
        offer = list(offer)
        with self._lock:
            self._check_room(task_type, worker, len(offer), len(plan or ()))
            section = self._tasks.setdefault(task_type, _Section())
            holder = self._renew(section, worker, ttl_s)
            if board is not None and board != section.identity:
                return []
            if plan:
                for epoch, size in plan.items():
                    section.sizes[epoch] = max(section.sizes.get(epoch, 0), int(size))
            granted = []
            held = section.held
            for key in offer:
                if key in held or section.is_made(key):
                    continue
                held[key] = worker
                holder.keys.add(key)
                section.orphans.pop(key, None)
                granted.append(key)
            return granted

    def orphans(
        self, task_type: str, worker: str, limit: int, ttl_s: float, board: str | None = None
    ) -> tuple[list[str], int, int]:
        """Grant ``worker`` up to ``limit`` released items (and those of other workers silent
        past their expiry), a group's repeats together; also how many items other workers
        hold, and how many of the plan nobody holds or made (a worker lost before claiming
        them: walk the plan again). ``board`` as for ``claim``: another board's worker is
        granted nothing."""
        with self._lock:
            self._check_room(task_type, worker, 0, 0)
            section = self._tasks.setdefault(task_type, _Section())
            now = self._clock()
            holder = self._renew(section, worker, ttl_s)
            if board is not None and board != section.identity:
                return [], 0, 0
            for name, state in list(section.holders.items()):
                if name != worker and name not in section.owned and state.expires <= now:
                    self._release(section, name)
            granted: list[str] = []
            if section.orphans and limit > 0:
                last_group = None
                for key in sorted(section.orphans):  # sorted: a group's keys side by side
                    group = key.rpartition("|")[0]
                    if len(granted) >= limit and group != last_group:
                        break  # never a group split between two workers (a group reward needs all)
                    last_group = group
                    del section.orphans[key]
                    section.held[key] = worker
                    holder.keys.add(key)
                    granted.append(key)
            others = sum(len(state.keys) for name, state in section.holders.items() if name != worker)
            return granted, others + len(section.orphans), section.unmade()

    def expired(self, task_type: str) -> list[str]:
        """The service's own workers that have not renewed their leases in time (hung)."""
        with self._lock:
            section = self._tasks.get(task_type)
            if section is None:
                return []
            now = self._clock()
            return [
                name
                for name, state in section.holders.items()
                if name in section.owned and state.expires <= now
            ]

    def release(self, task_type: str, worker: str) -> int:
        """``worker`` has stopped for good: its unmade items go to the others; how many."""
        with self._lock:
            section = self._tasks.get(task_type)
            if section is None:
                return 0
            section.owned.discard(worker)
            return self._release(section, worker)

    def tracked(self, task_type: str) -> int:
        """How many made items the board remembers one by one (its memory, for tests)."""
        with self._lock:
            section = self._tasks.get(task_type)
            if section is None:
                return 0
            return sum(len(state.made) for state in section.epochs.values()) + len(section.odd)

    def _check_room(self, task_type: str, worker: str, items: int, epochs: int) -> None:
        """Refuse a client's call that would grow the board past its bounds (under the lock)."""
        section = self._tasks.get(task_type)
        if section is None and len(self._tasks) >= self._max_tasks:
            raise InvalidInput.one(
                "task_type", f"the lease board keeps leases of at most {self._max_tasks} tasks"
            )
        sections = self._tasks.values()
        new_worker = section is None or worker not in section.holders
        if new_worker and sum(len(s.holders) for s in sections) >= MAX_WORKERS:
            raise InvalidInput.one("worker", f"the lease board keeps at most {MAX_WORKERS} workers")
        if items and sum(len(s.held) + len(s.orphans) for s in sections) + items > MAX_ITEMS:
            raise InvalidInput.one("offer", f"the lease board holds at most {MAX_ITEMS} items; retry later")
        if epochs and sum(len(s.sizes) for s in sections) + epochs > MAX_EPOCHS:
            raise InvalidInput.one("plan", f"the lease board keeps the sizes of at most {MAX_EPOCHS} epochs")

    def _renew(self, section: _Section, worker: str, ttl_s: float) -> _Holder:
        expires = self._clock() + ttl_s
        holder = section.holders.get(worker)
        if holder is None:
            holder = section.holders[worker] = _Holder(expires)
        else:
            holder.expires = expires
        return holder

    @staticmethod
    def _release(section: _Section, worker: str) -> int:
        holder = section.holders.pop(worker, None)
        if holder is None:
            return 0
        for key in holder.keys:
            del section.held[key]
            section.orphans[key] = None
        return len(holder.keys)
