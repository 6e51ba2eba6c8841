"""The gateway's routes: sessions, and the OpenAI-compatible root each one gives an agent.

POST /sessions                                  open: {"session_id", "base_url", "api_key"}
GET  /sessions/{id}                             its state: calls, tree, reward
POST /sessions/{id}/v1/chat/completions         proxied to the engine and recorded
POST /sessions/{id}/v1/messages                 Anthropic's Messages API, recorded alike (``dialects``)
POST /sessions/{id}/v1/responses                OpenAI's Responses API, recorded alike (``dialects``)
POST /sessions/{id}/v1/completions              OpenAI's legacy completions, recorded (``dialects``)
GET  /sessions/{id}/v1/models                   the engine's models
POST /sessions/{id}/reward                      {"reward": number | {name: number}}
POST /sessions/{id}/end                         write the trajectory (or {"discard": true}); retried
                                                once ended: what the first end did
GET  /images/{sha256}                           an image a trajectory keeps by reference

In the service these are FastAPI's routes (its OpenAPI schema documents them), but the calls,
which are plain Starlette endpoints first in the table. A gateway process, which serves no
schema, takes them all as plain routes (``PLAIN_ROUTES``): the same endpoints, the bodies
validated by the same models, without FastAPI's dependency solving (some 250 us of CPU a
request, where an open costs the gateway 300).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Header, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response
from starlette.routing import Route

from buffer import encoding
from buffer.errors import InvalidInput, NotFound
from buffer.service.gateway.images import media_type
from buffer.service.gateway.proxy import for_agent, stream_chunks
from buffer.service.gateway.sampling import PinnedSampling
from buffer.service.gateway.service import Gateway, SessionUnusable
from buffer.service.gateway.sessions import MAX_METADATA_BYTES, MAX_SESSION_TIMEOUT_S, Ended
from buffer.service.models import FiniteNumber, InstanceId, Int64, check_storable, invalid_input
from buffer.service.responses import envelope
from buffer.service.routes import dialects
from buffer.service.routes.agent_body import read_call
from buffer.service.routes.dialects import AgentGone, call_headers, event_stream, unless_disconnected
from buffer.toolkit.llm import LLMError

router = APIRouter(tags=["gateway"])


class OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_type: Annotated[str, Field(min_length=1)]
    instance_id: InstanceId
    remote_engine_url: str | list[str] | None = None
    metadata: dict[str, Any] = Field(
        default_factory=dict, description=f"kept with the session: at most {MAX_METADATA_BYTES} bytes of JSON"
    )
    timeout_s: Annotated[float, Field(gt=0, le=MAX_SESSION_TIMEOUT_S, allow_inf_nan=False)] | None = None
    on_timeout: Literal["write", "discard"] | None = None
    sampling: PinnedSampling | None = Field(
        None, description="sent on every call whatever the agent sends (default: the task's session_sampling)"
    )
    token_mode: bool | None = Field(
        None, description="token in, token out with tokenizer_path (default: the task's session_token_mode)"
    )
    tokenizer_path: Annotated[str, Field(min_length=1)] | None = None


class RewardBody(BaseModel):
    reward: FiniteNumber | dict[str, FiniteNumber]


class EndBody(BaseModel):
    reward: FiniteNumber | dict[str, FiniteNumber] | None = None
    discard: bool = False
    #: The call whose path makes the trajectory (default: the last call recorded).
    call: Int64 | None = None


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


@router.post("/sessions")
async def open_session(body: OpenSession, request: Request) -> Response:
    # Refused here, before the session's state holds any of it: a value the journal cannot
    # keep, or metadata that would make every open session cost megabytes.
    check_storable(body)
    size = len(encoding.dumps(body.metadata))
    if size > MAX_METADATA_BYTES:
        raise InvalidInput.one("metadata", f"is {size} bytes of JSON; at most {MAX_METADATA_BYTES} are kept")
    gateway = _gateway(request)
    session = await gateway.open(
        body.task_type,
        body.instance_id,
        body.remote_engine_url,
        body.metadata,
        body.timeout_s,
        body.on_timeout,
        sampling=None if body.sampling is None else body.sampling.model_dump(exclude_none=True),
        token_mode=body.token_mode,
        tokenizer_path=body.tokenizer_path,
    )
    root = str(request.base_url).rstrip("/")
    return envelope(
        True,
        "session opened",
        {
            "session_id": session.session_id,
            "base_url": f"{root}/sessions/{session.session_id}/v1",
            "api_key": session.api_key,
        },
    )


@router.get("/gateway/sessions")
async def list_sessions(request: Request) -> Response:
    """The open sessions (task, instance, calls, age) and how many were written or discarded."""
    store = _gateway(request).store
    now = time.time()
    sessions = [
        {
            "session_id": s.session_id,
            "task_type": s.task_type,
            "instance_id": s.instance_id,
            "calls": len(s.calls),
            "idle_s": round(now - s.last_at, 3),
        }
        for s in list(store.sessions.values())
    ]
    return envelope(True, f"{len(sessions)} open", {"open": sessions, "closed": dict(store.closed)})


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    session = _gateway(request).session(session_id)
    return envelope(
        True,
        "open",
        {
            "session_id": session.session_id,
            "task_type": session.task_type,
            "instance_id": session.instance_id,
            "calls": len(session.calls),
            "parents": [call.parent for call in session.calls],
            "reward": session.reward,
        },
    )


async def chat_completions(request: Request) -> Response:
    """An OpenAI chat completion, forwarded to the session's engine and recorded (a plain
    Starlette endpoint, first in the route table: FastAPI's matching and dependency solving
    cost a quarter of a millisecond a call)."""
    gateway = _gateway(request)
    headers = call_headers(request)
    session = gateway.session(request.path_params["session_id"], headers.get("authorization"), agent=True)
    raw, body = await read_call(request)
    try:
        answer = await unless_disconnected(request, gateway.complete(session, body, headers=headers, raw=raw))
    except LLMError as exc:
        return _engine_error(exc)
    except AgentGone:
        return Response(status_code=499)  # nobody reads it
    answer = for_agent(answer, body)
    if body.get("stream"):
        return event_stream(stream_chunks(answer, body))
    return Response(orjson.dumps(answer), media_type="application/json")


ROUTES = [
    Route("/sessions/{session_id}/v1/chat/completions", chat_completions, methods=["POST"]),
    *dialects.ROUTES,  # Anthropic Messages, OpenAI Responses (as chat completions), legacy completions
]

_SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
_OBJECT = {"type": "object"}
OPENAPI_PATHS: dict[str, Any] = {
    "/sessions/{session_id}/v1/chat/completions": {
        "post": {
            "summary": "Chat Completions",
            "description": chat_completions.__doc__,
            "operationId": "chat_completions_sessions__session_id__v1_chat_completions_post",
            "tags": ["gateway"],
            "parameters": [
                {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            "responses": {
                "200": {"description": "the engine's answer (a stream of chunks with stream: true)"},
                "404": {"description": "no open session"},
                "503": {"description": "generation is paused; retry after Retry-After"},
            },
        }
    },
    **dialects.OPENAPI_PATHS,
}


@router.get("/sessions/{session_id}/v1/models")
async def models(
    session_id: str, request: Request, authorization: Annotated[str | None, Header()] = None
) -> Response:
    gateway = _gateway(request)
    session = gateway.session(session_id, authorization, agent=True)
    status, content = await gateway.proxy.models(session.engine_urls)
    return Response(content, status_code=status, media_type="application/json")


@router.post("/sessions/{session_id}/reward")
async def reward(session_id: str, body: RewardBody, request: Request) -> Response:
    check_storable(body)
    gateway = _gateway(request)
    await gateway.reward(gateway.session(session_id), body.reward)
    return envelope(True, "reward recorded")


@router.post("/sessions/{session_id}/end")
async def end(session_id: str, request: Request, body: EndBody | None = None) -> Response:
    gateway = _gateway(request)
    body = body or EndBody()
    check_storable(body)
    ended = gateway.ended(session_id)
    if ended is not None:
        return _ended_before(session_id, ended, body)
    result = await gateway.end(
        gateway.session(session_id), reward=body.reward, discard=body.discard, call=body.call
    )
    if result is None:
        return envelope(True, "session discarded", {"written": False})
    ended = gateway.ended(session_id)
    return envelope(
        True,
        "session written",
        {
            "written": True,
            "uid": result.uid,
            "uids": list(ended.uids) if ended is not None and ended.uids else [result.uid],
            "task_type": result.task_type,
            "duplicate": result.duplicate,
        },
    )


def _ended_before(session_id: str, ended: Ended, body: EndBody) -> Response:
    """An end of a session already ended (a retry whose first answer was lost, or sent before
    a restart): what that end did. A written one is not written again (its uid is the same);
    one discarded cannot be written now."""
    if ended.how == "written":
        return envelope(
            True,
            "session already ended: written",
            {
                "written": True,
                "uid": ended.uid,
                "uids": list(ended.uids) or [ended.uid],
                "task_type": ended.task_type,
                "duplicate": True,
            },
        )
    if body.discard:
        return envelope(True, "session already ended: discarded", {"written": False})
    raise SessionUnusable(
        f"session {session_id!r} already ended and was discarded (ended with discard, or timed out): "
        "nothing can be written now"
    )


@router.get("/images/{digest}")
async def image(digest: str, request: Request) -> Response:
    directory = _gateway(request).images.directory
    if directory is None or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise NotFound(f"no image {digest!r}")
    path = directory / digest
    try:
        data = await asyncio.to_thread(path.read_bytes)
    except FileNotFoundError:
        raise NotFound(f"no image {digest!r}") from None
    return Response(data, media_type=media_type(data))


_Endpoint = Callable[..., Awaitable[Response]]


def plain(endpoint: _Endpoint, body: type[BaseModel] | None = None, *, optional: bool = False) -> _Endpoint:
    """``endpoint`` (a FastAPI route's function) as a plain Starlette endpoint: its path
    parameters, the ``authorization`` header where it takes one, and its ``body`` validated by
    the model (``optional``: an empty body is None), a wrong one refused as FastAPI refuses it
    (422, each field named)."""
    takes = set(inspect.signature(endpoint).parameters)

    async def handle(request: Request) -> Response:
        arguments: dict[str, Any] = {**request.path_params, "request": request}
        if "authorization" in takes:
            arguments["authorization"] = request.headers.get("authorization")
        if body is not None:
            arguments["body"] = await _validated(request, body, optional)
        return await endpoint(**arguments)

    handle.__name__ = handle.__qualname__ = endpoint.__name__
    handle.__doc__ = endpoint.__doc__
    return handle


async def _validated(request: Request, model: type[BaseModel], optional: bool) -> BaseModel | None:
    raw = await request.body()
    if not raw.strip():
        if optional:
            return None
        raise InvalidInput.one("body", "a JSON object is required")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput.one("body", f"is not JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_input(exc.errors()) from None


#: The routes of this module as plain Starlette routes, the calls first (a gateway process's).
PLAIN_ROUTES = [
    *ROUTES,
    Route("/sessions", plain(open_session, OpenSession), methods=["POST"]),
    Route("/gateway/sessions", plain(list_sessions), methods=["GET"]),
    Route("/sessions/{session_id}", plain(get_session), methods=["GET"]),
    Route("/sessions/{session_id}/v1/models", plain(models), methods=["GET"]),
    Route("/sessions/{session_id}/reward", plain(reward, RewardBody), methods=["POST"]),
    Route("/sessions/{session_id}/end", plain(end, EndBody, optional=True), methods=["POST"]),
    Route("/images/{digest}", plain(image), methods=["GET"]),
]


def _engine_error(exc: LLMError) -> Response:
    """The engine's refusal as OpenAI's error shape, with its status (502: no usable answer)."""
    status = exc.status or 502
    message = exc.engine_message or str(exc)
    body = {"error": {"message": message, "type": "engine_error", "param": None, "code": status}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
