"""``GET /buffer/export``: the trajectories reads delivered, as JSON lines (``--data-dir`` only)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response, StreamingResponse

from buffer.errors import NeedsDataDir
from buffer.service.services import Services, services
from buffer.store import export as export_log

router = APIRouter()


class NDJSONResponse(StreamingResponse):
    media_type = "application/x-ndjson"


@router.get("/buffer/export", response_class=NDJSONResponse)
async def export(
    svc: Annotated[Services, Depends(services)],
    since: Annotated[
        datetime | None, Query(description="delivered at or after: ISO 8601 or Unix seconds")
    ] = None,
    until: Annotated[datetime | None, Query(description="delivered before: ISO 8601 or Unix seconds")] = None,
    task_type: Annotated[str | None, Query(description="only this task's trajectories")] = None,
) -> Response:
    """Stream every trajectory delivered in ``[since, until)``, one JSON object a line:
    ``{"delivered_at", "read_id", "task_type", "instance_id", "trajectory"}``, oldest first,
    as far back as ``--export-retention-hours``."""
    store = svc.buffer.journal
    if store is None:
        raise NeedsDataDir("export")
    lines = export_log.read(
        store,
        since.timestamp() if since else None,
        until.timestamp() if until else None,
        task_type,
    )
    return NDJSONResponse(lines)  # a sync iterator: Starlette iterates it in a thread
