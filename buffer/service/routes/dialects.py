"""A session's root in the dialects other than chat completions.

POST /sessions/{id}/v1/messages      Anthropic's Messages API (``x-api-key`` or a bearer key)
POST /sessions/{id}/v1/responses     OpenAI's Responses API (``previous_response_id`` kept in memory)
POST /sessions/{id}/v1/completions   OpenAI's legacy completions (a prompt, no messages)

Messages and Responses requests are translated into the chat-completions body the chat route
sends (``buffer.service.gateway.anthropic``, ``.responses``), go through the same
``Gateway.complete`` (recorded token-exact), and their answer is translated back, streamed as
the dialect's server-sent events when asked (``event_stream``: the whole answer is there, so its
events are one body, with no stream machinery). Errors are in the dialect's own shape. A legacy
completion goes to the engine's own ``/v1/completions`` (``Gateway.complete(text=True)``,
``buffer.service.gateway.completions``). A call whose agent disconnects is cancelled
(``unless_disconnected``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from buffer.errors import InvalidInput, RolloutBufferError
from buffer.service.gateway import anthropic, completions, responses
from buffer.service.gateway.service import Gateway
from buffer.service.gateway.sessions import Session
from buffer.service.gateway.translation import tool_arguments
from buffer.service.routes.agent_body import read_call
from buffer.toolkit.llm import LLMError


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


#: The headers a call's route reads: the key, and what ``Gateway.complete`` reads (the call's
#: role, an SDK's retry count).
CALL_HEADERS = {
    name.encode(): name
    for name in ("authorization", "x-api-key", "x-rollout-role", "x-stainless-retry-count")
}


def call_headers(request: Request) -> dict[str, str]:
    """The headers of ``CALL_HEADERS`` the agent sent, read in one pass (the first of each)."""
    found: dict[str, str] = {}
    for name, value in request.scope["headers"]:
        key = CALL_HEADERS.get(name)
        if key is not None and key not in found:
            found[key] = value.decode("latin-1")
    return found


def agent_session(request: Request, gateway: Gateway, headers: dict[str, str]) -> Session:
    """The open session, checked against the key the agent sent: a bearer key, or Anthropic's
    ``x-api-key``."""
    authorization = headers.get("authorization")
    if authorization is None and "x-api-key" in headers:
        authorization = "Bearer " + headers["x-api-key"]
    return gateway.session(request.path_params["session_id"], authorization, agent=True)


def _recorded_arguments(session: Session, wanted: set[str]) -> dict[str, str]:
    return tool_arguments((call.reply for call in reversed(session.calls)), wanted)


async def messages(request: Request) -> Response:
    """Anthropic's Messages API, recorded as a chat completion: content blocks (text, image,
    thinking, tool_use, tool_result), tools, streaming as Anthropic's events."""
    try:
        gateway = _gateway(request)
        headers = call_headers(request)
        session = agent_session(request, gateway, headers)
        raw, body = await read_call(request)
        chat = anthropic.to_chat(body, _recorded_arguments(session, anthropic.tool_use_ids(body)))
        answer = await gateway.complete(session, chat, headers=headers, raw=raw)
    except RolloutBufferError as exc:
        return _error(anthropic.error_body(exc.status_code, exc.message), exc.status_code, exc.headers())
    except LLMError as exc:
        status = exc.status or 502
        return _error(anthropic.error_body(status, exc.engine_message or str(exc)), status)
    message = anthropic.from_chat(answer, body)
    if body.get("stream"):
        return event_stream(anthropic.stream_events(message))
    return Response(orjson.dumps(message), media_type="application/json")


async def create_response(request: Request) -> Response:
    """OpenAI's Responses API, recorded as a chat completion: message, reasoning, function_call
    and function_call_output items, function tools, ``previous_response_id``, streaming as the
    Responses events."""
    gateway = _gateway(request)
    store = gateway.responses
    try:
        headers = call_headers(request)
        session = agent_session(request, gateway, headers)
        raw, body = await read_call(request)
        previous = None
        previous_id = body.get("previous_response_id")
        if previous_id is not None:
            previous = store.get(session.session_id, previous_id) if isinstance(previous_id, str) else None
            if previous is None:
                raise InvalidInput.one(
                    "previous_response_id",
                    f"no stored response {previous_id!r} in this session (not stored, or dropped: "
                    f"the gateway keeps the last {store.limit})",
                )
        chat, conversation = responses.to_chat(body, previous)
        answer = await gateway.complete(session, chat, headers=headers, raw=raw)
    except InvalidInput as exc:
        field = exc.errors[0]["field"] if exc.errors else None
        return _error(responses.error_body(exc.status_code, exc.message, field), exc.status_code)
    except RolloutBufferError as exc:
        return _error(responses.error_body(exc.status_code, exc.message), exc.status_code, exc.headers())
    except LLMError as exc:
        status = exc.status or 502
        return _error(responses.error_body(status, exc.engine_message or str(exc)), status)
    response_id = f"resp_{os.urandom(16).hex()}"  # uuid4's randomness, without building a UUID
    response = responses.from_chat(answer, body, response_id, time.time())
    if body.get("store") is not False:
        store.put(response_id, responses.Stored(session.session_id, conversation, responses.reply_of(answer)))
    if body.get("stream"):
        return event_stream(responses.stream_events(response))
    return Response(orjson.dumps(response), media_type="application/json")


