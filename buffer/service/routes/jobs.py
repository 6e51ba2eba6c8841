"""The background jobs that run generators."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import Response

from buffer.service.responses import envelope
from buffer.service.services import Services, services

router = APIRouter(prefix="/jobs")


@router.get("")
async def list_jobs(svc: Annotated[Services, Depends(services)]) -> Response:
    jobs = [svc.jobs.describe(job) for job in svc.jobs.list()]
    return envelope(True, f"{len(jobs)} jobs", {"jobs": jobs})


@router.get("/{job_id}")
async def get_job(job_id: str, svc: Annotated[Services, Depends(services)]) -> Response:
    return envelope(True, "Job", svc.jobs.describe(svc.jobs.get(job_id)))


@router.post("/{job_id}/cancel")
async def cancel_job(job_id: str, svc: Annotated[Services, Depends(services)]) -> Response:
    job = await svc.jobs.cancel(job_id)
    await svc.buffer.wait_durable()  # the job's end on disk: a crash after the answer does not resume it
    return envelope(True, f"Job {job.status.value}", svc.jobs.describe(job))
