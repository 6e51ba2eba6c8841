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

Claims come over HTTP, so what they can make the board hold is bounded, all tasks together:
the tasks (the service's ``--max-tasks``; a task no job opened, whose workers have all been
silent past their expiry, makes room for a new one), the items held and their names'
characters, the workers, and the epochs whose sizes are known and not yet all made. A claim
that would pass a bound is refused whole, naming the field (``InvalidInput``): a few tens of MB
at most, whatever the claims.

Each board of a task has an ``identity``, new with every board (every ``open``, and every start
of the service, whose boards are in memory only). A worker names the one it claims from; one that
is not the task's board now is granted nothing and told the new identity: the new board knows
nothing of what was made before it, so the worker first learns the task's resume point and walks
its plan again from there (``buffer.toolkit.leased``), offering only items still to make; a
worker over HTTP does so before its first walk too.

A new board does not know what the workers of the one before had in flight. Within a service's
life, ``open`` keeps the leases of the old board's remote workers on the new one. After a restart
nothing is known: the board of a resumed job (``open(settle_s=...)``, its lease term), and one a
claim makes while the service is younger than that claim's lease term (``settle_at_start``),
*settle*: for that long they grant only what a worker claims again as its own in flight
(``in_flight``); any other claim is told to come back (``Settling``). Every live worker meets the
new board within its lease term (its heartbeat is every third of it) and claims its items back
first, so none is granted to another while its trajectory may still come.

A job that made its whole plan closes its board as finished (``close(finished=True)``): claims on
it raise ``PlanFinished`` (the worker stops) instead of making a fresh board that would hand the
whole plan out again, until a new run of the task opens one.

An epoch's items are counted once each, by key, and only those a worker of this board was
granted; every worker tells the sizes of its plan's epochs and the board keeps the largest (the
plan of the oldest resume point, which holds every later one's): an epoch is complete only once
all the items of every plan told are made, never early.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from buffer.errors import InvalidInput
from buffer.lease_terms import PlanFinished, Settling, item_key, split_key

#: What clients may make the board hold, all tasks together (claims come over HTTP): tasks with
#: leases (when the service sets no --max-tasks), items held or released and the characters of
#: their names, workers, and epochs whose sizes are known and not yet all made.
MAX_TASKS = 1000
MAX_ITEMS = 200_000
MAX_ITEM_CHARS = 16 * 2**20
MAX_WORKERS = 10_000
MAX_EPOCHS = 100_000


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
    sizes: dict[str, int] = field(default_factory=dict)  # epoch not all made -> items in the plan
    complete_items: int = 0  # the sizes of the complete epochs, added up
    made: int = 0  # items granted here and made, all epochs
    key_chars: int = 0  # the characters of the keys held or released (``held``, ``orphans``)
    opened: bool = False  # by a job's run (``open``): kept until it closes, whoever is silent
    settle_until: float = 0.0  # the clock's time until which only items in flight are granted
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
            del self.sizes[epoch]
            self.complete_items += size
            self.complete.add(epoch)

    def tell_sizes(self, plan: Mapping[str, int]) -> None:
        """How many items epochs of the workers' plan have (a complete epoch's is known)."""
        for epoch, size in plan.items():
            if epoch not in self.complete:
                self.sizes[epoch] = max(self.sizes.get(epoch, 0), int(size))

    def unmade(self) -> int:
        """Items of the plan neither made nor held by anyone (0 when the plan is unknown)."""
        planned = sum(self.sizes.values()) + self.complete_items
        return max(0, planned - self.made - len(self.held) - len(self.orphans))

    def idle(self, now: float) -> bool:
        """No job's, and every worker of it silent past its expiry: it may make room."""
        return not self.opened and all(holder.expires <= now for holder in self.holders.values())


