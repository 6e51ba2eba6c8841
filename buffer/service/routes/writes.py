"""The hot path: ``/buffer/write`` and ``/buffer/write_batch``.

Each endpoint takes the request and its body. ``HOT_ROUTES`` are answered ahead of FastAPI's
layers and routing (``buffer.service.app.ServiceApp``): FastAPI's per-request machinery costs
more than the write itself. ``ROUTES`` are the same endpoints as plain Starlette routes first in
the route table, for when FastAPI's telemetry is on. The body is parsed once and checked, its
token lists kept as the client's bytes (``buffer.service.token_bytes``); ``OPENAPI_PATHS``
documents them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from buffer.errors import InvalidInput
from buffer.service.responses import envelope
from buffer.service.services import Services
from buffer.service.token_bytes import read_trajectories, read_trajectory


async def write(request: Request, body: bytes) -> Response:
    """Buffer one trajectory. A retried write (same ``uid``) is accepted and counted once."""
    svc: Services = request.app.state.services
    trajectory = read_trajectory(body)
    result = svc.buffer.write(trajectory)
    await svc.buffer.wait_durable()
    message = (
        "Duplicate uid: already buffered"
        if result.duplicate
        else "Data has been successfully written to buffer"
    )
    return envelope(
        True, message, {"uid": result.uid, "task_type": result.task_type, "duplicate": result.duplicate}
    )


async def write_batch(request: Request, body: bytes) -> Response:
    """Buffer many trajectories at once, all or none: one invalid item refuses the batch."""
    svc: Services = request.app.state.services
    first = body.lstrip()[:1]
    if first in (b"{", b"["):
        items = read_trajectories(body, batch=first == b"{")
    else:
        raise InvalidInput.one("body", 'must be a list of trajectories or {"trajectories": [...]}')
    results = svc.buffer.write_many(items)
    await svc.buffer.wait_durable()
    duplicates = sum(result.duplicate for result in results)
    written = len(results) - duplicates
    return envelope(
        True,
        f"Wrote {written} trajectories ({duplicates} duplicates)",
        {"uids": [result.uid for result in results], "written": written, "duplicates": duplicates},
    )


Endpoint = Callable[[Request, bytes], Awaitable[Response]]


def _route(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` as a Starlette endpoint: the body read, then the endpoint."""

    async def route(request: Request) -> Response:
        return await endpoint(request, await request.body())

    return route


HOT_ROUTES: dict[str, Endpoint] = {"/buffer/write": write, "/buffer/write_batch": write_batch}
ROUTES = [
    Route(path, _route(endpoint), methods=["POST"], name=endpoint.__name__)
    for path, endpoint in HOT_ROUTES.items()
]

_TRAJECTORY = {"$ref": "#/components/schemas/Trajectory"}
_ANSWER = {
    "200": {"description": "written (or a duplicate, accepted); with --data-dir, on disk"},
    "413": {"description": "larger than --max-request-bytes, or a batch larger than the buffer's limit"},
    "415": {"description": "not sent as Content-Type: application/json"},
    "422": {"description": "invalid"},
    "429": {"description": "the buffer is full (--max-buffered-trajectories); retry after Retry-After"},
    "503": {"description": "the data folder cannot be written"},
}

OPENAPI_PATHS: dict[str, Any] = {
    "/buffer/write": {
        "post": {
            "summary": "Write",
            "description": write.__doc__,
            "operationId": "write_buffer_write_post",
            "requestBody": {"required": True, "content": {"application/json": {"schema": _TRAJECTORY}}},
            "responses": _ANSWER,
        }
    },
    "/buffer/write_batch": {
        "post": {
            "summary": "Write Batch",
            "description": write_batch.__doc__,
            "operationId": "write_batch_buffer_write_batch_post",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "oneOf": [
                                {"type": "array", "items": _TRAJECTORY},
                                {
                                    "type": "object",
                                    "required": ["trajectories"],
                                    "properties": {"trajectories": {"type": "array", "items": _TRAJECTORY}},
                                },
                            ]
                        }
                    }
                },
            },
            "responses": _ANSWER,
        }
    },
}
