"""Routes: metrics, in the Prometheus text format."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response

from buffer.service.metrics import build_registry
from buffer.service.services import Services, services

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request, svc: Annotated[Services, Depends(services)]) -> Response:
    """Every metric, read from the buffer and the jobs now: nothing is counted on the write path.

    The text is built in a thread, one scrape at a time: with many tasks it takes a while, and
    on the event loop it would hold up every other request for as long. The buffer's lock is
    held only to copy its counters."""
    registry, lock = _registry(request, svc)
    async with lock:
        body = await asyncio.to_thread(generate_latest, registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _registry(request: Request, svc: Services) -> tuple[CollectorRegistry, asyncio.Lock]:
    """The app's registry and its scrape lock, made on the first scrape (and again if the
    lifespan restarted)."""
    cached: tuple[Services, CollectorRegistry, asyncio.Lock] | None = getattr(
        request.app.state, "metrics", None
    )
    if cached is None or cached[0] is not svc:
        cached = (svc, build_registry(svc.buffer, svc.jobs), asyncio.Lock())
        request.app.state.metrics = cached
    return cached[1], cached[2]
