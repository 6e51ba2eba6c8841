"""What the trainer calls: ``/start_rollout`` and ``/get_rollout_data``."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends
from starlette.requests import Request
from starlette.responses import Response

from buffer.core.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE
from buffer.core.registry import Generator
from buffer.core.task import TaskSettings
from buffer.policy.fields import check_start_fields
from buffer.policy.state import register_policy, set_current_policy
from buffer.service.jobs import JOB_FIELDS
from buffer.service.models import GetRolloutDataRequest, StartRolloutRequest, check_storable
from buffer.service.responses import items_response, json_response
from buffer.service.services import Services, local_url, services

router = APIRouter()


@router.post("/start_rollout")
async def start_rollout(body: StartRolloutRequest, svc: Annotated[Services, Depends(services)]) -> Response:
    """Start the task's generator in the background; buffered data is never dropped.

    A task already running answers with its running job unless the payload says
    ``"restart": true``. A task whose last job, of this generator and plan, did not finish
    (failed, cancelled, not resumed after a crash) gets a job that makes only what that one did
    not; ``"restart": true`` makes the whole plan again.
    """
    check_storable(body)  # before anything starts: the job's data is journaled as it came
    await asyncio.to_thread(svc.registry.refresh)  # pick up new and edited generator files
    generator = svc.registry.get(body.task_type)
    check_start_fields(body.model_extra or {}, generator.module, _toolkit_fields())
    name = body.rollout_name or body.task_type
    async with svc.jobs.lock(name):
        return await _start(body, generator, name, svc)


async def _start(body: StartRolloutRequest, generator: Generator, name: str, svc: Services) -> Response:
    running = svc.jobs.running(name)
    if running is None or body.restart:
        settings = body.task_settings(svc.settings.default_task_settings())
        data = await svc.jobs.check(_generator_data(body, name, settings, local_url(svc.settings)))
        if running is not None:
            await svc.jobs.cancel(running.id)
        if body.evaluation:
            svc.buffer.configure_task(name, settings, EVALUATION_HOOKS, hooks_source=EVALUATION_SOURCE)
        else:
            svc.buffer.configure_task(name, settings, generator.hooks, hooks_source=body.task_type)
        await svc.buffer.wait_durable()
        _start_admission(svc, name, settings, body)
        job = svc.jobs.start(generator, data, name=name, restart=body.restart)
        message = "Rollout started"
    else:
        job, message = running, "Rollout already running"
    return json_response(
        {
            "success": True,
            "message": message,
            "task_type": name,
            "job_id": job.id,
            "job": svc.jobs.describe(job),
        }
    )


def _toolkit_fields() -> frozenset[str]:
    from buffer.toolkit.runner import RolloutSettings  # the toolkit is loaded with the first job

    return frozenset(RolloutSettings.model_fields) | JOB_FIELDS


def _start_admission(svc: Services, name: str, settings: TaskSettings, body: StartRolloutRequest) -> None:
    """Let the job's generator find the buffer's policy, and count its admissions from now."""
    policy = svc.buffer.policy
    register_policy(local_url(svc.settings), policy)
    set_current_policy(policy)  # the job's task is created in this context
    policy.gate.reset_stats()
    in_flight = body.num_process or 100
    policy.start_admission(
        name,
        settings.max_staleness,
        -(-in_flight // max(1, settings.group_size)),
        lambda: svc.buffer.consumed_groups(name),
    )


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
    body = body or GetRolloutDataRequest()
    check_storable(body)
    svc.check_task(body.task_type)
    for task_type in body.mix or ():
        svc.check_task(task_type)
    if body.wait_s and not await svc.wait_for_items(request, body.task_type, 1, body.wait_s):
        return Response(status_code=499)  # the client has gone: read nothing it would lose
    max_items = None if body.batch_size in (None, -1) else body.batch_size
    result = svc.buffer.read(body.task_type, max_items, mix=body.mix)
    await svc.buffer.wait_durable()  # a group handed out is never handed out again, even after a crash
    items = [item for group in result.groups for item in group.items]
    if not result.groups:
        return items_response(False, "No data available to read", (), result.meta_info)
    return items_response(True, f"Successfully read {result.num_items} items", items, result.meta_info)
