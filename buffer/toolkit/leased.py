"""A worker's side of the work leases (``buffer.workers.leases``): which samples of the plan it
makes. It walks the toolkit's ``Plan``, for the toolkit's runner, so it lives in the toolkit;
the board, the service's, is reached through the job (``buffer.current``) or over HTTP.

``leases`` (``data["leases"]``, set by the service for a job's workers, or by ``rollout-buffer
worker --leases``) names the worker, its ``index`` among ``count`` workers, the ``ttl_s`` of its
leases and the ``chunk`` of items it claims at once. The walk:

1. its own share of the plan (the groups a fixed split would give it), in chunks of whole
   groups, claiming each chunk when it needs the next sample (items made or held are skipped);
2. then the other workers' shares, each from its end backwards, until it meets a chunk their
   worker has claimed (taking the tail of a slow or lost worker's share);
3. then items released by workers that stopped (``orphans``), until no other worker holds
   any; if the board then counts items of the plan nobody holds or made (a worker lost before
   it claimed them), the whole plan is offered once more.

A heartbeat renews the leases every ``ttl_s / 3`` on the worker's event loop: a worker whose loop
is blocked stops renewing, and the service takes its items back. A worker in the service's
process talks to the board directly; any other over HTTP (``POST /tasks/{name}/leases``).

A worker over HTTP names the board it claims from (its identity, from the board's first answer).
A board that is not that one (the service restarted, or the task's job opened a new one) knows
nothing of what was made before it: it grants nothing and says its identity, and the worker
fetches the task's resume point (``GET /tasks/{name}/resume_point``: what its job made, or with
no job what its workers made, the task's remote run: ``buffer.core.ledger``), claims
again on the new board what it still has in flight (its last samples, not made yet: its own,
not another's to make), and walks its plan from the start again, skipping what was made, so the
new board is offered only what is still to make. A worker over HTTP does the same before its
first walk (it may start after a restart of the service, whose board knows nothing of what the
service's earlier lives made).

Every worker tells the board how many items each epoch of its plan has (``plan``), so the board
forgets an epoch once all of it is made. A new board after a restart *settles* for a lease term
(``Settling``): it grants only items claimed again as in flight, and the walk claims again
after the wait. A board whose job made the whole plan answers ``PlanFinished``: the worker stops.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from buffer.current import current_job
from buffer.keys import key_or_env
from buffer.lease_terms import DEFAULT_CHUNK, PlanFinished, Settling, item_key, split_key
from buffer.toolkit.dataset import Plan, ResumePoint
from buffer.toolkit.types import Sample

if TYPE_CHECKING:  # the board is the service's: a generator in its process is handed it
    from buffer.workers.leases import LeaseBoard

logger = logging.getLogger(__name__)

#: Plans of at most this many items have the others' tails walked (a share is held in memory).
MAX_TAIL_PLAN = 200_000
#: A worker waiting for the others polls for orphans at least this often.
MAX_POLL_S = 1.0
#: How many of its last samples a worker takes for still in flight when its board changes (at
#: least): it runs about ``2 * chunk`` at once (``num_process``), and has a chunk granted ahead.
MIN_IN_FLIGHT = 256


class BoardChanged(Exception):
    """The board answering is not the one the worker claimed from: a new one, knowing nothing
    of what was made before it (the service restarted, or the job opened another)."""


class Leases(Protocol):
    worker: str
    ttl_s: float
    #: The identity of the board this worker claims from (None: not known yet, or a board in
    #: this process, which outlives no run of it).
    board: str | None

    async def claim(
        self, offer: list[str], plan: dict[str, int] | None = None, in_flight: bool = False
    ) -> list[str]: ...

    async def orphans(self, limit: int) -> tuple[list[str], int, int]: ...

    async def resume_point(self) -> dict[str, Any]: ...

    async def identity(self) -> str | None:
        """The identity of the task's board now, for a worker that must learn the task's resume
        point before it walks (over HTTP); None for one in the service's process."""

    async def aclose(self) -> None: ...


