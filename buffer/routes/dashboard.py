"""Routes: the dashboard, a page served by the service itself, and the JSON it polls.

``GET /dashboard`` is plain HTML, CSS and JavaScript from ``buffer/static`` (no build step, no
external resources); the page polls ``GET /dashboard/data`` once a second and draws on canvases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, Response

import buffer
from buffer.responses import json_response
from buffer.services import Services, services

router = APIRouter(prefix="/dashboard", tags=["dashboard"])

STATIC = Path(buffer.__file__).parent / "static"
ASSETS = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
_NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("", include_in_schema=False)
async def page() -> Response:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers=_NO_CACHE)


@router.get("/data")
async def data(svc: Annotated[Services, Depends(services)]) -> Response:
    """The history of the counters, the buffer's statistics now, the jobs and the generators."""
    body: dict[str, Any] = {
        "history": svc.history.snapshot(),
        "stats": svc.buffer.stats(),
        "policy": svc.buffer.policy.snapshot(),
        "jobs": [svc.jobs.describe(job) for job in svc.jobs.list()],
        "generators": [generator.describe() for generator in svc.registry.generators.values()],
        "generator_errors": [error.describe() for error in svc.registry.errors],
    }
    return json_response(body)


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:  # only the files listed: no path ever reaches the file system
        raise HTTPException(404, f"no dashboard asset {name!r}")
    return FileResponse(STATIC / name, media_type=media_type, headers=_NO_CACHE)
