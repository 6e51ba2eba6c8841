"""Sessions handed to gateway processes: the buffer's ``/sessions`` with ``--gateway-url``.

POST /sessions                 opened at the next gateway process in turn; its answer (its ``base_url``)
GET  /sessions/{id}            the session's state, from the process that owns it
POST /sessions/{id}/reward     forwarded to the process that owns it
POST /sessions/{id}/end        forwarded likewise: the process writes the trajectories here

A harness that opens its sessions at the buffer (``buffer.toolkit.gateway_session``) works
unchanged: the agent's calls go to the ``base_url`` the gateway process answered, never through
this service. The task's session settings from ``/start_rollout`` (its engine, pinned sampling,
timeout, token mode) are filled in here, where the job is known. The process that owns a session
is remembered from its opening (the last ``OWNERS_KEPT``), else found by asking each in turn (after
a restart of this service): a process answers 404 for a session it does not have. A process that
cannot be reached is skipped at an opening, and makes a forward a 503 to retry.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.errors import InvalidInput, RolloutBufferError
from buffer.service.gateway.sampling import pinned

logger = logging.getLogger(__name__)

OWNERS_KEPT = 100_000
#: What ``/start_rollout`` may say for a task's sessions, by the field of ``POST /sessions`` it fills.
_JOB_FIELDS = {
    "remote_engine_url": "remote_engine_url",
    "timeout_s": "session_timeout_s",
    "on_timeout": "session_on_timeout",
    "token_mode": "session_token_mode",
}


class NoGatewayProcess(RolloutBufferError):
    status_code = 503

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class Handoff:
    """The gateway processes at ``urls``, asked with this service's ``api_key``."""

    def __init__(self, urls: list[str], buffer: RolloutBuffer, api_key: str | None = None) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self._buffer = buffer
        self._turn = itertools.count()
        self._owners: OrderedDict[str, str] = OrderedDict()
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(headers=headers, timeout=60.0, trust_env=False)

    async def open(self, body: dict[str, Any]) -> httpx.Response:
        """Open the session at the next process that answers; its answer."""
        content = orjson.dumps(self._with_job(body))
        first = next(self._turn)
        for step in range(len(self.urls)):
            url = self.urls[(first + step) % len(self.urls)]
            try:
                response = await self._client.post(f"{url}/sessions", content=content)
            except httpx.TransportError as exc:
                logger.warning("gateway process %s cannot be reached (%r): trying the next", url, exc)
                continue
            if response.status_code == 200:
                self._remember(response.json()["data"]["session_id"], url)
            return response
        raise NoGatewayProcess(f"no gateway process answers ({', '.join(self.urls)}); retry")

    async def forward(self, request: Request, path: str) -> httpx.Response:
        """``request`` sent on to the process that owns its session."""
        session_id = request.path_params["session_id"]
        content = await request.body()
        owner = self._owners.get(session_id)
        unreachable = []
        for url in [owner] if owner is not None else self.urls:
            try:
                response = await self._client.request(request.method, f"{url}{path}", content=content or None)
            except httpx.TransportError:
                unreachable.append(url)
                continue
            if response.status_code == 404 and owner is None:
                continue  # not this one's
            self._remember(session_id, url)
            return response
        if unreachable:
            raise NoGatewayProcess(
                f"the gateway process of session {session_id!r} may be {', '.join(unreachable)}, which "
                "cannot be reached now; retry"
            )
        return response

    def _remember(self, session_id: str, url: str) -> None:
        self._owners[session_id] = url
        self._owners.move_to_end(session_id)
        while len(self._owners) > OWNERS_KEPT:
            self._owners.popitem(last=False)

    def _with_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body with the task's session settings where it gives none: the gateway processes
        know no jobs."""
        task_type = body.get("task_type")
        job = self._buffer.jobs.get(task_type, {}).get("data", {}) if isinstance(task_type, str) else {}
        if not job:
            return body
        filled = dict(body)
        for name, job_name in _JOB_FIELDS.items():
            if filled.get(name) is None and job.get(job_name) not in (None, ""):
                filled[name] = job[job_name]
        if isinstance(filled.get("token_mode"), str):  # slime sends strings
            filled["token_mode"] = filled["token_mode"].lower() in ("true", "1")
        if filled.get("token_mode") and filled.get("tokenizer_path") is None and job.get("tokenizer_path"):
            filled["tokenizer_path"] = job["tokenizer_path"]
        if filled.get("sampling") is None and (
            pins := pinned(job.get("session_sampling"), "session_sampling")
        ):
            filled["sampling"] = pins
        if isinstance(filled.get("timeout_s"), str):
            try:
                filled["timeout_s"] = float(filled["timeout_s"])
            except ValueError:
                del filled["timeout_s"]
        return filled

    async def aclose(self) -> None:
        await self._client.aclose()


def _handoff(request: Request) -> Handoff:
    handoff: Handoff = request.app.state.handoff
    return handoff


def _answer(response: httpx.Response) -> Response:
    headers = {"Retry-After": response.headers["retry-after"]} if "retry-after" in response.headers else None
    return Response(
        response.content,
        status_code=response.status_code,
        headers=headers,
        media_type=response.headers.get("content-type", "application/json"),
    )


async def open_session(request: Request) -> Response:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise InvalidInput.one("body", f"is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    return _answer(await _handoff(request).open(body))


def _session_path(request: Request, tail: str = "") -> str:
    return f"/sessions/{quote(request.path_params['session_id'], safe='')}{tail}"


async def session_state(request: Request) -> Response:
    return _answer(await _handoff(request).forward(request, _session_path(request)))


async def session_reward(request: Request) -> Response:
    return _answer(await _handoff(request).forward(request, _session_path(request, "/reward")))


async def session_end(request: Request) -> Response:
    return _answer(await _handoff(request).forward(request, _session_path(request, "/end")))


ROUTES = [
    Route("/sessions", open_session, methods=["POST"]),
    Route("/sessions/{session_id}", session_state, methods=["GET"]),
    Route("/sessions/{session_id}/reward", session_reward, methods=["POST"]),
    Route("/sessions/{session_id}/end", session_end, methods=["POST"]),
]
