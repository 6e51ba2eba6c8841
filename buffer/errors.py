"""The errors the service raises on purpose, each with the HTTP status it maps to.

    RolloutBufferError                  500  base; never raised itself
    ├── InvalidInput                    422  a field of a request is wrong (names it)
    │   └── TooManyTasks                     a new task_type past --max-tasks
    ├── NotFound                        404
    │   ├── UnknownTask                      no generator for the task type (lists the known ones)
    │   └── UnknownJob
    ├── GeneratorUnavailable            409  the task's generator file failed to load
    ├── NeedsDataDir                    409  a feature that keeps data on disk, without --data-dir
    ├── BufferFull                      429  past --max-buffered-trajectories; retry later
    ├── BatchTooLarge                   413  a batch that alone exceeds --max-buffered-trajectories
    └── StorageFailed                   503  the data folder cannot be written

The API maps each to its status and the envelope ``{"success": false, "message": ...}`` in
one handler (``buffer.service.app``); nothing else reaches a client, tracebacks least of all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class RolloutBufferError(Exception):
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def details(self) -> dict[str, Any]:
        """Extra fields for the error response."""
        return {}

    def headers(self) -> dict[str, str]:
        """Extra headers for the error response."""
        return {}


class InvalidInput(RolloutBufferError):
    """One or more fields of a request are wrong; ``errors`` names each."""

    status_code = 422

    def __init__(self, errors: Iterable[tuple[str, str]]) -> None:
        self.errors = [{"field": field, "reason": reason} for field, reason in errors]
        super().__init__("; ".join(f"{e['field']}: {e['reason']}" for e in self.errors))

    @classmethod
    def one(cls, field: str, reason: str) -> InvalidInput:
        return cls([(field, reason)])

    def details(self) -> dict[str, Any]:
        return {"errors": self.errors}


class TooManyTasks(InvalidInput):
    """A request would create a task while the buffer keeps its maximum number: tasks are
    never forgotten (their counters are history), so each name costs memory for good."""

    def __init__(self, field: str, task_type: str, limit: int) -> None:
        super().__init__(
            [
                (
                    field,
                    f"would be a new task {task_type!r}, past the {limit} tasks "
                    "the buffer keeps (--max-tasks)",
                )
            ]
        )


class NotFound(RolloutBufferError):
    status_code = 404


class UnknownTask(NotFound):
    def __init__(self, task_type: str, available: Iterable[str]) -> None:
        self.task_type = task_type
        self.available = sorted(available)
        known = ", ".join(self.available) or "none"
        super().__init__(f"task_type: no generator for {task_type!r}; available tasks: {known}")

    def details(self) -> dict[str, Any]:
        return {"available_tasks": self.available}


class UnknownJob(NotFound):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job with id {job_id!r}")


class GeneratorUnavailable(RolloutBufferError):
    """The task type is known, but its generator file cannot be used."""

    status_code = 409

    def __init__(self, task_type: str, errors: list[dict[str, Any]]) -> None:
        self.task_type = task_type
        self.load_errors = errors
        reasons = "; ".join(f"{e['file']}: {e['error']}" for e in errors)
        super().__init__(f"task_type: the generator for {task_type!r} failed to load: {reasons}")

    def details(self) -> dict[str, Any]:
        return {"load_errors": self.load_errors}


class NeedsDataDir(RolloutBufferError):
    status_code = 409

    def __init__(self, feature: str) -> None:
        super().__init__(f"{feature} keeps its data on disk: start the service with --data-dir DIR")


class BufferFull(RolloutBufferError):
    """A write would open a new group while the buffer holds its maximum; groups already
    open still take writes, so they can finish while the trainer catches up."""

    status_code = 429
    retry_after_s = 1

    def __init__(self, buffered: int, limit: int, adding: int = 1) -> None:
        self.buffered, self.limit, self.adding = buffered, limit, adding
        super().__init__(
            f"the buffer holds {buffered} trajectories and this write would add {adding} in new groups, "
            f"past its maximum (--max-buffered-trajectories {limit}); retry once the trainer has read some"
        )

    def details(self) -> dict[str, Any]:
        return {"buffered": self.buffered, "limit": self.limit, "adding": self.adding}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class BatchTooLarge(RolloutBufferError):
    """A batch that would open more trajectories than the buffer may hold at all: it can never
    be taken whole, however long the client waits, so it is not a 429."""

    status_code = 413

    def __init__(self, adding: int, limit: int) -> None:
        self.adding, self.limit = adding, limit
        super().__init__(
            f"this batch would add {adding} trajectories in new groups, more than the buffer ever holds "
            f"(--max-buffered-trajectories {limit}); send smaller batches"
        )

    def details(self) -> dict[str, Any]:
        return {"adding": self.adding, "limit": self.limit}


class StorageFailed(RolloutBufferError):
    """The journal could not write to the data folder (disk full, I/O error): nothing more is
    taken, since it could not be kept. What is on disk is restored by a restart."""

    status_code = 503

    def __init__(self, cause: OSError) -> None:
        super().__init__(f"the buffer cannot write to its data folder: {cause.strerror or cause}")
