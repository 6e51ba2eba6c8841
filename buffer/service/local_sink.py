"""The sink of a generator running in the service's own process: straight into the buffer.

A job run inline (``isolation="inline"``) is handed one as its ``writer``
(``buffer.current.JobContext``), and the toolkit's ``open_sink`` returns it when the buffer a
generator names is this service: no HTTP round trip, yet the same rules as a write over HTTP
(the trajectory schema, backpressure while the buffer is full, done once durable). A refused
trajectory raises ``RejectedTrajectory`` and is counted on the job (``JobContext.refused``):
the job fails even if its generator catches the error and carries on. It lives
with the service, not the toolkit, because it holds the service's buffer and its schema: the
toolkit only ever sees a ``TrajectorySink``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import ValidationError

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.current import JobContext
from buffer.errors import BufferFull, InvalidInput
from buffer.service.models import TRAJECTORY
from buffer.toolkit.sink import RejectedTrajectory

logger = logging.getLogger(__name__)


class LocalSink:
    """Writes into this process's buffer: waits while it is full, returns once durable;
    counts what it refuses on ``job``."""

    def __init__(self, buffer: RolloutBuffer, job: JobContext | None = None) -> None:
        self._buffer = buffer
        self._job = job

    async def write(self, trajectory: dict[str, Any]) -> None:
        try:
            TRAJECTORY.validate_python(trajectory)
        except ValidationError as exc:
            raise self._refused(trajectory, str(exc)) from None
        while True:
            try:
                self._buffer.write(trajectory)
                break
            except InvalidInput as exc:  # what validation cannot see, e.g. an integer beyond 64 bits
                raise self._refused(trajectory, str(exc)) from None
            except BufferFull as exc:  # the trainer is behind: slow down, lose nothing
                logger.debug("%s; retrying in %d s", exc, exc.retry_after_s)
                await asyncio.sleep(exc.retry_after_s)
        await self._buffer.wait_durable()  # as an HTTP write, done once on disk

    async def aclose(self) -> None:
        """Nothing to close: the buffer is the service's, and one sink serves the whole job."""
        return None

    def _refused(self, trajectory: dict[str, Any], reason: str) -> RejectedTrajectory:
        uid = trajectory.get("uid") if isinstance(trajectory, dict) else None
        if self._job is not None:
            self._job.record_refusal(f"{uid}: {reason}")
        return RejectedTrajectory(reason)
