"""Routes: the dashboard, a page served by the service itself, and the JSON it polls.

``GET /dashboard`` is plain HTML, CSS and JavaScript from ``buffer/service/static`` with uPlot vendored
beside them (no build step, no external resources, relative URLs so a proxy may serve it under a
prefix). The page polls ``GET /dashboard/data?since=T`` once a second: the history samples newer
than the last one it holds, not the whole history again. The trajectory viewer reads
``/dashboard/groups`` (the groups a read would return, newest first) and ``/dashboard/group``
(one group's trajectories, token records included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Query
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, Response

from buffer.service.responses import json_response
from buffer.service.services import Services, services

router = APIRouter(prefix="/dashboard", tags=["dashboard"])

STATIC = Path(__file__).resolve().parent.parent / "static"
ASSETS = {
    "dashboard.css": "text/css",
    "dashboard.js": "text/javascript",
    "vendor/uplot/uPlot.iife.min.js": "text/javascript",
    "vendor/uplot/uPlot.min.css": "text/css",
    "vendor/swagger-ui/swagger-ui-bundle.js": "text/javascript",
    "vendor/swagger-ui/swagger-ui.css": "text/css",
}
_NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("", include_in_schema=False)
async def page() -> Response:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers=_NO_CACHE)


#: The viewer lists at most this many groups of a task.
MAX_GROUPS = 200


@router.get("/data")
async def data(
    svc: Annotated[Services, Depends(services)], since: Annotated[float | None, Query()] = None
) -> Response:
    """The history of the counters (only the samples after ``since``, a sample's ``t``, when
    given), the buffer's statistics now, the jobs and the generators."""
    history = svc.history.snapshot()
    if since is not None:
        history = [sample for sample in history if sample["t"] > since]
    body: dict[str, Any] = {
        "history": history,
        "stats": svc.buffer.stats(),
        "policy": svc.buffer.policy.snapshot(),
        "jobs": [svc.jobs.describe(job) for job in svc.jobs.list()],
        "generators": [generator.describe() for generator in svc.registry.generators.values()],
        "generator_errors": [error.describe() for error in svc.registry.errors],
    }
    return json_response(body)


@router.get("/groups")
async def groups(svc: Annotated[Services, Depends(services)], task_type: str) -> Response:
    """The task's groups a read would return (newest first): instance id, size, the rewards the
    trainer gets (after the task's post-processing, e.g. normalized) and the rewards written."""
    svc.check_task(task_type)
    ready = svc.buffer.peek(task_type, None)[-MAX_GROUPS:]
    listed = []
    for group in reversed(ready):
        trajectories = [orjson.loads(item) for item in group.items]
        listed.append(
            {
                "instance_id": group.instance_id,
                "seq": group.seq,
                "size": len(group.items),
                "rewards": [trajectory.get("reward") for trajectory in trajectories],  # as trained on
                "raw_rewards": [
                    trajectory.get("raw_reward", trajectory.get("reward")) for trajectory in trajectories
                ],
            }
        )
    return json_response({"task_type": task_type, "groups": listed})


@router.get("/group")
async def group(svc: Annotated[Services, Depends(services)], task_type: str, instance_id: str) -> Response:
    """One ready group's trajectories as written (messages, reward, ``turns``, ``extra_info``)."""
    svc.check_task(task_type)
    for found in svc.buffer.peek(task_type, None):
        if str(found.instance_id) == instance_id:
            items = b",".join(found.items)
            return Response(
                b'{"task_type":'
                + orjson.dumps(task_type)
                + b',"instance_id":'
                + orjson.dumps(found.instance_id)
                + b',"trajectories":['
                + items
                + b"]}",
                media_type="application/json",
            )
    raise HTTPException(404, f"no ready group {instance_id!r} of task {task_type!r}: read, or not finished")


@router.get("/static/{name:path}", include_in_schema=False)
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:  # only the files listed: no path ever reaches the file system
        raise HTTPException(404, f"no dashboard asset {name!r}")
    return FileResponse(STATIC / name, media_type=media_type, headers=_NO_CACHE)
