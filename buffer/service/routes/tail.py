"""``/buffer/tail``: the trajectories written lately, for ``rollout-buffer tail`` to follow."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from starlette.responses import Response

from buffer.service.responses import envelope
from buffer.service.services import Services, services

router = APIRouter()

MAX_LIMIT = 1000


@router.get("/buffer/tail")
async def tail(
    svc: Annotated[Services, Depends(services)],
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
) -> Response:
    """The trajectories written after sequence number ``after``, oldest first, at most ``limit``.

    Only the last thousand written are kept: ``after=0`` gives the oldest of those. ``last_seq``
    is what to pass as ``after`` next: the last item's number, or with no items the newest
    number written, so a large ``after`` asks where the present is and a ``last_seq`` below
    ``after`` means the buffer started again from 1.
    """
    # A copy in one C call, which no writer thread can interleave with: no need for the lock.
    recent = list(svc.buffer.recent)
    newer = [entry for entry in recent if entry[0] > after][:limit]
    items = [
        {
            "seq": seq,
            "task_type": task_type,
            "instance_id": instance_id,
            "uid": uid,
            "reward": reward,
            "time": wall_time,
        }
        for seq, task_type, instance_id, uid, reward, wall_time in newer
    ]
    newest = recent[-1][0] if recent else 0
    last_seq = newer[-1][0] if newer else newest
    return envelope(True, f"{len(items)} trajectories after {after}", {"items": items, "last_seq": last_seq})
