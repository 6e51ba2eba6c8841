"""Writing trajectories, and slime's older buffer routes: read, peek, stats."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Depends, Query
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from buffer.errors import InvalidInput
from buffer.models import ReadRequest, Trajectory, invalid_input
from buffer.responses import envelope, items_response
from buffer.services import Services, services

router = APIRouter()

_TRAJECTORY_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Trajectory"}}},
    }
}
_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {"type": "array", "items": {"$ref": "#/components/schemas/Trajectory"}},
                        {
                            "type": "object",
                            "required": ["trajectories"],
                            "properties": {
                                "trajectories": {
                                    "type": "array",
                                    "items": {"$ref": "#/components/schemas/Trajectory"},
                                }
                            },
                        },
                    ]
                }
            }
        },
    }
}


async def _json(request: Request) -> Any:
    body = await request.body()
    if not body.strip():
        raise InvalidInput.one("body", "is empty; expected JSON")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput.one("body", f"is not valid JSON: {exc}") from None


def _validated(obj: Any, prefix: str = "") -> dict[str, Any]:
    """The trajectory dict as written (extra keys kept), once it passes validation."""
    if not isinstance(obj, dict):
        raise InvalidInput.one(
            prefix.rstrip(".") or "body", f"must be a JSON object, not {type(obj).__name__}"
        )
    try:
        Trajectory.model_validate(obj)
    except ValidationError as exc:
        raise invalid_input(exc.errors(include_url=False, include_input=False), prefix) from None
    return obj


# The hot path: parsed and validated by hand, so nothing is decoded twice.
@router.post("/buffer/write", openapi_extra=_TRAJECTORY_BODY)
async def write(request: Request) -> Response:
    """Buffer one trajectory. A retried write (same ``uid``) is accepted and counted once."""
    svc: Services = request.app.state.services
    result = svc.buffer.write(_validated(await _json(request)))
    return envelope(
        True,
        "Duplicate uid: already buffered"
        if result.duplicate
        else "Data has been successfully written to buffer",
        {"uid": result.uid, "task_type": result.task_type, "duplicate": result.duplicate},
    )


@router.post("/buffer/write_batch", openapi_extra=_BATCH_BODY)
async def write_batch(request: Request) -> Response:
    """Buffer many trajectories at once, all or none: one invalid item refuses the batch."""
    svc: Services = request.app.state.services
    body = await _json(request)
    if isinstance(body, dict) and "trajectories" in body:
        body = body["trajectories"]
    if not isinstance(body, list):
        raise InvalidInput.one("body", 'must be a list of trajectories or {"trajectories": [...]}')
    results = svc.buffer.write_many([_validated(item, f"{index}.") for index, item in enumerate(body)])
    duplicates = sum(result.duplicate for result in results)
    return envelope(
        True,
        f"Wrote {len(results) - duplicates} trajectories ({duplicates} duplicates)",
        {
            "uids": [result.uid for result in results],
            "written": len(results) - duplicates,
            "duplicates": duplicates,
        },
    )


@router.post("/buffer/read")
async def read(svc: Annotated[Services, Depends(services)], body: Annotated[ReadRequest, Body()]) -> Response:
    """slime's older read: with ``wait``, wait up to ``timeout`` s for ``batch_size`` items."""
    svc.check_task(body.task_type)
    limit = None if body.batch_size == -1 else body.batch_size
    if body.wait and body.timeout:
        await svc.ready.wait_until(
            lambda: svc.buffer.ready_items(body.task_type) >= (limit or 1), body.timeout
        )
    result = svc.buffer.read(body.task_type, limit)
    items = [item for group in result.groups for item in group.items]
    if not items:
        return items_response(False, "No data available to read", (), result.meta_info)
    return items_response(True, f"Successfully read {len(items)} items", items, result.meta_info)


@router.get("/buffer/peek")
async def peek(
    svc: Annotated[Services, Depends(services)],
    batch_size: Annotated[int, Query(ge=-1)] = -1,
    task_type: str | None = None,
) -> Response:
    """The groups a read would return, left in the buffer."""
    svc.check_task(task_type)
    groups = svc.buffer.peek(task_type, None if batch_size in (-1, 0) else batch_size)
    items = [item for group in groups for item in group.items]
    message = f"{len(items)} items ready" if items else "No data available to read"
    return items_response(bool(items), message, items, {"num_groups": len(groups)})


@router.get("/buffer/stats")
async def stats(svc: Annotated[Services, Depends(services)]) -> Response:
    """slime's four counters, and per task: groups pending, ready, delivered and discarded."""
    summary = svc.buffer.stats()
    counters = {
        "current_size": summary["current_size"],
        "max_size": -1,  # unbounded
        "total_written": summary["total_written"],
        "total_read": summary["total_read"],
        "pending_items": summary["pending_items"],
        "duplicates": summary["duplicates"],
    }
    meta = {"current_task": summary["current_task"], "tasks": summary["tasks"]}
    return envelope(True, "Buffer statistics", {"data": [counters], "meta_info": meta})


@router.get("/buffer/set_aside")
async def set_aside(svc: Annotated[Services, Depends(services)], task_type: str | None = None) -> Response:
    """Groups a hook failed on, newest last, with the hook, the error and the items."""
    groups = [
        {
            "task_type": group.task_type,
            "instance_id": group.instance_id,
            "hook": group.hook,
            "error": group.error,
            "traceback": group.traceback,
            "at": group.at,
            "items": [orjson.loads(item) for item in group.items],
        }
        for group in svc.buffer.set_aside(task_type)
    ]
    return envelope(True, f"{len(groups)} groups set aside", {"groups": groups})
