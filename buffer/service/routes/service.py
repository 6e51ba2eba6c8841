"""The service itself: liveness, health and the generators it found."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import Response

from buffer import __version__
from buffer.service.responses import envelope, json_response
from buffer.service.services import Services, services

router = APIRouter()


@router.get("/")
async def root() -> Response:
    return json_response({"message": "Rollout Buffer Server is running", "version": __version__})


@router.get("/health")
async def health(svc: Annotated[Services, Depends(services)]) -> Response:
    """``ok``, or 503 with why: the data folder cannot be written (a full disk); the service
    takes writes and reads again, by itself, once it can."""
    body = {
        "status": "ok",
        "version": __version__,
        "tasks": svc.buffer.task_types(),
        "generators": sorted(svc.registry.generators),
        "generator_errors": len(svc.registry.errors),
    }
    journal = svc.buffer.journal
    if journal is None:
        return json_response(body)
    failure = journal.failing
    body["storage"] = journal.counters()
    if failure is not None:
        body["status"] = "storage_failed"
        body["reason"] = f"the buffer cannot write to its data folder: {failure.strerror or failure}"
        return json_response(body, status_code=503)
    return json_response(body)


@router.get("/generators")
async def generators(svc: Annotated[Services, Depends(services)]) -> Response:
    """Every discovered task with its file and overridden hooks, and every file that failed."""
    await asyncio.to_thread(svc.registry.refresh)
    found = [generator.describe() for generator in svc.registry.generators.values()]
    errors = [error.describe() for error in svc.registry.errors]
    return envelope(
        True,
        f"{len(found)} generators, {len(errors)} failed to load",
        {"generator_dir": str(svc.registry.directory), "generators": found, "errors": errors},
    )
