"""What the routes work with, built once per app in its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from buffer.core.registry import GeneratorRegistry
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.errors import UnknownTask
from buffer.service.history import History
from buffer.service.jobs import JobManager
from buffer.service.settings import Settings
from buffer.signal import Signal

T = TypeVar("T")


class Stopping:
    """The service's shutdown as its long polls see it: once ``begin`` is called (the jobs'
    workers have stopped and the port is about to close), each wait ends at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._signal = Signal()

    def is_set(self) -> bool:
        return self._event.is_set()

    def begin(self) -> None:
        self._event.set()
        self._signal.notify()

    async def unless(self, awaitable: Awaitable[T]) -> T | None:
        """``awaitable``'s result, or None (and it cancelled) once the shutdown has begun."""
        task = asyncio.ensure_future(awaitable)
        ticket = self._signal.ticket()  # before the check: a begin cannot slip past
        try:
            if not self.is_set():
                await asyncio.wait((task, ticket.future), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ticket.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return None if task.cancelled() else task.result()


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    buffer: RolloutBuffer
    registry: GeneratorRegistry
    jobs: JobManager
    ready: Signal
    history: History
    stopping: Stopping = field(default_factory=Stopping)

    def begin_shutdown(self) -> None:
        """The service is stopping (its jobs' workers have): long polls stop waiting and
        answer with what is ready, before uvicorn waits for the requests in flight."""
        self.stopping.begin()
        self.ready.notify()
        self.buffer.policy.changed.notify()  # the watches

    async def wait_for_items(
        self, request: Request, task_type: str | None, count: int, timeout_s: float
    ) -> bool:
        """Wait up to ``timeout_s`` for ``count`` ready items; False when the client has gone.

        A read for a client that has gone would take groups off the buffer and lose them, so
        the wait checks the connection every second and the caller reads only on True."""
        deadline = time.monotonic() + timeout_s
        while not await self.ready.wait_until(
            lambda: self.stopping.is_set() or self.buffer.ready_items(task_type) >= count,
            min(1.0, max(0.0, deadline - time.monotonic())),
        ):
            if await request.is_disconnected():
                return False
            if time.monotonic() >= deadline:
                break
        return not await request.is_disconnected()

    def check_task(self, task_type: str | None) -> None:
        """A read may name a task the buffer has or a generator defines; anything else is a typo."""
        if task_type is None or self.buffer.has_task(task_type) or task_type in self.registry.generators:
            return
        raise UnknownTask(task_type, set(self.registry.generators) | set(self.buffer.task_types()))


def services(request: Request) -> Services:
    result: Services = request.app.state.services
    return result


def local_url(settings: Settings) -> str:
    """How a generator on this machine reaches the service."""
    host = settings.host
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"
