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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from buffer.current import current_job
from buffer.keys import key_or_env
from buffer.lease_terms import DEFAULT_CHUNK, item_key, split_key
from buffer.toolkit.dataset import Plan
from buffer.toolkit.types import Sample

if TYPE_CHECKING:  # the board is the service's: a generator in its process is handed it
    from buffer.workers.leases import LeaseBoard

logger = logging.getLogger(__name__)

#: Plans of at most this many items have the others' tails walked (a share is held in memory).
MAX_TAIL_PLAN = 200_000
#: A worker waiting for the others polls for orphans at least this often.
MAX_POLL_S = 1.0


class Leases(Protocol):
    worker: str
    ttl_s: float

    async def claim(self, offer: list[str], plan: dict[str, int] | None = None) -> list[str]: ...

    async def orphans(self, limit: int) -> tuple[list[str], int, int]: ...

    async def aclose(self) -> None: ...


class BoardLeases:
    """A worker in the service's process: the board itself, no HTTP."""

    def __init__(self, board: LeaseBoard, task_type: str, worker: str, ttl_s: float) -> None:
        self._board = board
        self._task_type = task_type
        self.worker = worker
        self.ttl_s = ttl_s

    async def claim(self, offer: list[str], plan: dict[str, int] | None = None) -> list[str]:
        return self._board.claim(self._task_type, self.worker, offer, self.ttl_s, plan)

    async def orphans(self, limit: int) -> tuple[list[str], int, int]:
        return self._board.orphans(self._task_type, self.worker, limit, self.ttl_s)

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
        self._path = f"/tasks/{task_type}/leases"
        self.worker = worker
        self.ttl_s = ttl_s

    async def claim(self, offer: list[str], plan: dict[str, int] | None = None) -> list[str]:
        body: dict[str, Any] = {"worker": self.worker, "offer": offer, "ttl_s": self.ttl_s}
        if plan:
            body["plan"] = plan
        granted: list[str] = (await self._post(self._path, body))["granted"]
        return granted

    async def orphans(self, limit: int) -> tuple[list[str], int, int]:
        body = await self._post(
            f"{self._path}/orphans", {"worker": self.worker, "limit": limit, "ttl_s": self.ttl_s}
        )
        return body["granted"], body["held_by_others"], body.get("unmade", 0)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(10):
            try:
                response = await self._http.post(path, json=body)
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
    whole = dataclasses.replace(plan, share=(0, 1))
    # The plan's size per epoch lets the board forget each epoch once made; one worker of the
    # job tells it (every worker's plan is the same), each epoch with the first claim that
    # offers items of it: a plan may hold millions of items (slime asks for 100,000 epochs).
    first_sizes, epoch_size = whole.epoch_sizes() if index == 0 else ({}, 0)
    told: set[int] = set()
    heartbeat = asyncio.create_task(_heartbeat(client), name="lease-heartbeat")
    walked = False

    def sizes(samples: list[Sample]) -> dict[str, int] | None:
        if index != 0:
            return None
        new = {sample.epoch for sample in samples} - told
        told.update(new)
        return {str(epoch): first_sizes.get(epoch, epoch_size) for epoch in sorted(new)} or None

    async def claim(samples: list[Sample]) -> list[Sample]:
        by_key = {item_key(s.epoch, s.instance_id, s.repeat): s for s in samples}
        granted = await client.claim(list(by_key), sizes(samples))
        return [by_key[key] for key in granted]

    try:
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
            keys, held_by_others, unmade = await client.orphans(chunk)
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
                walked = True
                return
            await asyncio.sleep(min(client.ttl_s / 4, MAX_POLL_S))
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


async def _heartbeat(client: Leases) -> None:
    try:
        while True:
            await asyncio.sleep(client.ttl_s / 3)
            with contextlib.suppress(httpx.HTTPError):
                await client.claim([])
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
