"""``rollout-buffer gateway``: the recording gateway in processes of its own, feeding one buffer.

One service process proxies a few thousand agent calls a second at most (``docs/gateway.md``,
What it costs). A gateway process serves the gateway's routes alone (``/sessions`` and each
session's OpenAI, Anthropic and Responses roots) with the same code as the service's own
gateway, for the buffer at ``--buffer-url``:

- the sessions opened at it are its own: their events journaled in its ``--data-dir`` (a
  restart of it replays them, and loses no acknowledged call);
- it mirrors the buffer's policy (``buffer.toolkit.remote_policy``): calls wait while the
  trainer updates the weights, and are recorded at the buffer's version;
- a session's end writes its trajectories to the buffer with the toolkit's ``HttpSink``
  (``buffer.service.gateway.remote``): uids ``session-<id>[...]``, a retried end counted once.

A session is pinned to its process by its address (its ``base_url``), so no balancer stands
between an agent and its calls. ``--processes N`` starts N of them, process ``i`` on port
``--port + i`` with the data folder ``--data-dir/i``, and starts again one that dies. The buffer
hands its own ``POST /sessions`` to them when started with ``--gateway-url`` for each
(``buffer.service.routes.handoff``), so a harness that opens sessions at the buffer is unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import Response

from buffer import __version__
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.errors import RolloutBufferError
from buffer.logs import configure_logging
from buffer.policy.state import Policy
from buffer.service.gateway.images import ImagePolicy
from buffer.service.gateway.proxy import EngineProxy
from buffer.service.gateway.remote import RemoteGateway
from buffer.service.gateway.service import GatewayConfig
from buffer.service.job_policy import JobPolicy
from buffer.service.models import invalid_input
from buffer.service.responses import envelope
from buffer.service.routes import sessions
from buffer.service.security import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuardMiddleware,
    HostGuardMiddleware,
    host_rule,
    required_key,
)
from buffer.service.services import local_url
from buffer.service.settings import Settings
from buffer.store.base import Store
from buffer.store.sqlite import Journal
from buffer.toolkit.remote_policy import RemotePolicy

logger = logging.getLogger(__name__)

#: How often a gateway process tries again to reach the buffer's policy while it cannot.
POLICY_RETRY_S = 1.0
#: A process that dies is started again after this, doubled while it keeps dying (at most the max).
RESTART_S = 1.0
MAX_RESTART_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's own flags (the service's, such as ``--port`` and ``--data-dir``, are added
    beside them by the command line)."""
    parser.add_argument(
        "--buffer-url",
        required=True,
        help="the rollout buffer the sessions are written to, e.g. http://10.0.0.5:8889",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="gateway processes, each on its own port (--port + i) and data folder (--data-dir/i); "
        "one that dies is started again",
    )


def run(settings: Settings, namespace: argparse.Namespace) -> int:
    """``rollout-buffer gateway``: one process here, or ``--processes`` supervised."""
    processes: int = namespace.processes
    if processes < 1:
        raise SystemExit("rollout-buffer gateway: --processes must be 1 or more")
    if processes > 1 and settings.port + processes - 1 > 65535:
        raise SystemExit("rollout-buffer gateway: --port + --processes goes past port 65535")
    if processes == 1:
        serve(settings, namespace.buffer_url)
        return 0
    return supervise([process_settings(settings, index) for index in range(processes)], namespace.buffer_url)


def process_settings(settings: Settings, index: int) -> Settings:
    """Process ``index``'s settings: its own port and data folder."""
    data_dir = None if settings.data_dir is None else settings.data_dir / str(index)
    return settings.model_copy(update={"port": settings.port + index, "data_dir": data_dir})


# -- one gateway process ------------------------------------------------------------------


