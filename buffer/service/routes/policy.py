"""The trainer's side of asynchronous RL: the policy version, and pause/resume around a sync.

``POST /policy`` says which policy the engines now serve (versions only go up);
``POST /policy/pause`` closes the gate of in-process generators (no new engine request
starts) and, in ``abort`` mode, asks the engines named in ``engine_urls`` to abort what is in
flight, each in its own words (``buffer.service.engine_pause``: SGLang's ``/pause_generation``,
vLLM's ``/pause?mode=abort``): the toolkit continues those replies from their tokens after
``POST /policy/resume``, which lets the engines go on. The pause answers once nothing is in
flight (or after ``timeout_s``): nothing past the service's own gate, and every worker (a
generator in a worker process or elsewhere, mirroring the gate through ``GET /policy/watch``)
has said its gate is closed for this pause with nothing past it; ``in_flight`` counts them all.
An engine that refuses or cannot be reached makes the answer a 409 naming it, never ``drained:
true``; the gate stays closed until the resume. The engine URLs are checked as a job's are
(http(s), ``--allowed-engine-hosts``), at most ``MAX_ENGINE_URLS`` of at most
``MAX_ENGINE_URL_CHARS`` characters: a 422 otherwise. The resume tells only the engines the
last pause named, and forgets them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from buffer.policy.admission import Admission
from buffer.policy.state import Policy
from buffer.service.engine_pause import Action, EngineAnswer, tell_engines
from buffer.service.responses import envelope
from buffer.service.services import Services, Stopping, services

logger = logging.getLogger(__name__)

router = APIRouter()

Version = Annotated[int, Field(ge=0, le=2**63 - 1, strict=True)]
#: Engines one pause may name (a trainer names its engines or its router), and a URL's length.
MAX_ENGINE_URLS = 64
MAX_ENGINE_URL_CHARS = 2048
EngineUrl = Annotated[str, Field(min_length=1, max_length=MAX_ENGINE_URL_CHARS)]


class VersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Version
    rollout_batch_size: int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,
        description="the groups the trainer reads a step: what admission sizes generation by under "
        "max_staleness (absent: as declared at /start_rollout, else the trainer's largest read)",
    )
    task_type: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="the task rollout_batch_size is for (absent: every task)"
    )


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "drain"] = Field(
        "abort",
        description="abort: engines abort in-flight requests, continued after resume; drain: they finish",
    )
    timeout_s: float = Field(60.0, ge=0, le=3600, description="wait at most this long for in-flight requests")
    engine_urls: list[EngineUrl] | None = Field(
        None,
        max_length=MAX_ENGINE_URLS,
        description="engines (or routers) to abort in flight at the pause and to resume: SGLang's "
        "/pause_generation and /continue_generation, vLLM's /pause?mode=abort and /resume (vLLM serves them "
        "with VLLM_SERVER_DEV_MODE=1); only this pause's are told at the resume",
    )
    engine: Literal["auto", "vllm", "sglang"] = Field(
        "auto", description="the engines' kind; auto: SGLang's routes, else vLLM's, found per URL"
    )


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Version | None = None


def _policy(svc: Annotated[Services, Depends(services)]) -> Policy:
    return svc.buffer.policy


class _BothMethodsRoute(APIRoute):
    """``GET /policy`` and ``POST /policy`` are two routes (one operation each in the schema);
    a request with another method meets the GET route first, so its 405 lists both."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in (self.methods or ()):
            raise HTTPException(status_code=405, headers={"Allow": "GET, POST"})
        await super().handle(scope, receive, send)


_version_routes = APIRouter(route_class=_BothMethodsRoute)


@_version_routes.get("/policy")
async def get_policy(policy: Annotated[Policy, Depends(_policy)]) -> Response:
    """The version, whether generation is paused, and the policy's counters."""
    return envelope(True, "Policy", policy.snapshot())