class BoardLeases:
    """A worker in the service's process: the board itself, no HTTP."""

    def __init__(self, board: LeaseBoard, task_type: str, worker: str, ttl_s: float) -> None:
        self._board = board
        self._task_type = task_type
        self.worker = worker
        self.ttl_s = ttl_s
        self.board: str | None = None  # the job's own board: it lives as long as the job's run

    async def claim(
        self, offer: list[str], plan: dict[str, int] | None = None, in_flight: bool = False
    ) -> list[str]:
        return self._board.claim(self._task_type, self.worker, offer, self.ttl_s, plan, in_flight=in_flight)

    async def orphans(self, limit: int) -> tuple[list[str], int, int]:
        return self._board.orphans(self._task_type, self.worker, limit, self.ttl_s)

    async def resume_point(self) -> dict[str, Any]:
        return {}

    async def identity(self) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


class HttpLeases:
    """A worker elsewhere: the service's ``/tasks/{name}/leases`` routes."""

    def __init__(self, url: str, task_type: str, worker: str, ttl_s: float) -> None:
        headers = {}
        if key := key_or_env(None, url):
            headers["authorization"] = f"Bearer {key}"
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=30.0, trust_env=False
        )
        self._task_path = f"/tasks/{task_type}"
        self._path = f"{self._task_path}/leases"
        self.worker = worker
        self.ttl_s = ttl_s
        self.board: str | None = None
        #: The identity the board gave in its last answer.
        self.seen: str | None = None

    async def claim(
        self, offer: list[str], plan: dict[str, int] | None = None, in_flight: bool = False
    ) -> list[str]:
        body: dict[str, Any] = {"worker": self.worker, "offer": offer, "ttl_s": self.ttl_s}
        if plan:
            body["plan"] = plan
        if in_flight:
            body["in_flight"] = True
        answer = await self._post(self._path, self._named(body))
        self._check(answer)
        if answer.get("settle_s"):
            raise Settling(float(answer["settle_s"]))
        granted: list[str] = answer["granted"]
        return granted

    async def orphans(self, limit: int) -> tuple[list[str], int, int]:
        body = {"worker": self.worker, "limit": limit, "ttl_s": self.ttl_s}
        answer = await self._post(f"{self._path}/orphans", self._named(body))
        self._check(answer)
        return answer["granted"], answer["held_by_others"], answer.get("unmade", 0)

    async def resume_point(self) -> dict[str, Any]:
        answer = await self._send("GET", f"{self._task_path}/resume_point")
        if answer.get("finished"):
            raise PlanFinished(self._task_path)
        point: dict[str, Any] = answer["resume"]
        return point

    async def identity(self) -> str | None:
        body = {"worker": self.worker, "offer": [], "ttl_s": self.ttl_s}
        answer = await self._post(self._path, body)  # a heartbeat naming no board: any answers
        if answer.get("finished"):
            raise PlanFinished(self._task_path)
        identity: str | None = answer.get("board")
        return identity

    def _named(self, body: dict[str, Any]) -> dict[str, Any]:
        return body if self.board is None else {**body, "board": self.board}

    def _check(self, answer: dict[str, Any]) -> None:
        """Note the answering board; ``BoardChanged`` if it is not the one claimed from,
        ``PlanFinished`` if the task's job made its whole plan."""
        if answer.get("finished"):
            raise PlanFinished(self._task_path)
        self.seen = answer.get("board")
        if self.board is None:
            self.board = self.seen
        elif self.seen is not None and self.seen != self.board:
            raise BoardChanged(self.seen)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._send("POST", path, body)

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        for attempt in range(10):
            try:
                response = await self._http.request(method, path, json=body)
                response.raise_for_status()
                data: dict[str, Any] = response.json()["data"]
                return data
            except httpx.HTTPError:
                if attempt == 9:
                    raise
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._http.aclose()


def lease_client(task_type: str, leases: dict[str, Any]) -> Leases:
    """The board of the service running this worker's job in this process, else HTTP."""
    worker, ttl_s = str(leases["worker"]), float(leases.get("ttl_s", 30))
    job = current_job()
    if job is not None and job.lease_board is not None and not job.in_worker:
        return BoardLeases(job.lease_board, task_type, worker, ttl_s)
    return HttpLeases(str(leases["url"]), task_type, worker, ttl_s)


