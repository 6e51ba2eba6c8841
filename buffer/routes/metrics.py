"""Routes: metrics, in the Prometheus text format."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response

from buffer.metrics import build_registry
from buffer.services import Services, services

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request, svc: Annotated[Services, Depends(services)]) -> Response:
    """Every metric, read from the buffer and the jobs now: nothing is counted on the write path."""
    return Response(generate_latest(_registry(request, svc)), media_type=CONTENT_TYPE_LATEST)


def _registry(request: Request, svc: Services) -> CollectorRegistry:
    """The app's registry, built on its first scrape (and again if the lifespan restarted)."""
    cached: tuple[Services, CollectorRegistry] | None = getattr(request.app.state, "metrics", None)
    if cached is None or cached[0] is not svc:
        cached = (svc, build_registry(svc.buffer, svc.jobs))
        request.app.state.metrics = cached
    return cached[1]
