"""Work leases: the service hands out a task's work items to the workers generating it, and
takes back those of a worker that stopped renewing them, so a lost worker's share still gets
made, and nothing is made twice into the buffer.

A work item is one trajectory of the plan: ``epoch|instance_id|repeat``. Every worker walks
the whole (seeded, identical) plan, each from its own offset, and offers the items it meets;
the service grants each item to one worker at a time (``LeaseBoard.claim``). A worker renews
its leases as it claims and on a heartbeat; once it stops for ``ttl_s`` its unfinished items are
orphans, granted again to whichever worker asks (``orphans``). An item is done once its
trajectory is in the buffer (the buffer's write observer, ``observe``), and is never granted
again. The board lives in the service's memory; a restart of the service starts it afresh (a
resumed job is told what the buffer holds instead). A worker cut off rather than dead, writing
again after its leases were taken over, can make an item twice: the heartbeat keeps that to
workers that really stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from buffer.client.base import key_or_env

if TYPE_CHECKING:  # the toolkit imports the service's jobs, which hold the board
    from buffer.toolkit.types import Sample

logger = logging.getLogger(__name__)


def item_key(epoch: Any, instance_id: Any, repeat: Any) -> str:
    return f"{epoch}|{instance_id}|{repeat}"


@dataclass(slots=True)
class _TaskLeases:
    held: dict[str, tuple[str, float]] = field(default_factory=dict)  # key -> (worker, expires)
    done: set[str] = field(default_factory=set)


class LeaseBoard:
    """The service's leases, by task."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._tasks: dict[str, _TaskLeases] = {}
        self._clock = clock

    def observe(self, task_type: str, raw: bytes) -> None:
        """A trajectory reached the buffer: its item is done (for tasks with leases only)."""
        leases = self._tasks.get(task_type)
        if leases is None:
            return
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            item = orjson.loads(raw)
            extra = item["extra_info"]
            key = item_key(extra["epoch"], item["instance_id"], extra["repeat"])
            leases.done.add(key)
            leases.held.pop(key, None)

    def claim(self, task_type: str, worker: str, offer: Iterable[str], ttl_s: float) -> list[str]:
        """Grant ``worker`` the offered items nobody else holds and none has made; renew its
        leases."""
        leases = self._tasks.setdefault(task_type, _TaskLeases())
        now = self._clock()
        self._renew(leases, worker, now + ttl_s)
        granted = []
        for key in offer:
            if key in leases.done:
                continue
            holder = leases.held.get(key)
            if holder is None or holder[0] == worker or holder[1] <= now:
                leases.held[key] = (worker, now + ttl_s)
                granted.append(key)
        return granted

    def orphans(self, task_type: str, worker: str, limit: int, ttl_s: float) -> tuple[list[str], int]:
        """Grant ``worker`` up to ``limit`` items whose holder stopped renewing; also how many
        items others still hold (0: all but this worker's own are made)."""
        leases = self._tasks.setdefault(task_type, _TaskLeases())
        now = self._clock()
        self._renew(leases, worker, now + ttl_s)
        granted: list[str] = []
        others = 0
        for key, (holder, expires) in list(leases.held.items()):
            if holder == worker:
                continue
            if expires <= now and len(granted) < limit:
                leases.held[key] = (worker, now + ttl_s)
                granted.append(key)
            else:
                others += 1
        return granted, others

    @staticmethod
    def _renew(leases: _TaskLeases, worker: str, expires: float) -> None:
        for key, (holder, _) in list(leases.held.items()):
            if holder == worker:
                leases.held[key] = (worker, expires)


class LeaseClient:
    """A worker's side: claims, orphans and a heartbeat against the service's ``/tasks`` routes."""

    def __init__(self, url: str, task_type: str, worker: str, ttl_s: float) -> None:
        headers = {}
        if key := key_or_env(None):
            headers["authorization"] = f"Bearer {key}"
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=30.0, trust_env=False
        )
        self._path = f"/tasks/{task_type}/leases"
        self.worker = worker
        self.ttl_s = ttl_s

    async def claim(self, offer: list[str]) -> list[str]:
        body = await self._post(self._path, {"worker": self.worker, "offer": offer, "ttl_s": self.ttl_s})
        granted: list[str] = body["granted"]
        return granted

    async def orphans(self, limit: int) -> tuple[list[str], int]:
        body = await self._post(
            f"{self._path}/orphans", {"worker": self.worker, "limit": limit, "ttl_s": self.ttl_s}
        )
        return body["granted"], body["held_by_others"]

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            with contextlib.suppress(httpx.HTTPError):
                await self.claim([])

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


async def leased(samples: list[Sample], leases: dict[str, Any], chunk: int = 64) -> AsyncIterator[Sample]:
    """The samples of ``samples`` (the whole plan) this worker is granted, then orphans of
    workers that stopped, until every other worker's items are made.

    ``leases``: ``url`` (the buffer), ``task_type``, ``worker`` (a name unique to this worker),
    ``ttl_s``, and ``index``/``count`` to start walking the plan at a different place each."""
    client = LeaseClient(leases["url"], leases["task_type"], leases["worker"], float(leases.get("ttl_s", 30)))
    by_key = {item_key(s.epoch, s.instance_id, s.repeat): s for s in samples}
    start = len(samples) * int(leases.get("index", 0)) // max(1, int(leases.get("count", 1)))
    order = [*samples[start:], *samples[:start]]
    heartbeat = asyncio.create_task(client.heartbeat(), name="lease-heartbeat")
    try:
        for at in range(0, len(order), chunk):
            offered = [item_key(s.epoch, s.instance_id, s.repeat) for s in order[at : at + chunk]]
            for key in await client.claim(offered):
                yield by_key[key]
        while True:
            granted, held_by_others = await client.orphans(chunk)
            for key in granted:
                if key in by_key:
                    logger.info("taking over %s from a worker that stopped", key)
                    yield by_key[key]
            if not granted and held_by_others == 0:
                return
            if not granted:
                await asyncio.sleep(client.ttl_s / 4)
    finally:
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat
        await client.aclose()
