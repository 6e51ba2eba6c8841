"""The application factory: ``create_app(settings)``; all state is built in the lifespan.

A request passes one layer of the service's own before its route, ``ServiceGuard``
(``buffer.service.security``: its id, the API key, the ``Host``, a browser's origin and content
type, the body's size, in one pass over the headers). FastAPI's routes sit behind FastAPI's own
layers as well (its error handlers, telemetry, body limit, exit stack, router). The hot routes
(``HOT_ROUTES``: the writes and ``/get_rollout_data``) are answered ahead of all of that:
``ServiceApp`` hands them to the guard and then straight to their endpoint, errors answered as
FastAPI's handlers answer them. ``docs/performance.md`` has what each layer cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from buffer import __version__
from buffer.core.registry import GeneratorRegistry
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.errors import InvalidInput, RolloutBufferError
from buffer.policy.gate import Gate
from buffer.service.gateway.images import ImagePolicy
from buffer.service.gateway.proxy import EngineProxy
from buffer.service.gateway.service import Gateway, GatewayConfig
from buffer.service.history import History
from buffer.service.job_policy import JobPolicy
from buffer.service.jobs import JobManager
from buffer.service.metrics import watch_logprobs
from buffer.service.models import TRAJECTORY, invalid_input
from buffer.service.responses import envelope
from buffer.service.routes import (
    dashboard,
    docs,
    export,
    handoff,
    jobs,
    metrics,
    policy,
    rollout,
    service,
    sessions,
    tail,
    tasks,
    trajectories,
    writes,
)
from buffer.service.security import ServiceGuard, host_rule, required_key, warn_if_exposed
from buffer.service.services import Services, Stopping, local_url
from buffer.service.settings import Settings
from buffer.signal import Signal
from buffer.store.base import Store
from buffer.store.sqlite import Journal

logger = logging.getLogger(__name__)

#: A hot route's endpoint: the request (its app, its connection) and its whole body; None hands
#: the request to FastAPI's route of the same path, the body replayed (a body it is not sure of,
#: so that an error reads as FastAPI's validation writes it).
HotEndpoint = Callable[[Request, bytes], Awaitable[Response | None]]
#: ``POST`` routes answered ahead of FastAPI's layers and routing; each has a route in the router
#: too, which the OpenAPI schema describes and which answers when FastAPI's telemetry is on.
HOT_ROUTES: dict[str, HotEndpoint] = {**writes.HOT_ROUTES, **rollout.HOT_ROUTES}


def create_app(settings: Settings | None = None) -> ServiceApp:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry = GeneratorRegistry(
            settings.generator_dir,
            hook_timeout_s=settings.hook_timeout_s,
            import_timeout_s=settings.generator_import_timeout_s,
        )
        await asyncio.to_thread(registry.refresh)
        buffer = RolloutBuffer(
            settings.default_task_settings(),
            hooks_for=registry.hooks_for,
            dedup_window=settings.dedup_window,
            max_buffered=settings.max_buffered_trajectories,
            max_tasks=settings.max_tasks,
            one_group_per_instance=settings.one_group_per_instance,
            strict_tasks=settings.strict_tasks,
            replay=settings.replay_settings(),
        )
        policy = JobPolicy.from_settings(settings)
        stopping = Stopping()
        gateway = _gateway(buffer, settings, policy, stopping)  # before the restore: it replays the sessions
        store = await asyncio.to_thread(_restore, buffer, settings)
        ready = Signal()
        buffer.add_listener(ready.notify)
        job_manager = JobManager(
            buffer,
            local_url(settings),
            policy=policy,
            isolation=settings.job_isolation,
            grace_s=settings.worker_grace_s,
            api_key=required_key(settings),
            log_level=settings.log_level,
            log_levels=settings.log_levels(),
            ray_address=settings.ray_address,
            worker_env_api_key=settings.worker_env_api_key,
            check_engines=settings.check_engines,
        )
        buffer.write_observers.append(job_manager.leases.observe)
        watch_logprobs(buffer)  # counted from the first write, not the first scrape
        if store is not None:
            await job_manager.resume(registry, enabled=settings.resume_jobs)
        history = History()
        app.state.services = Services(settings, buffer, registry, job_manager, ready, history, stopping)
        app.state.gateway = gateway
        # --gateway-url: new sessions are opened at gateway processes (routes/handoff.py)
        app.state.handoff = (
            handoff.Handoff(settings.gateway_url, buffer, required_key(settings))
            if settings.gateway_url
            else None
        )
        sweeper = asyncio.create_task(
            _sweep_timeouts(buffer, history, gateway, settings.sweep_interval_s), name="timeout-sweeper"
        )
        logger.info(
            "rollout buffer %s: generators from %s: %s",
            __version__,
            settings.generator_dir,
            ", ".join(sorted(registry.generators)) or "none",
        )
        warn_if_exposed(settings)
        if not settings.generator_dir.is_dir():
            logger.warning(
                "the generator folder %s does not exist (--generator-dir): no task has a generator, "
                "and /start_rollout answers 404 until the folder is made",
                settings.generator_dir,
            )
        try:
            yield
        finally:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)
            await job_manager.shutdown()
            await gateway.proxy.aclose()
            if app.state.handoff is not None:
                await app.state.handoff.aclose()
            if store is not None:
                await asyncio.to_thread(store.close)
                logger.info("the buffer is on disk in %s", settings.data_dir)

    # /docs is served from vendored files (routes/docs.py), not FastAPI's CDN page; no ReDoc.
    app = ServiceApp(
        title="rollout-buffer", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.router.routes[:0] = writes.ROUTES + sessions.ROUTES  # first: matched before any other route
    if settings.gateway_url:  # before /sessions: opened at the gateway processes
        app.router.routes[:0] = handoff.ROUTES
    modules = (
        rollout,
        policy,
        trajectories,
        export,
        jobs,
        tasks,
        service,
        metrics,
        dashboard,
        tail,
        docs,
        sessions,
    )
    for module in modules:
        app.include_router(module.router)
    guard: dict[str, Any] = {
        "max_bytes": settings.max_request_bytes,
        "allowed_origins": settings.allowed_origins,
        "hosts": host_rule(settings),  # None: any host
        "api_key": required_key(settings),  # None: no key asked
    }
    app.add_middleware(ServiceGuard, **guard)  # the one layer of ours: FastAPI's routes
    app.route_hot(HOT_ROUTES, ServiceGuard(HotRoutes(app), **guard))  # the same checks: the hot routes
    app.add_exception_handler(RolloutBufferError, _buffer_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


class ServiceApp(FastAPI):
    """FastAPI's app, with the hot routes (``route_hot``) answered ahead of its layers and routing:
    a ``POST`` to one of their paths goes to its guard (a ``ServiceGuard`` in front of
    ``HotRoutes``), anything else to FastAPI as usual. A write passes three ASGI callables
    (this, the guard, ``HotRoutes``) where FastAPI's way is about ten (Starlette's and FastAPI's
    five layers, ours, the router, the route and its wrappers). When FastAPI's telemetry is on
    (OpenTelemetry configured), every request goes FastAPI's way, so that its spans miss none."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hot_routes: dict[str, HotEndpoint] = {}
        self._hot_app: ASGIApp | None = None
        self._hot_on: bool | None = None  # decided at the first request, once the lifespan has run

    def route_hot(self, routes: dict[str, HotEndpoint], app: ASGIApp) -> None:
        """Answer ``POST`` to ``routes``' paths with ``app`` (which ends in ``HotRoutes``)."""
        self.hot_routes = dict(routes)
        self._hot_app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] in self.hot_routes
            and scope["method"] == "POST"
            and (self._hot_on if self._hot_on is not None else self._decide_hot())
        ):
            assert self._hot_app is not None
            scope["app"] = self  # as Starlette sets it: request.app
            await self._hot_app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's way for a request, layers and routing, whatever its path."""
        await super().__call__(scope, receive, send)

    def _decide_hot(self) -> bool:
        telemetry = getattr(self, "_native_telemetry", None)  # FastAPI's, configured at start-up
        self._hot_on = telemetry is None or not telemetry.enabled()
        return self._hot_on