@_version_routes.post("/policy")
async def set_policy(body: VersionRequest, policy: Annotated[Policy, Depends(_policy)]) -> Response:
    """The engines now serve ``version``; a lower one than the current is refused (409).
    ``rollout_batch_size``: the trainer's batch, in groups (admission under ``max_staleness``)."""
    if body.rollout_batch_size is not None:
        policy.declare_batch(body.rollout_batch_size, body.task_type)
    policy.set_version(body.version)
    return envelope(True, f"Policy version {policy.version}", _state(policy))


router.include_router(_version_routes)


@router.post("/policy/pause")
async def pause(
    svc: Annotated[Services, Depends(services)], body: Annotated[PauseRequest | None, Body()] = None
) -> Response:
    body = body or PauseRequest()
    policy = svc.buffer.policy
    if body.engine_urls:  # http(s), and the hosts a job may call (--allowed-engine-hosts): else a 422
        await svc.jobs.check({"engine_urls": body.engine_urls})
    policy.pause(body.mode)
    policy.name_engines(body.engine_urls or [], body.engine)
    answers: list[EngineAnswer] = []
    if body.mode == "abort":
        # Workers' gates closed first: what the engines abort is then held there until the
        # resume, not continued at once into the paused engines.
        await svc.stopping.unless(policy.closed(body.timeout_s))
        answers = await _tell(policy, "pause")
    failed = [answer for answer in answers if not answer.ok]
    # Engines that were not told keep generating: nothing drains them, so the answer is at
    # once; and once the service stops, with what is drained by then.
    drained = False if failed else bool(await svc.stopping.unless(policy.drained(body.timeout_s)))
    state = {
        **_state(policy),
        "mode": body.mode,
        "drained": drained,
        "in_flight": policy.in_flight(),
        "unpaused_workers": policy.unpaused_workers(),
        "engines": {answer.url: answer.detail for answer in answers},
    }
    if failed:
        return _engines_failed("Generation paused here, but not on every engine", failed, state)
    return envelope(
        True, "Generation paused" if drained else "Generation paused; requests still in flight", state
    )


@router.post("/policy/resume")
async def resume(
    policy: Annotated[Policy, Depends(_policy)], body: Annotated[ResumeRequest | None, Body()] = None
) -> Response:
    body = body or ResumeRequest()
    told = policy.engine_urls
    answers = await _tell(policy, "resume") if policy.mode == "abort" else []
    policy.resume(body.version)
    policy.forget_engines(told)
    failed = [answer for answer in answers if not answer.ok]
    state = {**_state(policy), "engines": {answer.url: answer.detail for answer in answers}}
    if failed:
        return _engines_failed("Generation resumed here, but not on every engine", failed, state)
    return envelope(True, "Generation resumed", _state(policy))


async def _tell(policy: Policy, action: Action) -> list[EngineAnswer]:
    answers = await tell_engines(policy.engine_urls, action, policy.engine_kind, policy.engine_kinds)
    for answer in answers:
        if not answer.ok:
            logger.warning("%s of engine %s", action, answer.describe())
    return answers


def _engines_failed(what: str, failed: list[EngineAnswer], state: dict[str, Any]) -> Response:
    """A 409 naming each engine that did not do what was asked (refused, failed or not reached):
    the engines are not in the state the trainer asked for. Not a 5xx: the service did its part."""
    named = "; ".join(answer.describe() for answer in failed)
    return envelope(False, f"{what}: {named}", state, 409)


def _state(policy: Policy) -> dict[str, Any]:
    return policy.state()


# -- for generators outside the service's process (worker processes, remote machines) --------


@router.get("/policy/watch")
async def watch(
    request: Request,
    svc: Annotated[Services, Depends(services)],
    version: int | None = None,
    paused: bool = False,
    wait_s: Annotated[float, Query(ge=0, le=60)] = 30.0,
    pause: int | None = None,
    worker: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
    in_flight: Annotated[int, Query(ge=0)] = 0,
    report: int = 0,
) -> Response:
    """The version and pause state once they differ from ``version``, ``paused`` and ``pause``
    (the number of the last pause, in ``pause``), or after ``wait_s``: a generator elsewhere
    long-polls this to mirror the gate. A ``worker`` (a name of its own) says at each watch
    what its gate holds: ``in_flight`` engine requests past it, closed for pause ``pause`` when
    ``paused`` (``report`` counts its watches, so an overtaken one is ignored); the pause's
    drain waits for it while it watches, and ``WORKER_GRACE_S`` after its watch ends. When
    the service stops, it answers at once."""
    policy = svc.buffer.policy
    if worker is not None:
        policy.watch_begins(worker, report, pause if paused else None, in_flight)
    try:
        return await _watch(request, policy, version, paused, wait_s, pause, svc.stopping)
    finally:
        if worker is not None:
            policy.watch_ends(worker)