def create_gateway_app(settings: Settings, buffer_url: str) -> FastAPI:
    """The gateway's routes, recording for the buffer at ``buffer_url``."""
    buffer_url = buffer_url.rstrip("/")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        buffer = RolloutBuffer()  # it holds the sessions' events, never a trajectory
        key = required_key(settings)
        client = httpx.AsyncClient(timeout=60.0, trust_env=False)
        gate = MirroredGate(buffer.policy)
        gateway = RemoteGateway(
            buffer,
            EngineProxy(),
            ImagePolicy(
                None if settings.data_dir is None else settings.data_dir / "images",
                local_url(settings) + "/images/",
            ),
            JobPolicy.from_settings(settings),
            local_url(settings),
            config=GatewayConfig(require_session_key=key is not None),
            pause_gate=gate,
            buffer_url=buffer_url,
            client=client,
            api_key=key,
        )
        store = await asyncio.to_thread(_restore, buffer, settings)
        mirror = asyncio.create_task(gate.follow(buffer_url, key), name="policy-mirror")
        sweeper = asyncio.create_task(_sweep(gateway, settings.sweep_interval_s), name="session-sweeper")
        app.state.gateway = gateway
        logger.info(
            "rollout buffer %s: gateway for %s at %s (%d open sessions)",
            __version__,
            buffer_url,
            local_url(settings),
            len(gateway.store.sessions),
        )
        try:
            yield
        finally:
            for task in (mirror, sweeper):
                task.cancel()
            await asyncio.gather(mirror, sweeper, return_exceptions=True)
            await gate.aclose()
            await gateway.aclose()
            await gateway.proxy.aclose()
            await client.aclose()
            if store is not None:
                await asyncio.to_thread(store.close)

    app = FastAPI(
        title="rollout-buffer gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.router.routes[:0] = sessions.ROUTES
    app.include_router(sessions.router)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """This process, and the buffer's policy as its mirror has it (``heard``: connected)."""
        gateway: RemoteGateway = request.app.state.gateway
        remote = gateway.pause_gate.remote if isinstance(gateway.pause_gate, MirroredGate) else None
        policy: dict[str, Any] = {"heard": remote is not None}
        policy["paused"] = remote is not None and remote.gate.is_paused()
        policy["version"] = None if remote is None else remote.gate.version
        data = {"role": "gateway", "buffer_url": buffer_url, "pid": os.getpid(), "policy": policy}
        data["open_sessions"] = len(gateway.store.sessions)
        return envelope(True, "ok", data)

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(BrowserGuardMiddleware, allowed_origins=settings.allowed_origins)
    if (hosts := host_rule(settings)) is not None:
        app.add_middleware(HostGuardMiddleware, rule=hosts)
    if (key := required_key(settings)) is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=key)
    app.add_exception_handler(RolloutBufferError, _buffer_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    return app


class MirroredGate:
    """The buffer's pause gate as a gateway process sees it: open until the mirror has heard
    the buffer, then the mirror's (``RemotePolicy``), whose version the local policy takes (a
    call is recorded at the version it was served under)."""

    def __init__(self, local: Policy) -> None:
        self._local = local
        self.remote: RemotePolicy | None = None

    def is_paused(self) -> bool:
        remote = self.remote
        if remote is None:
            return False
        self._take_version(remote)
        return remote.gate.is_paused()

    async def wait_resumed(self, timeout_s: float) -> bool:
        remote = self.remote
        if remote is None:
            return True
        resumed = await remote.gate.wait_resumed(timeout_s)
        self._take_version(remote)
        return resumed

    def _take_version(self, remote: RemotePolicy) -> None:
        version = remote.gate.version
        if version is not None and version != self._local.version:
            self._local.version = version

    async def follow(self, buffer_url: str, api_key: str | None) -> None:
        """Connect the mirror, trying again while the buffer cannot be reached."""
        while self.remote is None:
            self.remote = await RemotePolicy.connect(buffer_url, "gateway", api_key)
            if self.remote is None:
                logger.warning("the buffer's policy at %s cannot be read yet; retrying", buffer_url)
                await asyncio.sleep(POLICY_RETRY_S)

    async def aclose(self) -> None:
        if self.remote is not None:
            await self.remote.aclose()


def _restore(buffer: RolloutBuffer, settings: Settings) -> Store | None:
    """The sessions of the data folder replayed, and every change kept there from now on."""
    if settings.data_dir is None:
        return None
    store = Journal(
        settings.data_dir,
        sync=settings.durability == "sync",
        compact_bytes=settings.journal_compact_bytes,
        retention_s=settings.export_retention_hours * 3600,
    )
    try:
        buffer.restore(store.recover())
        buffer.attach(store)
    except BaseException:
        store.close()
        raise
    return store


async def _sweep(gateway: RemoteGateway, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            gateway.expire()
        except Exception:
            logger.exception("session sweep failed")


async def _buffer_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RolloutBufferError)
    if exc.status_code >= 500:
        logger.error("%s %s: %s", request.method, request.url.path, exc.message)
    return envelope(False, exc.message, status_code=exc.status_code, headers=exc.headers(), **exc.details())


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [{**error, "loc": tuple(error["loc"])[1:]} for error in exc.errors()]
    return await _buffer_error(request, invalid_input(errors))


def serve(settings: Settings, buffer_url: str) -> None:
    """Serve one gateway process until SIGTERM or Ctrl-C."""
    import uvicorn

    configure_logging(settings.log_level, settings.log_format, levels=settings.log_levels())
    gc.set_threshold(50_000, 20, 20)  # as the service: many short-lived objects a call
    gc.freeze()
    config = uvicorn.Config(
        create_gateway_app(settings, buffer_url),
        host=settings.host,
        port=settings.port,
        log_level=None,
        log_config=None,
        access_log=settings.access_log,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=3,
        **_connection_options(settings),
    )
    uvicorn.Server(config).run()


def _connection_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's HTTP protocol bounded as the service's is (``buffer.service.connections``)."""
    try:
        from buffer.service import connections
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        return {"http": "h11", "h11_max_incomplete_event_size": settings.max_header_bytes}
    connections.raise_descriptor_limit()
    limits = connections.ConnectionLimits(
        settings.max_header_bytes,
        settings.header_timeout_seconds,
        settings.max_connections or connections.default_max_connections(),
    )
    return {"http": connections.guarded_protocol(limits)}


# -- several, supervised -------------------------------------------------------------------


def supervise(settings: list[Settings], buffer_url: str) -> int:
    """Run a gateway process for each of ``settings``, starting again any that exits, until
    SIGTERM or Ctrl-C stops them all."""
    configure_logging(settings[0].log_level, settings[0].log_format, levels=settings[0].log_levels())
    context = multiprocessing.get_context("spawn")
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    children: dict[int, Any] = {}
    restart_s = dict.fromkeys(range(len(settings)), RESTART_S)
    due: dict[int, float] = dict.fromkeys(range(len(settings)), 0.0)
    try:
        while not stopping:
            now = time.monotonic()
            for index, when in list(due.items()):
                if when <= now:
                    child = context.Process(
                        target=serve, args=(settings[index], buffer_url), name=f"gateway-{index}"
                    )
                    child.start()
                    children[index] = (child, now)
                    del due[index]
                    logger.info(
                        "gateway process %d (pid %s) on port %d", index, child.pid, settings[index].port
                    )
            sentinels = [child.sentinel for child, _ in children.values()]
            multiprocessing.connection.wait(sentinels, timeout=0.5)
            for index, (child, started) in list(children.items()):
                if child.is_alive() or stopping:
                    continue
                del children[index]
                lived_s = time.monotonic() - started
                restart_s[index] = (
                    RESTART_S if lived_s > MAX_RESTART_S else min(restart_s[index] * 2, MAX_RESTART_S)
                )
                due[index] = time.monotonic() + restart_s[index]
                logger.warning(
                    "gateway process %d exited with code %s; starting it again in %.0f s",
                    index,
                    child.exitcode,
                    restart_s[index],
                )
    finally:
        for child, _ in children.values():
            if child.is_alive():
                child.terminate()  # SIGTERM: each stops as the service does
        for child, _ in children.values():
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
