"""What the routes work with, built once per app in its lifespan."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from buffer.errors import UnknownTask
from buffer.jobs import JobManager
from buffer.registry import GeneratorRegistry
from buffer.rollout_buffer import RolloutBuffer
from buffer.settings import Settings
from buffer.signals import ReadySignal


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    buffer: RolloutBuffer
    registry: GeneratorRegistry
    jobs: JobManager
    ready: ReadySignal

    def public_url(self) -> str:
        return local_url(self.settings)

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