async def create_completion(request: Request) -> Response:
    """OpenAI's legacy completions: one prompt (a string or token ids), forwarded to the engine's
    ``/v1/completions`` with token capture (token mode: as the ids the gateway holds) and recorded;
    ``n``, ``stop``, ``logprobs``, ``stream`` as OpenAI's ``text_completion`` chunks."""
    try:
        gateway = _gateway(request)
        headers = call_headers(request)
        session = agent_session(request, gateway, headers)
        raw, body = await read_call(request)
        call = gateway.complete(session, body, text=True, headers=headers, raw=raw)
        answer = await unless_disconnected(request, call)
    except InvalidInput as exc:
        field = exc.errors[0]["field"] if exc.errors else None
        return _error(responses.error_body(exc.status_code, exc.message, field), exc.status_code)
    except RolloutBufferError as exc:
        return _error(responses.error_body(exc.status_code, exc.message), exc.status_code, exc.headers())
    except LLMError as exc:
        status = exc.status or 502
        return _error(responses.error_body(status, exc.engine_message or str(exc)), status)
    except AgentGone:
        return Response(status_code=499)  # nobody reads it
    answer = completions.for_agent(answer, body)
    if body.get("stream"):
        return event_stream(completions.stream_chunks(answer, body))
    return Response(orjson.dumps(answer), media_type="application/json")


_T = TypeVar("_T")


def event_stream(events: Iterable[bytes]) -> Response:
    """Server-sent events made from a whole answer, as one body: what a client reads of a stream
    is the same, without a streamed response's thread hop per event and its disconnect watcher
    (some 100 us of CPU a call)."""
    return Response(b"".join(events), media_type="text/event-stream", headers=_NO_CACHE)


_NO_CACHE = {"cache-control": "no-cache"}


class AgentGone(Exception):
    """The agent disconnected before its answer came."""


async def unless_disconnected(request: Request, answer: Awaitable[_T]) -> _T:
    """``answer``, awaited here, or ``AgentGone`` once the agent disconnects: the request's task
    is then cancelled, and with it the wait for the call (the gateway cancels the call at the
    engine unless an SDK's retry comes for it). One watcher task a call, no other."""
    task = asyncio.current_task()
    assert task is not None
    waiting = True
    left = False

    def leave(watcher: asyncio.Task[None]) -> None:
        nonlocal left
        # ``waiting``: a callback scheduled as the answer came must not cancel what follows it
        if waiting and not watcher.cancelled() and watcher.exception() is None:
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(leave)
    try:
        return await answer
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
        raise AgentGone from None
    finally:
        waiting = False
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(body: Mapping[str, Any], status: int, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, headers=dict(headers or {}), media_type="application/json"
    )


ROUTES = [
    Route("/sessions/{session_id}/v1/messages", messages, methods=["POST"]),
    Route("/sessions/{session_id}/v1/responses", create_response, methods=["POST"]),
    Route("/sessions/{session_id}/v1/completions", create_completion, methods=["POST"]),
]


def _operation(summary: str, description: str | None, operation_id: str, answer: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "description": description,
            "operationId": operation_id,
            "tags": ["gateway"],
            "parameters": [
                {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            "responses": {
                "200": {"description": answer},
                "404": {"description": "no open session"},
                "422": {"description": "a field that cannot be translated, named"},
                "503": {"description": "generation is paused; retry after Retry-After"},
            },
        }
    }


OPENAPI_PATHS: dict[str, Any] = {
    "/sessions/{session_id}/v1/messages": _operation(
        "Anthropic Messages",
        messages.__doc__,
        "messages_sessions__session_id__v1_messages_post",
        "an Anthropic message (a stream of Anthropic's events with stream: true)",
    ),
    "/sessions/{session_id}/v1/responses": _operation(
        "OpenAI Responses",
        create_response.__doc__,
        "responses_sessions__session_id__v1_responses_post",
        "a response object (a stream of Responses events with stream: true)",
    ),
    "/sessions/{session_id}/v1/completions": _operation(
        "Completions (legacy)",
        create_completion.__doc__,
        "completions_sessions__session_id__v1_completions_post",
        "a text_completion (a stream of text_completion chunks with stream: true)",
    ),
}
