"""``rollout-buffer gateway``: the recording gateway in processes of its own, feeding one buffer.

One service process proxies a few thousand agent calls a second at most (``docs/gateway.md``,
What it costs). A gateway process serves the gateway's routes alone (``/sessions`` and each
session's OpenAI, Anthropic and Responses roots) with the same code as the service's own
gateway, for the buffer at ``--buffer-url``:

- the sessions opened at it are its own: their events journaled in its ``--data-dir`` (a
  restart of it replays them, and loses no acknowledged call);
- it mirrors the buffer's policy (``buffer.toolkit.remote_policy``): calls wait while the
  trainer updates the weights, and are recorded at the buffer's version;
- a session's end writes its trajectories to the buffer in one batch
  (``buffer.service.gateway.remote``): uids ``session-<id>[...]``, a retried end counted once,
  and answered as the buffer counted it.

A gateway process runs no more than a request needs: the agents' calls go straight from the
security guards (pure ASGI, as the service's) to their endpoints (``CallRouter``: no routing
table, exception middleware or framework between), and an answer's head and body leave in one
write (``_OneWrite``); the rest (opens, rewards, ends, state) are plain Starlette routes
(``routes.sessions.PLAIN_ROUTES``): it serves no schema, so FastAPI would buy nothing.

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

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

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
from buffer.service.responses import envelope
from buffer.service.routes import dialects, sessions
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


def create_gateway_app(settings: Settings, buffer_url: str) -> GatewayApp:
    """The gateway's routes, recording for the buffer at ``buffer_url``."""
    buffer_url = buffer_url.rstrip("/")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        buffer = RolloutBuffer()  # it holds the sessions' events, never a trajectory
        key = required_key(settings)
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
            if store is not None:
                await asyncio.to_thread(store.close)

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

    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]), *sessions.PLAIN_ROUTES],
        lifespan=lifespan,
        exception_handlers={RolloutBufferError: _buffer_error},
    )
    # The guards outside everything, in the service's order (the key checked first); the calls
    # are routed inside them, ahead of the routing table.
    guarded: ASGIApp = BodySizeLimitMiddleware(CallRouter(app), max_bytes=settings.max_request_bytes)
    guarded = BrowserGuardMiddleware(guarded, allowed_origins=settings.allowed_origins)
    if (hosts := host_rule(settings)) is not None:
        guarded = HostGuardMiddleware(guarded, rule=hosts)
    if (key := required_key(settings)) is not None:
        guarded = ApiKeyMiddleware(guarded, api_key=key)
    return GatewayApp(app, guarded)


class GatewayApp:
    """The gateway process's ASGI app: ``guarded`` (the guards, the call routes, then ``app``);
    ``app``, the Starlette app, for its ``state`` and routes."""

    def __init__(self, app: Starlette, guarded: ASGIApp) -> None:
        self.app = app
        self.state = app.state
        self._guarded = guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._guarded(scope, receive, send)


#: The agents' calls: a session's root in each dialect, by the path after ``/v1/``.
CALLS = {
    "chat/completions": sessions.chat_completions,
    "messages": dialects.messages,
    "responses": dialects.create_response,
    "completions": dialects.create_completion,
}


class CallRouter:
    """``POST /sessions/{id}/v1/<call>`` straight to its endpoint (``CALLS``), its errors answered
    as ``app``'s handlers answer them; anything else to ``app``."""

    def __init__(self, app: Starlette) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/sessions/"):
            session_id, found, call = scope["path"][10:].partition("/v1/")
            if found and session_id and "/" not in session_id:
                endpoint = CALLS.get(call)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app
        scope["path_params"] = {"session_id": session_id}
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except RolloutBufferError as exc:
            response = await _buffer_error(request, exc)
        except Exception:
            logger.exception("%s %s failed", scope["method"], scope["path"])
            response = envelope(False, "internal error: see the gateway's log", status_code=500)
        await response(scope, receive, send)


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
    guarded = connections.guarded_protocol(limits)
    return {"http": type("GatewayProtocol", (_OneWriteProtocol, guarded), {})}


class _OneWriteProtocol:
    """uvicorn's protocol with each answer's head held until its body's first bytes, and both
    written at once: one write, and one wake-up of the agent, where uvicorn makes two."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        cycle = self.cycle  # type: ignore[attr-defined]
        if cycle is not None:
            cycle.transport = _OneWrite(cycle.transport, cycle)


class _OneWrite:
    """A request's transport, as its ``RequestResponseCycle`` writes to it: the response's head
    (the first write once the response has started) is held, and written with what follows, or
    on the loop's next turn if nothing follows at once (a stream that waits)."""

    __slots__ = ("_cycle", "_head", "_held", "_transport")

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self._transport = transport
        self._cycle = cycle
        self._head = False  # the head has come
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif not self._head and self._cycle.response_started:
            self._head = True
            self._held = data
            asyncio.get_running_loop().call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


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
