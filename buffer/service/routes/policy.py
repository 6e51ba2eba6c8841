"""The trainer's side of asynchronous RL: the policy version, and pause/resume around a sync.

``POST /policy`` says which policy the engines now serve (versions only go up);
``POST /policy/pause`` closes the gate of in-process generators (no new engine request
starts) and, in ``abort`` mode, asks the engines to abort what is in flight: the toolkit
continues those replies from their tokens after ``POST /policy/resume``. The pause answers
once nothing is in flight (or after ``timeout_s``). SGLang engines named in ``engine_urls``
get ``/pause_generation`` and ``/continue_generation`` too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, Literal

import httpx
from fastapi import APIRouter, Body, Depends, Query
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from buffer.policy.state import Policy
from buffer.service.responses import envelope
from buffer.service.services import Services, services
from buffer.toolkit.llm import engine_root_url

logger = logging.getLogger(__name__)

router = APIRouter()

Version = Annotated[int, Field(ge=0, le=2**63 - 1, strict=True)]


class VersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Version


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "drain"] = Field(
        "abort",
        description="abort: engines abort in-flight requests, continued after resume; drain: they finish",
    )
    timeout_s: float = Field(60.0, ge=0, le=3600, description="wait at most this long for in-flight requests")
    engine_urls: list[str] | None = Field(
        None, description="SGLang engines (or routers) to send /pause_generation and /continue_generation"
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
    """The engines now serve ``version``; a lower one than the current is refused (409)."""
    policy.set_version(body.version)
    return envelope(True, f"Policy version {policy.version}", _state(policy))


router.include_router(_version_routes)


@router.post("/policy/pause")
async def pause(
    policy: Annotated[Policy, Depends(_policy)], body: Annotated[PauseRequest | None, Body()] = None
) -> Response:
    body = body or PauseRequest()
    policy.pause(body.mode)
    if body.engine_urls is not None:
        policy.engine_urls = list(body.engine_urls)
    if body.mode == "abort":
        await _tell_engines(policy.engine_urls, "/pause_generation", {"mode": "abort"})
    drained = await policy.gate.drained(body.timeout_s)
    state = {**_state(policy), "mode": body.mode, "drained": drained, "in_flight": policy.gate.in_flight}
    return envelope(
        True, "Generation paused" if drained else "Generation paused; requests still in flight", state
    )


@router.post("/policy/resume")
async def resume(
    policy: Annotated[Policy, Depends(_policy)], body: Annotated[ResumeRequest | None, Body()] = None
) -> Response:
    body = body or ResumeRequest()
    if policy.mode == "abort":
        await _tell_engines(policy.engine_urls, "/continue_generation", {})
    policy.resume(body.version)
    return envelope(True, "Generation resumed", _state(policy))


def _state(policy: Policy) -> dict[str, Any]:
    return policy.state()


# -- for generators outside the service's process (worker processes, remote machines) --------


@router.get("/policy/watch")
async def watch(
    policy: Annotated[Policy, Depends(_policy)],
    version: int | None = None,
    paused: bool = False,
    wait_s: Annotated[float, Query(ge=0, le=60)] = 30.0,
) -> Response:
    """The version and pause state once they differ from ``version`` and ``paused`` (or after
    ``wait_s``): a generator elsewhere long-polls this to mirror the gate."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        ticket = policy.changed.ticket()
        state = policy.state()
        left = deadline - asyncio.get_running_loop().time()
        if state != {"version": version, "paused": paused} or left <= 0:
            ticket.cancel()
            return envelope(True, "Policy", state)
        await ticket.wait(left)


class AdmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_type: Annotated[str, Field(min_length=1)]
    wait_s: float = Field(30.0, ge=0, le=60, description="wait up to this long for room")


@router.post("/policy/admit")
async def admit(body: AdmitRequest, policy: Annotated[Policy, Depends(_policy)]) -> Response:
    """Admit one group of the task's generator, waiting up to ``wait_s`` for room (the
    staleness bound). ``bounded: false``: the task has no admission, never ask again."""
    admission = policy.admission(body.task_type)
    if admission is None or admission.capacity is None:
        if admission is not None:
            admission.try_admit()
        return envelope(True, "Admitted", {"admitted": True, "bounded": False})
    try:
        if not admission.try_admit():
            await asyncio.wait_for(admission.admit(), body.wait_s)
    except TimeoutError:
        return envelope(True, "No room yet", {"admitted": False, "bounded": True})
    return envelope(True, "Admitted", {"admitted": True, "bounded": True})


async def _tell_engines(urls: list[str], path: str, body: dict[str, str]) -> None:
    """POST to every engine at once; one that fails is logged, not fatal (the gate holds)."""
    if not urls:
        return
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        answers = await asyncio.gather(
            *(client.post(engine_root_url(url) + path, json=body) for url in urls), return_exceptions=True
        )
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, BaseException):
            logger.warning("%s%s failed: %r", url, path, answer)
        elif answer.is_error:
            logger.warning("%s%s answered HTTP %d", url, path, answer.status_code)
