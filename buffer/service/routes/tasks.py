"""``PUT /tasks/{name}``: configure a task without starting a job.

For generators that run elsewhere (``rollout-buffer worker``, a generator of one's own on
another machine): the task gets its group size, timeouts and hooks before the first write, so
its groups are judged as its ``/start_rollout`` would have them judged. Without this a write to
an unknown task is grouped by ``--group-size`` (slime's behaviour), or refused with
``--strict-tasks``.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.responses import Response

from buffer.core.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE
from buffer.errors import InvalidInput, TooManyTasks
from buffer.lease_terms import PlanFinished, Settling
from buffer.service.models import TaskGrouping
from buffer.service.responses import envelope
from buffer.service.services import Services, services

router = APIRouter(prefix="/tasks")


class TaskConfig(TaskGrouping):
    """How the task groups and judges what is written to it; defaults as ``/start_rollout``'s."""

    model_config = ConfigDict(extra="forbid")

    generator: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        None,
        description="the TASK_TYPE of the generator file whose hooks judge the groups (default: the "
        "task's own name if a generator defines it, else the default hooks)",
    )


@router.put("/{name}")
async def configure_task(
    name: Annotated[str, Field(min_length=1)], body: TaskConfig, svc: Annotated[Services, Depends(services)]
) -> Response:
    settings = body.task_settings(svc.settings.default_task_settings())
    if body.evaluation:
        hooks, source = EVALUATION_HOOKS, EVALUATION_SOURCE
    else:
        await asyncio.to_thread(svc.registry.refresh)
        source = body.generator or name
        # A generator named outright must exist (a typo would silently judge with the defaults).
        hooks = svc.registry.get(source).hooks if body.generator else svc.registry.hooks_for(source)
    svc.buffer.configure_task(name, settings, hooks, hooks_source=source)
    await svc.buffer.wait_durable()
    return envelope(
        True,
        f"Task {name} configured",
        {
            "task_type": name,
            "settings": asdict(settings),
            "hooks_from": source,
            "hooks_overridden": sorted(hooks.overridden),
        },
    )


#: The most items one epoch of a plan may have: the board sums them (``unmade``), and the sum
#: must stay a 64-bit integer for any number of epochs it can hold.
MAX_EPOCH_ITEMS = 2**32
#: The longest work item (``epoch|instance_id|repeat``) a claim may name.
MAX_KEY_CHARS = 512
#: The longest epoch name a plan may have: a plan's epochs are numbers.
MAX_EPOCH_CHARS = 20


class LeaseClaim(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    offer: list[Annotated[StrictStr, Field(max_length=MAX_KEY_CHARS)]] = Field(
        default_factory=list, max_length=10_000
    )
    ttl_s: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False)
    board: Annotated[StrictStr, Field(max_length=64)] | None = Field(
        None, description="the identity of the board the worker claims from (from its last answer)"
    )
    plan: (
        dict[
            Annotated[StrictStr, Field(max_length=MAX_EPOCH_CHARS)],
            Annotated[int, Field(ge=0, le=MAX_EPOCH_ITEMS)],
        ]
        | None
    ) = Field(
        None,
        max_length=10_000,
        description="how many items each epoch of the worker's plan has (sent with its first claim)",
    )
    in_flight: bool = Field(
        False,
        description="the offer is what the worker had in flight before this board: granted while a "
        "new board settles (its answer's settle_s), when any other offer is granted nothing",
    )


class OrphanClaim(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    limit: int = Field(64, ge=0, le=10_000)
    ttl_s: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False)
    board: Annotated[StrictStr, Field(max_length=64)] | None = None


@router.post("/{name}/leases")
async def claim_leases(name: str, body: LeaseClaim, svc: Annotated[Services, Depends(services)]) -> Response:
    """Grant the worker the offered work items (``epoch|instance_id|repeat``) that nobody holds
    and none has made; renew its leases (an empty offer is a heartbeat). ``board``: the identity
    of the task's board now; a claim naming another board is granted nothing (the board is new:
    the worker walks its plan from the task's ``resume_point`` first). ``settle_s``: the board
    is new and grants only items in flight for that long: claim again after. ``finished``: the
    task's job made its whole plan: the worker stops. Work granted for a task no job counts
    starts the task's remote run (``RolloutBuffer.remote_run``): its resume point then says what
    its workers made, after a restart too."""
    board = svc.jobs.leases
    _check_task(name, svc)
    answer: dict[str, Any] = {"granted": []}
    try:
        answer["granted"] = board.claim(
            name, body.worker, body.offer, body.ttl_s, body.plan, body.board, body.in_flight
        )
    except Settling as settling:
        answer["settle_s"] = round(settling.seconds, 3)
    except PlanFinished:
        answer["finished"] = True
    if answer["granted"]:
        svc.buffer.remote_run(name)  # journaled before any granted item's trajectory can be
    answer["board"] = board.identity(name)
    return envelope(True, f"{len(answer['granted'])} granted", answer)


@router.post("/{name}/leases/orphans")
async def claim_orphans(
    name: str, body: OrphanClaim, svc: Annotated[Services, Depends(services)]
) -> Response:
    """Grant the worker items whose worker stopped; how many others hold, and how many items of
    the plan nobody holds or made."""
    board = svc.jobs.leases
    _check_task(name, svc)
    try:
        granted, held_by_others, unmade = board.orphans(name, body.worker, body.limit, body.ttl_s, body.board)
    except PlanFinished:
        return envelope(True, "finished", {"granted": [], "held_by_others": 0, "unmade": 0, "finished": True})
    if granted:
        svc.buffer.remote_run(name)
    return envelope(
        True,
        f"{len(granted)} granted",
        {
            "granted": granted,
            "held_by_others": held_by_others,
            "unmade": unmade,
            "board": board.identity(name),
        },
    )


def _check_task(name: str, svc: Services) -> None:
    """Leases only for a task that has a job's board, or that the buffer keeps or may still
    make (its workers' writes create it): under ``--strict-tasks`` a configured one, and never
    one past ``--max-tasks``, which would be refused its writes."""
    buffer = svc.buffer
    if buffer.has_task(name) or svc.jobs.leases.identity(name) is not None:
        return
    if buffer.strict_tasks:
        raise InvalidInput.one(
            "task_type", f"no task {name!r} here: configure it first (PUT /tasks/{name}; --strict-tasks)"
        )
    if buffer.max_tasks and len(buffer.task_types()) >= buffer.max_tasks:
        raise TooManyTasks("task_type", name, buffer.max_tasks)


@router.get("/{name}/resume_point")
async def resume_point(name: str, svc: Annotated[Services, Depends(services)]) -> Response:
    """What the task's job (or its remote run: lease workers, no job) has produced since it
    started (``RolloutBuffer.resume_point``): a lease worker whose board changed (a restarted
    service) walks its plan from here, so it offers only what is still to make, by instance
    and epoch where the trajectories said their epoch (``finished_epochs``, ``open_epochs``).
    Empty for a task the buffer does not know. ``finished``: the task's job made its whole plan
    (this life of the service): nothing is left to make, a worker stops."""
    point = svc.buffer.known_resume_point(name) or {"finished_groups": [], "open_groups": []}
    finished = svc.jobs.leases.finished(name)
    return envelope(True, f"resume point of {name}", {"resume": point, "finished": finished})
