"""Routes: the dashboard, a page served by the service itself, and the JSON it polls.

``GET /dashboard`` is plain HTML, CSS and JavaScript from ``buffer/service/static`` with uPlot vendored
beside them (no build step, no external resources, relative URLs so a proxy may serve it under a
prefix). The page polls ``GET /dashboard/data?since=T`` once a second: the history samples newer
than the last one it holds, not the whole history again. The trajectory viewer reads
``/dashboard/groups`` (the groups a read would return, newest first) and ``/dashboard/group``
(one group's trajectories, token records included, and each token's text when a job of the task
named the served model's ``tokenizer_path``).

``/dashboard/data`` also says what the service knows of the trainer (``trainer``): when it last
read, and per task with ready groups how long the oldest has waited; a task whose oldest ready
group has waited ``TRAINER_BEHIND_S`` is listed as behind. Whether a job's policy server is down
is the page's to tell: it needs the jobs' request counters over time, which the page polls.
``GET /dashboard/`` redirects to ``../dashboard``, a relative URL, so it works under a prefix.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, RedirectResponse, Response

from buffer.service.responses import json_response
from buffer.service.services import Services, services

logger = logging.getLogger(__name__)

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


@router.get("/", include_in_schema=False)
async def page_with_slash(request: Request) -> Response:
    """To the page, by a relative URL: an absolute one (starlette's own slash redirect) names
    the host and path the service sees, not those a proxy serves it under."""
    query = f"?{request.url.query}" if request.url.query else ""
    return RedirectResponse(f"../dashboard{query}", status_code=307)


#: The viewer lists at most this many groups of a task.
MAX_GROUPS = 200
#: A task whose oldest ready group has waited this long is shown as "trainer behind".
TRAINER_BEHIND_S = 60.0


@router.get("/data")
async def data(
    svc: Annotated[Services, Depends(services)], since: Annotated[float | None, Query()] = None
) -> Response:
    """The history of the counters (only the samples after ``since``, a sample's ``t``, when
    given), the buffer's statistics now, the jobs and the generators."""
    full_history = svc.history.snapshot()
    history = full_history if since is None else [sample for sample in full_history if sample["t"] > since]
    stats = svc.buffer.stats()
    body: dict[str, Any] = {
        "history": history,
        "stats": stats,
        "trainer": trainer_state(svc, stats, full_history, time.time()),
        "policy": svc.buffer.policy.snapshot(),
        "jobs": [svc.jobs.describe(job) for job in svc.jobs.list()],
        "generators": [generator.describe() for generator in svc.registry.generators.values()],
        "generator_errors": [error.describe() for error in svc.registry.errors],
    }
    return json_response(body)


def trainer_state(
    svc: Services, stats: dict[str, Any], history: list[dict[str, Any]], now: float
) -> dict[str, Any]:
    """What the service knows of the trainer: the seconds since a read last took groups (from
    the history: ``last_read_age_s``, None when nothing was ever read; ``at_least`` when the read
    is older than the history), and per task with ready groups how long the oldest has waited.

    Reads take the oldest groups first, so an oldest ready group older than ``TRAINER_BEHIND_S``
    means the trainer has not read for that long, or reads less than the generators make: both
    are "behind" (``behind``: those tasks)."""
    last_read_age_s, at_least = _since_last_read(history, int(stats["total_read"]), now)
    tasks: dict[str, dict[str, Any]] = {}
    for name, task in stats["tasks"].items():
        if not task["ready_groups"]:
            continue
        oldest = svc.buffer.peek(name, 1)
        ready_at = oldest[0].ready_at if oldest else 0.0
        age_s = round(max(0.0, now - ready_at), 1) if ready_at > 0 else None  # 0: restored, unknown
        tasks[name] = {"ready_groups": task["ready_groups"], "oldest_ready_age_s": age_s}
    behind = sorted(
        name
        for name, task in tasks.items()
        if task["oldest_ready_age_s"] is not None and task["oldest_ready_age_s"] >= TRAINER_BEHIND_S
    )
    return {
        "last_read_age_s": last_read_age_s,
        "at_least": at_least,
        "behind_after_s": TRAINER_BEHIND_S,
        "behind": behind,
        "tasks": tasks,
    }


def _since_last_read(history: list[dict[str, Any]], total_read: int, now: float) -> tuple[float | None, bool]:
    """Seconds since ``total_read`` last grew, to the history's one-second samples, and whether
    that is only a lower bound (it has not grown in the whole history)."""
    if total_read == 0 or not history:
        return None, False
    if total_read > history[-1]["total_read"]:
        return 0.0, False  # since the last sample
    for earlier, later in zip(reversed(history[:-1]), reversed(history), strict=False):
        if later["total_read"] > earlier["total_read"]:
            return round(max(0.0, now - later["t"]), 1), False
    return round(max(0.0, now - history[0]["t"]), 1), True


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
    """One ready group's trajectories as written (messages, reward, ``turns``, ``extra_info``),
    and ``tokens``: the tokenizer of the task's newest job that named a ``tokenizer_path``, the
    text of each token id the group's token records hold (``texts``), or why there is none."""
    svc.check_task(task_type)
    for found in svc.buffer.peek(task_type, None):
        if str(found.instance_id) == instance_id:
            tokens = await _token_texts(_tokenizer_path(svc, task_type), found.items)
            return Response(
                b'{"task_type":'
                + orjson.dumps(task_type)
                + b',"instance_id":'
                + orjson.dumps(found.instance_id)
                + b',"tokens":'
                + orjson.dumps(tokens)
                + b',"trajectories":['
                + b",".join(found.items)
                + b"]}",
                media_type="application/json",
            )
    raise HTTPException(404, f"no ready group {instance_id!r} of task {task_type!r}: read, or not finished")


def _tokenizer_path(svc: Services, task_type: str) -> str | None:
    """The served model's tokenizer, as the task's newest job that named one gave it."""
    jobs = [job for job in svc.jobs.list() if job.task_type == task_type and job.data.get("tokenizer_path")]
    return str(max(jobs, key=lambda job: job.started_at).data["tokenizer_path"]) if jobs else None


async def _token_texts(path: str | None, items: Iterable[bytes]) -> dict[str, Any]:
    if path is None:
        return {"tokenizer": None, "texts": None, "why": "no job of this task named a tokenizer_path"}
    ids = sorted({token for item in items for token in _token_ids(orjson.loads(item))})
    try:
        texts = await asyncio.to_thread(_decode_each, path, tuple(ids))
    except Exception as exc:  # a missing file, a broken one, no tokenizers library: shown, not fatal
        logger.info("the dashboard cannot decode tokens with %s: %s", path, exc)
        return {"tokenizer": path, "texts": None, "why": f"cannot load it: {type(exc).__name__}: {exc}"}
    return {"tokenizer": path, "texts": dict(zip(map(str, ids), texts, strict=True)), "why": None}


def _token_ids(trajectory: dict[str, Any]) -> Iterable[int]:
    for turn in trajectory.get("turns") or ():
        yield from turn.get("prompt_ids") or ()
        yield from turn.get("output_ids") or ()
    info = trajectory.get("extra_info") or {}
    for key in ("prompt_token_ids", "token_ids"):
        if isinstance(info.get(key), list):
            yield from (token for token in info[key] if isinstance(token, int))


def _decode_each(path: str, ids: tuple[int, ...]) -> list[str]:
    return list(_tokenizer(path).decode_batch([[token] for token in ids], skip_special_tokens=False))


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    """A ``tokenizers`` tokenizer from a folder's ``tokenizer.json`` (or the file itself): read
    from disk only, never fetched. ``tokenizers`` comes with the ``sim`` and ``train`` extras."""
    from tokenizers import Tokenizer

    file = Path(path).expanduser()
    return Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))


@router.get("/static/{name:path}", include_in_schema=False)
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:  # only the files listed: no path ever reaches the file system
        raise HTTPException(404, f"no dashboard asset {name!r}")
    return FileResponse(STATIC / name, media_type=media_type, headers=_NO_CACHE)