class HotRoutes:
    """The hot routes' endpoints, behind the app's ``ServiceGuard``: the body read whole, then
    its endpoint; a ``RolloutBufferError`` (or a Starlette ``HTTPException``) answered as the app's
    handlers answer it, anything else a bare 500, logged, and raised on to the server as
    Starlette's outermost layer does. An endpoint that answers None hands the request, its body
    replayed, to FastAPI's route of the same path (the guard's checks are not made twice)."""

    def __init__(self, app: ServiceApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:  # the client has gone, or the guard has refused the body (413)
            return
        request = Request(scope, receive)
        try:
            response = await self.app.hot_routes[scope["path"]](request, body)
        except RolloutBufferError as exc:
            response = await _buffer_error(request, exc)
        except HTTPException as exc:
            response = await _http_error(request, exc)
        except Exception as exc:
            await (await _unexpected_error(request, exc))(scope, receive, send)
            raise
        if response is None:
            await self.app.routed(scope, _replay(body, receive), send)
        else:
            await response(scope, receive, send)


async def _read_body(receive: Receive) -> bytes | None:
    """The request's whole body; None if a disconnect comes first."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    chunks = [body]
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with ``body`` (read already) as its first message."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _open_store(settings: Settings) -> Store | None:
    """The store the settings ask for: the data folder's (``--data-dir``), or none (nothing
    survives the process, and nothing is spent keeping it)."""
    if settings.data_dir is None:
        return None
    return Journal(
        settings.data_dir,
        sync=settings.durability == "sync",
        compact_bytes=settings.journal_compact_bytes,
        retention_s=settings.export_retention_hours * 3600,
    )


def _restore(buffer: RolloutBuffer, settings: Settings) -> Store | None:
    """Open the store, rebuild the buffer from it, and keep every change in it from now on."""
    started = time.monotonic()
    store = _open_store(settings)
    if store is None:
        return None
    try:
        records = buffer.restore(store.recover())
        buffer.attach(store)
    except BaseException:
        store.close()
        raise
    stats = buffer.stats()
    logger.info(
        "data folder %s (durability %s): restored %d records in %.2f s: %d trajectories pending, "
        "%d ready, %d tasks",
        settings.data_dir,
        settings.durability,
        records,
        time.monotonic() - started,
        stats["pending_items"],
        stats["current_size"],
        len(stats["tasks"]),
    )
    return store


def _gateway(buffer: RolloutBuffer, settings: Settings, policy: JobPolicy, stopping: Stopping) -> Gateway:
    """The recording gateway (``/sessions``): its images beside the journal, when there is one."""
    images = ImagePolicy(
        None if settings.data_dir is None else settings.data_dir / "images", local_url(settings) + "/images/"
    )
    config = GatewayConfig(require_session_key=required_key(settings) is not None)
    return Gateway(
        buffer,
        EngineProxy(),
        images,
        policy,
        local_url(settings),
        config=config,
        # POST /policy/pause holds the agents' calls too, until the service stops
        pause_gate=_StoppingGate(buffer.policy.gate, stopping),
    )


class _StoppingGate:
    """The policy's gate as the gateway waits on it: an agent's call held by a pause answers
    (503, retry) at once when the service stops, instead of holding its shutdown up."""

    def __init__(self, gate: Gate, stopping: Stopping) -> None:
        self._gate = gate
        self._stopping = stopping

    def is_paused(self) -> bool:
        return self._gate.is_paused()

    async def wait_resumed(self, timeout_s: float) -> bool:
        return bool(await self._stopping.unless(self._gate.wait_resumed(timeout_s)))


async def _sweep_timeouts(
    buffer: RolloutBuffer, history: History, gateway: Gateway, interval_s: float
) -> None:
    """Finish timed-out groups and sessions even when no request comes to do it; sample the history;
    keep the buffer's tasks out of the collector's way (``_freeze_new_tasks``)."""
    frozen_tasks = -1
    while True:
        await asyncio.sleep(interval_s)
        try:
            buffer.expire()
            gateway.expire()
            history.sample(buffer)
            frozen_tasks = _freeze_new_tasks(buffer, frozen_tasks)
        except Exception:
            logger.exception("timeout sweep failed")


def _freeze_new_tasks(buffer: RolloutBuffer, frozen: int) -> int:
    """``gc.freeze()`` after the start (and its restore) and whenever the tasks have changed since
    (``frozen``: how many there were then); returns how many there are. A task's containers (its
    open groups, the uids remembered) live as long as the service, and a full collection visits
    every entry of a tracked container: at a million pending trajectories that stopped the event
    loop for over a second. Frozen, they are never visited; their entries are plain tuples and
    strings, which the collector does not track (``buffer.core.task``). Tasks are few
    (``--max-tasks``), so the rare cycle frozen with them that becomes garbage later stays bounded."""
    count = len(buffer.task_types())
    if count != frozen:
        gc.freeze()
    return count


async def _buffer_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RolloutBufferError)
    if exc.status_code >= 500:
        logger.error("%s %s: %s", request.method, request.url.path, exc.message)
    return envelope(False, exc.message, status_code=exc.status_code, headers=exc.headers(), **exc.details())


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    # FastAPI's locations start with where the value came from ("body", "query"): drop it.
    errors = [{**error, "loc": tuple(error["loc"])[1:]} for error in exc.errors()]
    return await _buffer_error(request, invalid_input(errors))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body", said plainly
        return await _buffer_error(request, InvalidInput.one("body", "is nested too deeply to parse"))
    return envelope(False, str(exc.detail), status_code=exc.status_code, headers=dict(exc.headers or {}))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return envelope(False, "internal error; the service log has the details", status_code=500)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the hot write routes and the trajectory schema they validate."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema["paths"].update(writes.OPENAPI_PATHS)
        schema["paths"].update(sessions.OPENAPI_PATHS)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        trajectory = TRAJECTORY.json_schema(ref_template="#/components/schemas/{model}")
        components.update(trajectory.pop("$defs", {}))
        components["Trajectory"] = trajectory
        app.openapi_schema = schema
    return app.openapi_schema