async def leased(plan: Plan, task_type: str, leases: dict[str, Any]) -> AsyncIterator[Sample]:
    """The samples of ``plan`` (the whole plan, whatever its ``share``) this worker is granted."""
    client = lease_client(task_type, leases)
    count = max(1, int(leases.get("count", 1)))
    index = int(leases.get("index", 0)) % count
    chunk = max(1, int(leases.get("chunk", DEFAULT_CHUNK)))
    walk = _Walks(client, plan, recent=collections.deque(maxlen=max(MIN_IN_FLIGHT, 8 * chunk)))
    heartbeat = asyncio.create_task(_heartbeat(walk), name="lease-heartbeat")
    walked = False
    try:
        # Over HTTP the board may be a restarted service's, knowing nothing of what its earlier
        # lives made: the plan from the task's resume point first, as for a board that changed.
        if (identity := await client.identity()) is not None:
            await walk.board_changed(identity)
        while True:
            try:
                async for sample in _walk(walk, index, count, chunk):
                    walk.recent.append(item_key(sample.epoch, sample.instance_id, sample.repeat))
                    yield sample
                walked = True
                return
            except BoardChanged as changed:
                await walk.board_changed(str(changed))
            except _Stale:  # the heartbeat met the new board first
                pass
    except PlanFinished:
        logger.info("%s: the task's job made its whole plan: nothing left to make", client.worker)
    finally:
        job = current_job()
        if walked and job is not None:
            # What it still has in flight stays its own until written (a long rollout may take
            # more than its lease): the heartbeat renews it until the run ends, with the event
            # loop of a worker process, or with the job in the service's process.
            job.background.add(heartbeat)
        else:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat


class _Stale(Exception):
    """The plan being walked was rebuilt (the board changed): walk the new one."""


class _Walks:
    """A worker's walks of its plan, one per board: the plan (from the resume point the latest
    board's task gave), and what it last yielded (its items in flight are among them)."""

    def __init__(self, client: Leases, plan: Plan, recent: collections.deque[str]) -> None:
        self.client = client
        self.plan = plan
        self.recent = recent
        self.generation = 0
        self.lock = asyncio.Lock()  # a rebuild and the walk's claims, one at a time

    async def board_changed(self, board: str) -> None:
        """The board is now ``board``, new (the walk or the heartbeat met it, or the worker's
        first contact): the plan from the task's resume point, the items in flight claimed again
        at once (not another's to make; a board settling grants them before anything else)."""
        client = self.client
        async with self.lock:
            while board != client.board:
                self.generation += 1  # the walk under way is stale from now on
                client.board = board
                try:
                    point = await client.resume_point()
                    plan = dataclasses.replace(self.plan, resume=ResumePoint.from_json(point))
                    in_flight = _in_plan(plan, self.recent)
                    kept = await client.claim(in_flight, in_flight=True) if in_flight else []
                except BoardChanged as again:  # newer still
                    board = str(again)
                    continue
                self.plan = plan
                logger.warning(
                    "%s: the lease board is new (a restarted service?): walking the plan again from "
                    "the task's resume point; %d of %d items in flight kept",
                    client.worker,
                    len(kept),
                    len(in_flight),
                )

    async def claim(self, generation: int, offer: list[str], plan: dict[str, int] | None) -> list[str]:
        """``client.claim`` for the walk of ``generation`` (``_Stale`` once it is not the latest);
        while the board settles, again until it has."""
        while True:
            async with self.lock:
                if generation != self.generation:
                    raise _Stale
                try:
                    return await self.client.claim(offer, plan)
                except Settling as settling:
                    wait_s = settling.seconds
            await asyncio.sleep(min(wait_s, MAX_POLL_S))

    async def orphans(self, generation: int, limit: int) -> tuple[list[str], int, int]:
        async with self.lock:
            if generation != self.generation:
                raise _Stale
            return await self.client.orphans(limit)