class LeaseBoard:
    """The service's leases, by task. Its calls are short and take a lock: the routes call it on
    the event loop, the buffer's writes (``observe``) and an inline sync generator elsewhere."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_tasks: int = MAX_TASKS,
        settle_at_start: bool = False,
    ) -> None:
        """``max_tasks``: the service's ``--max-tasks`` (0, no limit there: ``MAX_TASKS``).
        ``settle_at_start``: the board of a service started again on its data (maybe after a
        crash): a board a claim makes settles until the service is that claim's lease term old
        (see the docstring)."""
        self._tasks: dict[str, _Section] = {}
        self._finished: dict[str, None] = {}  # tasks whose job made the whole plan, oldest first
        self._max_tasks = max_tasks or MAX_TASKS
        self._clock = clock
        self._started = clock() if settle_at_start else None
        self._lock = threading.Lock()

    def open(self, task_type: str, settle_s: float = 0.0) -> object:
        """A new run of the task: a board of its own, nothing known as made; held only the
        items the old board's remote workers still hold (unexpired), theirs until written.
        ``settle_s``: the run resumes a job after a restart, when what remote workers had in
        flight is unknown: for that long it grants only items claimed again as in flight.
        Returns what ``close`` takes, so a run never closes the board of the run after it."""
        with self._lock:
            now = self._clock()
            old = self._tasks.get(task_type)
            section = self._tasks[task_type] = _Section(opened=True, settle_until=now + max(0.0, settle_s))
            self._finished.pop(task_type, None)
            if old is not None:
                for name, holder in old.holders.items():
                    if name in old.owned or holder.expires <= now or not holder.keys:
                        continue
                    section.holders[name] = _Holder(holder.expires, set(holder.keys))
                    for key in holder.keys:
                        section.held[key] = name
                        section.key_chars += len(key)
            return section

    def close(self, task_type: str, opened: object, *, finished: bool = False) -> None:
        """The run of ``open`` ended; ``finished``: its job made the whole plan, and claims of
        the task raise ``PlanFinished`` until a new run opens a board."""
        with self._lock:
            if self._tasks.get(task_type) is not opened:
                return
            del self._tasks[task_type]
            if finished:
                self._finished[task_type] = None
                while len(self._finished) > self._max_tasks:
                    del self._finished[next(iter(self._finished))]

    def finished(self, task_type: str) -> bool:
        """Whether the task's last run made its whole plan (and no run has opened since)."""
        with self._lock:
            return task_type in self._finished

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
            if granted:
                section.key_chars -= len(key)
            section.mark_made(key, granted)

    def claim(
        self,
        task_type: str,
        worker: str,
        offer: Iterable[str],
        ttl_s: float,
        plan: Mapping[str, int] | None = None,
        board: str | None = None,
        in_flight: bool = False,
    ) -> list[str]:
        """Grant ``worker`` the offered items nobody holds and none has made; renew its leases.
        ``plan``: how many items each epoch of the worker's plan has (sent once). ``board``: the
        identity of the board the worker claims from; if it is not this one, nothing is granted
        (the worker walks its plan from the resume point first). ``in_flight``: the items are
        the worker's own, started before this board: granted while it settles; other items
        then raise ``Settling``. ``PlanFinished`` once the task's job made its whole plan. A
        claim that would take the board past its bounds is refused whole (``InvalidInput``)."""
        offer = list(offer)
        with self._lock:
            if task_type in self._finished:
                raise PlanFinished(task_type)
            self._check_room(task_type, worker, offer, len(plan or ()))
            section = self._section(task_type, ttl_s)
            holder = self._renew(section, worker, ttl_s)
            if board is not None and board != section.identity:
                return []
            if plan:
                section.tell_sizes(plan)
            wait = section.settle_until - self._clock()
            if offer and not in_flight and wait > 0:
                raise Settling(wait)
            granted = []
            held = section.held
            for key in offer:
                if key in held or section.is_made(key):
                    continue
                held[key] = worker
                holder.keys.add(key)
                if section.orphans.pop(key, False) is False:  # new on the board, not released
                    section.key_chars += len(key)
                granted.append(key)
            return granted

    def orphans(
        self, task_type: str, worker: str, limit: int, ttl_s: float, board: str | None = None
    ) -> tuple[list[str], int, int]:
        """Grant ``worker`` up to ``limit`` released items (and those of other workers silent
        past their expiry), a group's repeats together; also how many items other workers
        hold, and how many of the plan nobody holds or made (a worker lost before claiming
        them: walk the plan again). ``board`` as for ``claim``: another board's worker is
        granted nothing. ``PlanFinished`` once the task's job made its whole plan."""
        with self._lock:
            if task_type in self._finished:
                raise PlanFinished(task_type)
            self._check_room(task_type, worker, (), 0)
            section = self._section(task_type, ttl_s)
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

    def task_types(self) -> list[str]:
        """The tasks the board keeps a section for (its memory, for tests)."""
        with self._lock:
            return list(self._tasks)

    def tracked(self, task_type: str) -> int:
        """How many made items the board remembers one by one (its memory, for tests)."""
        with self._lock:
            section = self._tasks.get(task_type)
            if section is None:
                return 0
            return sum(len(state.made) for state in section.epochs.values()) + len(section.odd)

    def _check_room(self, task_type: str, worker: str, offer: list[str] | tuple[()], epochs: int) -> None:
        """Refuse a client's call that would grow the board past its bounds (under the lock)."""
        section = self._tasks.get(task_type)
        if section is None and len(self._tasks) >= self._max_tasks:
            now = self._clock()
            for name in [name for name, other in self._tasks.items() if other.idle(now)]:
                del self._tasks[name]  # its workers are gone: a new board if they come back
        if section is None and len(self._tasks) >= self._max_tasks:
            raise InvalidInput.one(
                "task_type",
                f"would be a new task {task_type!r} on the lease board, past the {self._max_tasks} "
                "tasks it keeps leases of (--max-tasks)",
            )
        sections = self._tasks.values()
        new_worker = section is None or worker not in section.holders
        if new_worker and sum(len(s.holders) for s in sections) >= MAX_WORKERS:
            raise InvalidInput.one("worker", f"the lease board keeps at most {MAX_WORKERS} workers")
        if offer and sum(len(s.held) + len(s.orphans) for s in sections) + len(offer) > MAX_ITEMS:
            raise InvalidInput.one("offer", f"the lease board holds at most {MAX_ITEMS} items; retry later")
        if offer and sum(s.key_chars for s in sections) + sum(map(len, offer)) > MAX_ITEM_CHARS:
            raise InvalidInput.one(
                "offer", f"the lease board holds items of at most {MAX_ITEM_CHARS} characters; retry later"
            )
        if epochs and sum(len(s.sizes) for s in sections) + epochs > MAX_EPOCHS:
            raise InvalidInput.one(
                "plan", f"the lease board keeps the sizes of at most {MAX_EPOCHS} epochs not yet made"
            )

    def _section(self, task_type: str, ttl_s: float) -> _Section:
        """The task's board, made by this claim if it has none (settling while the service is
        younger than the claim's lease term: ``settle_at_start``)."""
        section = self._tasks.get(task_type)
        if section is None:
            settle_until = 0.0 if self._started is None else self._started + ttl_s
            section = self._tasks[task_type] = _Section(settle_until=settle_until)
        return section

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