async def _watch(
    request: Request,
    policy: Policy,
    version: int | None,
    paused: bool,
    wait_s: float,
    pause: int | None,
    stopping: Stopping,
) -> Response:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        ticket = policy.changed.ticket()
        state = policy.state()
        left = deadline - loop.time()
        moved = pause is not None and pause != policy.pauses
        if moved or state != {"version": version, "paused": paused} or left <= 0 or stopping.is_set():
            ticket.cancel()
            return envelope(True, "Policy", {**state, "pause": policy.pauses})
        await ticket.wait(min(left, 1.0))
        if await request.is_disconnected():  # a worker gone: its watch ends now, not at wait_s
            return envelope(True, "Policy", state)


class AdmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_type: Annotated[str, Field(min_length=1)]
    wait_s: float = Field(30.0, ge=0, le=60, description="wait up to this long for room")
    admit: bool = Field(True, description="false: only report cancelled_stale")
    groups: int = Field(
        1, ge=1, le=4096, description="admit up to this many groups at once (waiting only for the first)"
    )
    worker: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="the generator's own name (its policy watch's)"
    )
    cancelled_stale: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="groups this worker has cancelled in flight as stale so far, nothing of them written",
    )


@router.post("/policy/admit")
async def admit(body: AdmitRequest, svc: Annotated[Services, Depends(services)]) -> Response:
    """Admit up to ``groups`` groups of the task's generator (``groups`` in the answer says how
    many), waiting up to ``wait_s`` for room for one (the staleness bound; not once the service
    stops); ``waited_s``: how long it waited. ``bounded: false``: the task has no
    admission, never ask again. A ``worker`` reports the groups it cancelled as stale
    (``cancelled_stale``, its total so far): they stop counting against the bound."""
    admission = svc.buffer.policy.admission(body.task_type)
    if admission is not None and body.worker is not None and body.cancelled_stale:
        admission.report_cancelled(body.worker, body.cancelled_stale)
    if not body.admit:
        return envelope(True, "Reported", {"admitted": False, "reported": admission is not None})
    policy = svc.buffer.policy
    if admission is None or admission.capacity is None:
        if admission is not None:
            admission.try_admit(body.groups)
        return envelope(True, "Admitted", {"admitted": True, "bounded": False, "groups": body.groups})
    # The policy's state taken after the grant, for the worker to mirror before it starts the
    # groups: room a pause made is for the next version, and the watch may not have said the
    # pause yet.
    if groups := admission.try_admit(body.groups):
        granted = {"admitted": True, "bounded": True, "groups": groups, "waited_s": 0.0}
        return envelope(True, "Admitted", {**granted, "policy": policy.mirrored()})
    began = time.monotonic()  # ``waited_s``: how long there was no room (the run's slot breakdown)
    admitted = await svc.stopping.unless(_admitted_within(admission, body.wait_s))
    waited = {"bounded": True, "waited_s": round(time.monotonic() - began, 4)}
    if not admitted:
        return envelope(True, "No room yet", {"admitted": False, "groups": 0, **waited})
    groups = 1 + admission.try_admit(body.groups - 1)  # the room a read made is often for several
    return envelope(
        True, "Admitted", {"admitted": True, "groups": groups, **waited, "policy": policy.mirrored()}
    )


async def _admitted_within(admission: Admission, wait_s: float) -> bool:
    try:
        await asyncio.wait_for(admission.admit(), wait_s)
    except TimeoutError:
        return False
    return True
