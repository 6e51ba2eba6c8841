"""The application factory: ``create_app(settings)``; all state is built in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from buffer import __version__
from buffer.core.registry import GeneratorRegistry
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.errors import InvalidInput, RolloutBufferError
from buffer.logs import RequestIdMiddleware
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
from buffer.service.security import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuardMiddleware,
    HostGuardMiddleware,
    host_rule,
    required_key,
    warn_if_exposed,
)
from buffer.service.services import Services, Stopping, local_url
from buffer.service.settings import Settings
from buffer.signal import Signal
from buffer.store.base import Store
from buffer.store.sqlite import Journal

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
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
    app = FastAPI(
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
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(BrowserGuardMiddleware, allowed_origins=settings.allowed_origins)
    if (hosts := host_rule(settings)) is not None:
        app.add_middleware(HostGuardMiddleware, rule=hosts)
    if (key := required_key(settings)) is not None:  # no key: no middleware, no cost
        app.add_middleware(ApiKeyMiddleware, api_key=key)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so a 401 or 413 has an id too
    app.add_exception_handler(RolloutBufferError, _buffer_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


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
