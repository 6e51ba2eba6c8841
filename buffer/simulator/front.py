"""The generation routes' fast path: the FastAPI app with a thin ASGI front for them.

At thousands of requests in flight, a benchmark measures the simulator's CPU time per request,
and about half of it went to FastAPI's plumbing (its middleware stack, dependency solving, body
reading, validation through a ``TypeAdapter``), not to the simulation. ``SimApp`` answers
``POST /v1/chat/completions``, ``/v1/completions`` and ``/generate`` itself when the request is
one the routes would accept: a JSON content type and a body its model validates
(``model_validate_json``, one pass). Everything else, an invalid body included, goes to the
FastAPI app with the body replayed, so every error is the one the routes' validation handler
writes, in either engine's shape, and every other route is FastAPI's as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class FastRoute(Generic[_M]):
    """A generation route as the front serves it: the body's model, and what answers it."""

    model: type[_M]
    handle: Callable[[_M], Awaitable[Response]]


class SimApp(FastAPI):
    """The simulator's FastAPI app, with ``fast_routes`` answered before its middleware."""

    fast_routes: dict[str, FastRoute[Any]]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.fast_routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST" or not _json_content(scope):
            await super().__call__(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client went away before sending its body
        try:
            request = route.model.model_validate_json(body)
        except ValidationError:
            await super().__call__(scope, _replay(body, receive), send)
            return
        response = await route.handle(request)
        await response(scope, receive, send)


def _json_content(scope: Scope) -> bool:
    """A content type FastAPI reads as JSON: ``application/json`` or ``application/*+json``."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind: bytes = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (kind.startswith(b"application/") and kind[-5:] == b"+json")
    return False


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given back first."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
