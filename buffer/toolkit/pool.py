"""Several policy servers behind one client: least in flight, sticky groups, health checks.

``remote_engine_url`` may name several engines (a list). Each request goes to the healthy
engine with the fewest requests in flight (ties: the one sent the fewest so far), except that
requests with the same routing key (one group: same instance, same epoch; see ``routing_key``)
stick to the engine the first of them went to, so the group's samples share its prefix cache.
The sticky map is an LRU of ``sticky_size`` keys: verl's ``AsyncLLMServerManager`` does the same
(least requests, and an LRU from request id to server for multi-turn prefix caching).

An engine that refuses or drops a connection is taken out at once (the request is retried on
another engine); a background task asks each engine's ``/health`` every ``health_interval_s``
and takes out those that do not answer 200, puts back those that do. With no engine healthy,
requests go to all of them as if they were (the client's retry budget then rides the outage).

Where an SGLang router fronts the engines (one URL), the client sends the routing key in the
router's header instead (``transport.ROUTING_KEY_HEADER``, ``X-SMG-Routing-Key``), which its
``consistent_hashing`` and ``manual`` policies route on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from buffer.toolkit.transport import Transport, Unreachable

logger = logging.getLogger(__name__)

#: The routing key of the request being made in this task: the runner sets it per trajectory,
#: to the trajectory's group (``group_key``). ``None``: no stickiness.
routing_key: ContextVar[str | None] = ContextVar("routing_key", default=None)


def group_key(task: str, epoch: int, instance_id: object) -> str:
    """A group's routing key: short, ASCII (an HTTP header value), the same in every process."""
    digest = hashlib.blake2b(repr((task, epoch, instance_id)).encode(), digest_size=12)
    return digest.hexdigest()


@dataclass(slots=True)
class Engine:
    url: str
    index: int
    healthy: bool = True
    in_flight: int = 0
    sent: int = 0


class EnginePool:
    """The engines behind ``urls`` and where the next request goes."""

    def __init__(
        self,
        urls: Sequence[str],
        transport: Transport,
        *,
        health_url: str = "/health",
        health_interval_s: float = 2.0,
        health_timeout_s: float = 5.0,
        sticky_size: int = 10_000,
    ) -> None:
        if not urls:
            raise ValueError("an engine pool needs at least one engine URL")
        self.engines = [Engine(url, index) for index, url in enumerate(urls)]
        self.transport = transport
        self.health_urls = [url.rstrip("/").removesuffix("/v1") + health_url for url in urls]
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.sticky_size = sticky_size
        self._sticky: OrderedDict[str, Engine] = OrderedDict()
        self._watcher: asyncio.Task[None] | None = None

    @property
    def single(self) -> bool:
        return len(self.engines) == 1

    def healthy(self) -> list[Engine]:
        return [engine for engine in self.engines if engine.healthy]

    def pick(self, key: str | None) -> Engine:
        """The engine for the next request with routing key ``key``; counted as in flight
        (``release`` it when the request is done)."""
        if self.single:
            engine = self.engines[0]
        else:
            self._watch()
            engine = self._choose(key)
        engine.in_flight += 1
        engine.sent += 1
        return engine

    def release(self, engine: Engine) -> None:
        engine.in_flight -= 1

    def failed(self, engine: Engine, error: Unreachable) -> bool:
        """``engine`` did not answer: take it out until its health check answers. True when
        another engine is healthy, so the request can go there at once."""
        if self.single:
            return False
        if engine.healthy:
            engine.healthy = False
            logger.warning("engine %s taken out of the pool: %s", engine.url, error)
        return any(other.healthy for other in self.engines)

    def _choose(self, key: str | None) -> Engine:
        healthy = self.healthy()
        candidates = healthy or self.engines
        if key is not None:
            engine = self._sticky.get(key)
            if engine is not None and (engine.healthy or not healthy):
                self._sticky.move_to_end(key)
                return engine
        engine = min(candidates, key=lambda e: (e.in_flight, e.sent))
        if key is not None:
            self._sticky[key] = engine
            self._sticky.move_to_end(key)
            if len(self._sticky) > self.sticky_size:
                self._sticky.popitem(last=False)
        return engine

    def _watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._health_loop(), name="engine-health")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(engine) for engine in self.engines))
            await asyncio.sleep(self.health_interval_s)

    async def _probe(self, engine: Engine) -> None:
        url = self.health_urls[engine.index]
        try:
            status = await self.transport.get(url, self.health_timeout_s)
        except Unreachable as exc:
            healthy, why = False, str(exc)
        else:
            healthy, why = status == 200, f"/health answered {status}"
        if healthy != engine.healthy:
            engine.healthy = healthy
            if healthy:
                logger.info("engine %s back in the pool", engine.url)
            else:
                logger.warning("engine %s taken out of the pool: %s", engine.url, why)

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
