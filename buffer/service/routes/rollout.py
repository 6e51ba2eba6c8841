"""What the trainer calls: ``/start_rollout`` and ``/get_rollout_data``.

``/get_rollout_data`` is a hot route too (``HOT_ROUTES``, ``buffer.service.app.ServiceApp``): a
body it reads as FastAPI would is answered ahead of FastAPI's machinery, anything else by the
FastAPI route, so that its errors read as they always have.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from buffer.core.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE
from buffer.core.reads import REPLAY_OFF
from buffer.core.registry import Generator
from buffer.core.task import TaskSettings
from buffer.errors import InvalidInput
from buffer.service.engine_check import engine_urls, unreachable
from buffer.service.jobs import Job
from buffer.service.models import GetRolloutDataRequest, StartRolloutRequest, check_storable
from buffer.service.responses import items_response, json_response
from buffer.service.services import Services, local_url, services
from buffer.service.start_fields import check_start_fields

router = APIRouter()


@router.post("/start_rollout")
async def start_rollout(body: StartRolloutRequest, svc: Annotated[Services, Depends(services)]) -> Response:
    """Start the task's generator in the background; buffered data is never dropped.

    Refused before anything starts: a field the generator does not take (422, with the closest
    known name), an ``input_file`` that cannot be read (422), engines of which none answers
    (503 naming ``remote_engine_url``). A task already running answers 200 with its running job
    when the payload is the one it runs with (``skip_instance_ids`` aside), 409 naming the fields
    that differ otherwise, unless the payload says ``"restart": true``. A task whose last job, of
    this generator and plan, did not finish (failed, cancelled, not resumed after a crash) gets
    a job that makes only what that one did not; ``"restart": true`` makes the whole plan again.
    """
    check_storable(body)  # before anything starts: the job's data is journaled as it came
    await asyncio.to_thread(svc.registry.refresh)  # pick up new and edited generator files
    generator = svc.registry.get(body.task_type)
    check_start_fields(body, generator)
    name = body.rollout_name or body.task_type
    async with svc.jobs.lock(name):
        return await _start(body, generator, name, svc)


async def _start(body: StartRolloutRequest, generator: Generator, name: str, svc: Services) -> Response:
    running = svc.jobs.running(name)
    settings = body.task_settings(svc.settings.default_task_settings())
    data = await svc.jobs.check(_generator_data(body, name, settings, local_url(svc.settings)))
    if running is not None and not body.restart:
        return _already_running(running, data, svc)
    urls = engine_urls(data.get("remote_engine_url")) if svc.jobs.engines_checked(data) else []
    dead = await unreachable(urls) if urls else {}
    if urls and len(dead) == len(urls):
        reasons = "; ".join(f"{url}: {error}" for url, error in dead.items())
        return json_response(
            {
                "success": False,
                "message": f"remote_engine_url: no engine answers ({reasons}); nothing was started",
                "errors": [{"field": "remote_engine_url", "reason": f"no engine answers: {reasons}"}],
            },
            status_code=503,
            headers={"Retry-After": "5"},
        )
    if running is not None:
        await svc.jobs.cancel(running.id)
    if body.evaluation:
        svc.buffer.configure_task(name, settings, EVALUATION_HOOKS, hooks_source=EVALUATION_SOURCE)
    else:
        svc.buffer.configure_task(name, settings, generator.hooks, hooks_source=body.task_type)
    job = svc.jobs.start(generator, data, name=name, restart=body.restart)
    # Answered only once the task's settings and the job's record are on disk (one wait: the
    # journal keeps them in this order): a crash after the answer resumes the job (and its task
    # goes on counting what its workers, and remote ones, make) rather than forget it.
    await svc.buffer.wait_durable()
    return _started(svc, job, "Rollout started")


def _started(svc: Services, job: Job, message: str, **extra: Any) -> Response:
    return json_response(
        {
            "success": True,
            "message": message,
            "task_type": job.task_type,
            "job_id": job.id,
            "job": svc.jobs.describe(job),
            **extra,
        }
    )


#: What a job's data holds that no client sets the same twice: the service's own additions, and
#: the finished groups a trainer resumed from a checkpoint sends (the running job has its own plan).
_NOT_COMPARED = frozenset({"resume", "leases", "worker", "skip_instance_ids"})


def _already_running(running: Job, data: dict[str, Any], svc: Services) -> Response:
    """The same payload again: the running job (idempotent). Another: 409 naming what differs."""
    differs = sorted(
        name
        for name in (data.keys() | running.data.keys()) - _NOT_COMPARED
        if _canonical(data.get(name)) != _canonical(running.data.get(name))
    )
    if differs:
        return json_response(
            {
                "success": False,
                "message": (
                    f"the {running.task_type} rollout is already running ({running.id}) with other "
                    f'values of {", ".join(differs)}: send "restart": true to replace it, or '
                    "wait for it to end"
                ),
                "differs": differs,
                "task_type": running.task_type,
                "job_id": running.id,
            },
            status_code=409,
        )
    extra: dict[str, Any] = {}
    if _canonical(data.get("skip_instance_ids")) != _canonical(running.data.get("skip_instance_ids")):
        extra["ignored"] = ["skip_instance_ids"]  # the running job keeps its plan
    return _started(svc, running, "Rollout already running", **extra)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _generator_data(
    body: StartRolloutRequest, name: str, settings: TaskSettings, buffer_url: str
) -> dict[str, Any]:
    """The trainer's dict with its numbers parsed and the buffer's own defaults filled in.

    ``task_type`` is the buffer task the generator writes to: its own, or the ``rollout_name``
    it runs under (``generator_task_type`` keeps the generator's)."""
    data = body.model_dump(exclude_none=True)
    for control in ("restart", "rollout_name"):
        data.pop(control, None)
    data.update(
        task_type=name,
        generator_task_type=body.task_type,
        num_repeat_per_sample=settings.group_size,
        group_timeout_seconds=settings.group_timeout_s,
        remote_buffer_url=body.remote_buffer_url or buffer_url,
    )
    return data


@router.post("/get_rollout_data")
async def get_rollout_data(
    request: Request,
    svc: Annotated[Services, Depends(services)],
    body: Annotated[GetRolloutDataRequest | None, Body()] = None,
) -> Response:
    """Take ready groups, whole and oldest first. Nothing ready is a 200 with ``success: false``."""
    return await _read(request, svc, body or GetRolloutDataRequest())


async def get_rollout_data_hot(request: Request, raw: bytes) -> Response | None:
    """``get_rollout_data`` on a body read and validated as FastAPI would (``json.loads``, the
    model in Python mode): an empty body is the defaults; anything else that does not validate
    (invalid JSON, ``null``, a wrong field) is None: FastAPI's route answers it."""
    if raw:
        try:
            parsed = json.loads(raw)
            if not isinstance(parsed, dict):
                return None
            body = GetRolloutDataRequest.model_validate(parsed)
        except (ValueError, RecursionError, ValidationError):  # a JSONDecodeError is a ValueError
            return None
    else:
        body = GetRolloutDataRequest()
    return await _read(request, request.app.state.services, body)


async def _read(request: Request, svc: Services, body: GetRolloutDataRequest) -> Response:
    check_storable(body)
    svc.check_task(body.task_type)
    for task_type in body.mix or ():
        svc.check_task(task_type)
    if body.replay_ratio and not svc.buffer.replay_enabled:  # before any wait: the answer is known
        raise InvalidInput.one("replay_ratio", REPLAY_OFF)
    if body.wait_s and not await svc.wait_for_items(request, body.task_type, 1, body.wait_s):
        return Response(status_code=499)  # the client has gone: read nothing it would lose
    max_items = None if body.batch_size in (None, -1) else body.batch_size
    result = svc.buffer.read(body.task_type, max_items, mix=body.mix, replay_ratio=body.replay_ratio)
    await svc.buffer.wait_durable()  # a group handed out is never handed out again, even after a crash
    items = [item for group in result.groups for item in group.items]
    if not result.groups:
        return items_response(False, "No data available to read", (), result.meta_info)
    return items_response(True, f"Successfully read {result.num_items} items", items, result.meta_info)


HOT_ROUTES = {"/get_rollout_data": get_rollout_data_hot}
