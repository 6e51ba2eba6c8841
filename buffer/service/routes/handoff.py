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

The requests go over the toolkit's HTTP/1.1 transport (``buffer.toolkit.http11``): on httpx,
handing a session's open, reward and end on cost this service some 1.6 ms of CPU each, more than
a session's calls cost the gateway process that serves them (``bench/gateway.py``). A session's
state (``GET``, rare) is read with httpx.

A session this service's own gateway knows (opened here before ``--gateway-url`` was given, and
restored from the data folder; or ended here and remembered) is not forwarded: its state, reward
and end are this service's own routes' (``_Forwarded``), as its agent's calls are.
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
from starlette.routing import Match, Route
from starlette.types import Scope

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.errors import InvalidInput, RolloutBufferError
from buffer.service.gateway.sampling import pinned
from buffer.toolkit.http11 import Http11Transport
from buffer.toolkit.transport import Reply, Transport, Unreachable

logger = logging.getLogger(__name__)

OWNERS_KEPT = 100_000
#: How long a gateway process's answer may take (an end waits for the buffer, which it writes to).
TIMEOUT_S = 120.0
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
    """The gateway processes at ``urls``, asked with this service's ``api_key``; ``transport``
    (tests: ``HttpxTransport`` on a mock) replaces the HTTP/1.1 one."""

    def __init__(
        self,
        urls: list[str],
        buffer: RolloutBuffer,
        api_key: str | None = None,
        *,
        transport: Transport | None = None,
    ) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self._buffer = buffer
        self._turn = itertools.count()
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._transport = transport or Http11Transport(timeout_s=TIMEOUT_S)
        self._client: httpx.AsyncClient | None = None  # for the rare GET of a session's state

    async def open(self, body: dict[str, Any]) -> Reply:
        """Open the session at the next process that answers; its answer."""
        content = orjson.dumps(self._with_job(body))
        first = next(self._turn)
        for step in range(len(self.urls)):
            url = self.urls[(first + step) % len(self.urls)]
            try:
                reply = await self._transport.post(f"{url}/sessions", content, self._headers)
            except Unreachable as exc:
                logger.warning("gateway process %s cannot be reached (%r): trying the next", url, exc)
                continue
            if reply.status == 200:
                self._remember(orjson.loads(reply.body)["data"]["session_id"], url)
            return reply
        raise NoGatewayProcess(f"no gateway process answers ({', '.join(self.urls)}); retry")

    async def forward(self, request: Request, path: str) -> Reply:
        """``request`` sent on to the process that owns its session."""
        session_id = request.path_params["session_id"]
        content = await request.body()
        owner = self._owners.get(session_id)
        unreachable = []
        for url in [owner] if owner is not None else self.urls:
            try:
                reply = await self._send(request.method, f"{url}{path}", content)
            except Unreachable:
                unreachable.append(url)
                continue
            if reply.status == 404 and owner is None:
                continue  # not this one's
            self._remember(session_id, url)
            return reply
        if unreachable:
            raise NoGatewayProcess(
                f"the gateway process of session {session_id!r} may be {', '.join(unreachable)}, which "
                "cannot be reached now; retry"
            )
        return reply

    async def _send(self, method: str, url: str, content: bytes) -> Reply:
        if method == "POST":
            return await self._transport.post(url, content or b"{}", self._headers)
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self._headers, timeout=TIMEOUT_S, trust_env=False)
        try:
            response = await self._client.request(method, url)
        except httpx.TransportError as exc:
            raise Unreachable(type(exc).__name__, str(exc), connect=False) from exc
        return Reply(response.status_code, response.content, response.headers.get("retry-after"))

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
        await self._transport.aclose()
        if self._client is not None:
            await self._client.aclose()


def _handoff(request: Request) -> Handoff:
    handoff: Handoff = request.app.state.handoff
    return handoff


def _answer(reply: Reply) -> Response:
    """A gateway process's answer (an envelope: JSON), passed on."""
    headers = {"Retry-After": reply.retry_after} if reply.retry_after is not None else None
    return Response(reply.body, status_code=reply.status, headers=headers, media_type="application/json")


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


class _Forwarded(Route):
    """A route of a session that a gateway process owns: it matches no session this service's own
    gateway knows (open here, or ended here and remembered), whose request goes on to the
    service's own route for it."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.NONE:
            return match, child
        gateway = getattr(scope["app"].state, "gateway", None)
        session_id = child["path_params"]["session_id"]
        if gateway is not None and (
            gateway.store.get(session_id) is not None or session_id in gateway.store.ended
        ):
            return Match.NONE, {}
        return match, child


ROUTES = [
    Route("/sessions", open_session, methods=["POST"]),
    _Forwarded("/sessions/{session_id}", session_state, methods=["GET"]),
    _Forwarded("/sessions/{session_id}/reward", session_reward, methods=["POST"]),
    _Forwarded("/sessions/{session_id}/end", session_end, methods=["POST"]),
]
