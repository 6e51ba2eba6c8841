"""slime's older buffer routes: read, peek, stats; and the groups set aside."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Query
from starlette.requests import Request
from starlette.responses import Response

from buffer import encoding
from buffer.core.registry import where_in
from buffer.service.models import ReadRequest, check_storable
from buffer.service.responses import envelope, items_response
from buffer.service.services import Services, services

router = APIRouter()


@router.post("/buffer/read")
async def read(
    request: Request, svc: Annotated[Services, Depends(services)], body: Annotated[ReadRequest, Body()]
) -> Response:
    """slime's older read: with ``wait``, wait up to ``timeout`` s for ``batch_size`` items."""
    check_storable(body)
    svc.check_task(body.task_type)
    limit = None if body.batch_size == -1 else body.batch_size
    if (
        body.wait
        and body.timeout
        and not await svc.wait_for_items(request, body.task_type, limit or 1, body.timeout)
    ):
        return Response(status_code=499)  # the client has gone: read nothing it would lose
    result = svc.buffer.read(body.task_type, limit)
    await svc.buffer.wait_durable()
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
        "max_size": svc.buffer.max_buffered or -1,  # -1: unbounded
        "total_written": summary["total_written"],
        "total_read": summary["total_read"],
        "pending_items": summary["pending_items"],
        "duplicates": summary["duplicates"],
    }
    meta = {"current_task": summary["current_task"], "tasks": summary["tasks"]}
    return envelope(True, "Buffer statistics", {"data": [counters], "meta_info": meta})


@router.get("/buffer/set_aside")
async def set_aside(svc: Annotated[Services, Depends(services)], task_type: str | None = None) -> Response:
    """Groups a hook failed on, newest last, with the hook, the error, where it happened and the items."""
    files = {name: generator.path for name, generator in svc.registry.generators.items()}
    groups = [
        {
            "task_type": group.task_type,
            "instance_id": group.instance_id,
            "hook": group.hook,
            "error": group.error,
            "where": where_in(group.traceback, files.get(group.task_type)),
            "at": group.at,
            "items": [encoding.loads(item) for item in group.items],
        }
        for group in svc.buffer.set_aside(task_type)
    ]
    return envelope(True, f"{len(groups)} groups set aside", {"groups": groups})