async def _walk(walks: _Walks, index: int, count: int, chunk: int) -> AsyncIterator[Sample]:
    """One walk of the plan (see the module's docstring); ``BoardChanged`` if the board changes,
    ``_Stale`` if the plan was rebuilt meanwhile."""
    client, plan, generation = walks.client, walks.plan, walks.generation
    whole = dataclasses.replace(plan, share=(0, 1))
    # The plan's size per epoch lets the board forget each epoch once made; every worker tells
    # it (their plans differ when they learned the resume point at different times: the board
    # keeps the largest), each epoch with the first claim that offers items of it: a plan may
    # hold millions of items (slime asks for 100,000 epochs).
    first_sizes, epoch_size = whole.epoch_sizes()
    told: set[int] = set()

    def sizes(samples: list[Sample]) -> dict[str, int] | None:
        new = {sample.epoch for sample in samples} - told
        told.update(new)
        return {str(epoch): first_sizes.get(epoch, epoch_size) for epoch in sorted(new)} or None

    async def claim(samples: list[Sample]) -> list[Sample]:
        by_key = {item_key(s.epoch, s.instance_id, s.repeat): s for s in samples}
        granted = await walks.claim(generation, list(by_key), sizes(samples))
        return [by_key[key] for key in granted]

    for samples in _chunks(dataclasses.replace(plan, share=(index, count)), chunk):
        for sample in await claim(samples):
            yield sample
    # The tails of the others' shares, each read backwards: only for a plan small enough to
    # hold a share in memory; in a larger one a lost worker's items still come back below.
    tails = (*range(index + 1, count), *range(index)) if whole.total() <= MAX_TAIL_PLAN else ()
    for other in tails:
        share = list(dataclasses.replace(plan, share=(other, count)))
        for samples in _chunks(reversed(share), chunk):
            granted = await claim(samples)
            for sample in granted:
                yield sample
            if len(granted) < len(samples):  # its worker got here first: the rest is its own
                break
    walked_again = False
    while True:
        keys, held_by_others, unmade = await walks.orphans(generation, chunk)
        if keys:
            logger.info("%s: taking over %d items of a worker that stopped", client.worker, len(keys))
            for sample in whole.find(_items(keys)):
                yield sample
            continue
        if unmade and not walked_again:  # a worker was lost before it claimed its items
            walked_again = True
            for samples in _chunks(whole, chunk):
                for sample in await claim(samples):
                    yield sample
            continue
        if held_by_others == 0:
            return
        await asyncio.sleep(min(client.ttl_s / 4, MAX_POLL_S))


def _in_plan(plan: Plan, keys: Collection[str]) -> list[str]:
    """Those of ``keys`` the (whole) plan makes, in their order: past its first epochs (those the
    skips and the resume point shorten, walked here) every item of an epoch is in it."""
    walked_epochs = plan._special_epochs()
    early: set[str] = set()
    if walked_epochs:
        walk = dataclasses.replace(plan, num_epoch=walked_epochs, share=(0, 1))
        wanted = {parts[0] for key in keys if (parts := split_key(key)) is not None}
        for epoch, row, repeats in walk._all_groups():
            if str(epoch) in wanted:
                early.update(item_key(epoch, row["instance_id"], repeat) for repeat in repeats)
    kept = []
    for key in dict.fromkeys(keys):
        parts = split_key(key)
        if parts is None or not parts[0].isdigit():
            continue
        epoch = int(parts[0])
        if (epoch < walked_epochs and key in early) or walked_epochs <= epoch < plan.num_epoch:
            kept.append(key)
    return kept


async def _heartbeat(walks: _Walks) -> None:
    client = walks.client
    try:
        while True:
            await asyncio.sleep(client.ttl_s / 3)
            try:
                await client.claim([])
            except BoardChanged as changed:  # claim what it has in flight on the new board now
                with contextlib.suppress(httpx.HTTPError, PlanFinished):
                    await walks.board_changed(str(changed))
            except (httpx.HTTPError, PlanFinished):  # the walk meets the end of the plan too
                pass
    finally:
        await client.aclose()


def _chunks(samples: Iterable[Sample], size: int) -> Iterator[list[Sample]]:
    """``samples`` in lists of about ``size``, never splitting a group's repeats."""
    chunk: list[Sample] = []
    for _, group in itertools.groupby(samples, key=lambda sample: (sample.epoch, sample.instance_id)):
        chunk.extend(group)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _items(keys: Iterable[str]) -> Iterator[tuple[int, str, int]]:
    """``(epoch, instance id as text, repeat)`` of each item key."""
    for key in keys:
        parts = split_key(key)
        if parts is not None:
            yield int(parts[0]), parts[1], parts[2]
