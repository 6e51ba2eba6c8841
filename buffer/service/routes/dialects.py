"""A session's root in the dialects other than chat completions, recorded as chat completions.

POST /sessions/{id}/v1/messages      Anthropic's Messages API (``x-api-key`` or a bearer key)
POST /sessions/{id}/v1/responses     OpenAI's Responses API (``previous_response_id`` kept in memory)

Each request is translated into the chat-completions body the chat route sends
(``buffer.service.gateway.anthropic``, ``.responses``), goes through the same
``Gateway.complete`` (recorded token-exact), and its answer is translated back, streamed as the
dialect's server-sent events when asked. Errors are in the dialect's own shape. Legacy
``/v1/completions`` is not served: the engine client sends chat completions only.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from buffer.errors import InvalidInput, RolloutBufferError
from buffer.service.gateway import anthropic, responses
from buffer.service.gateway.service import Gateway
from buffer.service.gateway.sessions import Session
from buffer.service.gateway.translation import tool_arguments
from buffer.service.routes.agent_body import read_call_body
from buffer.toolkit.llm import LLMError


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def _response_store(request: Request) -> responses.ResponseStore:
    """The service's stored responses, made on first use (one per app)."""
    state = request.app.state
    store: responses.ResponseStore | None = getattr(state, "gateway_responses", None)
    if store is None:
        store = state.gateway_responses = responses.ResponseStore()
    return store


def _session(request: Request, gateway: Gateway) -> Session:
    """The open session, checked against the key the agent sent: a bearer key, or Anthropic's
    ``x-api-key``."""
    authorization = request.headers.get("authorization")
    if authorization is None and request.headers.get("x-api-key") is not None:
        authorization = "Bearer " + request.headers["x-api-key"]
    return gateway.session(request.path_params["session_id"], authorization, agent=True)


def _recorded_arguments(session: Session, wanted: set[str]) -> dict[str, str]:
    return tool_arguments((call.reply for call in reversed(session.calls)), wanted)


async def messages(request: Request) -> Response:
    """Anthropic's Messages API, recorded as a chat completion: content blocks (text, image,
    thinking, tool_use, tool_result), tools, streaming as Anthropic's events."""
    try:
        gateway = _gateway(request)
        session = _session(request, gateway)
        body = await read_call_body(request)
        chat = anthropic.to_chat(body, _recorded_arguments(session, anthropic.tool_use_ids(body)))
        answer = await gateway.complete(session, chat, headers=request.headers)
    except RolloutBufferError as exc:
        return _error(anthropic.error_body(exc.status_code, exc.message), exc.status_code, exc.headers())
    except LLMError as exc:
        status = exc.status or 502
        return _error(anthropic.error_body(status, exc.engine_message or str(exc)), status)
    message = anthropic.from_chat(answer, body)
    if body.get("stream"):
        return StreamingResponse(anthropic.stream_events(message), media_type="text/event-stream")
    return Response(orjson.dumps(message), media_type="application/json")


async def create_response(request: Request) -> Response:
    """OpenAI's Responses API, recorded as a chat completion: message, reasoning, function_call
    and function_call_output items, function tools, ``previous_response_id``, streaming as the
    Responses events."""
    store = _response_store(request)
    try:
        gateway = _gateway(request)
        session = _session(request, gateway)
        body = await read_call_body(request)
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
        answer = await gateway.complete(session, chat, headers=request.headers)
    except InvalidInput as exc:
        field = exc.errors[0]["field"] if exc.errors else None
        return _error(responses.error_body(exc.status_code, exc.message, field), exc.status_code)
    except RolloutBufferError as exc:
        return _error(responses.error_body(exc.status_code, exc.message), exc.status_code, exc.headers())
    except LLMError as exc:
        status = exc.status or 502
        return _error(responses.error_body(status, exc.engine_message or str(exc)), status)
    response_id = f"resp_{uuid.uuid4().hex}"
    response = responses.from_chat(answer, body, response_id, time.time())
    if body.get("store") is not False:
        store.put(response_id, responses.Stored(session.session_id, conversation, responses.reply_of(answer)))
    if body.get("stream"):
        return StreamingResponse(responses.stream_events(response), media_type="text/event-stream")
    return Response(orjson.dumps(response), media_type="application/json")


def _error(body: Mapping[str, Any], status: int, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, headers=dict(headers or {}), media_type="application/json"
    )


ROUTES = [
    Route("/sessions/{session_id}/v1/messages", messages, methods=["POST"]),
    Route("/sessions/{session_id}/v1/responses", create_response, methods=["POST"]),
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
}
