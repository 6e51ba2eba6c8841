"""The job whose generator is running here: what the generator side may know of it.

A generator, and the toolkit code it calls, sometimes needs the job it runs in: where the
buffer is, whether it runs in a worker process, where to put its progress, whether it was
asked to stop. It finds it with ``current_job()``, a ``JobContext`` or None (run by hand,
outside any job). This module is that one fact and nothing else, and imports only the standard
library (as celery's ``_state`` holds the current app and task): the toolkit and the worker
processes depend on it, never on the service that runs the jobs. A worker process starts in
a few milliseconds because importing this does not import the service.

Who sets it:

- the service, for a job running in its own process (``isolation="inline"``): its ``Job``
  (``buffer.service.jobs``) *is* a ``JobContext`` (a subclass, adding what only the service
  reads: status, timings, workers), with the service's in-process ``writer`` and its
  ``lease_board``;
- a worker process (``buffer.workers.child``), for the generator it runs: a plain
  ``JobContext`` built from its ``WorkerSpec``, ``in_worker`` set, writing over HTTP.

The value is a ``ContextVar``: an asyncio task, or a thread started with
``contextvars.copy_context()``, sees the job of the code that started it; two jobs inline in
one service never see each other's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # types only: this leaf imports nothing of the package at run time
    from buffer.toolkit.sink import TrajectorySink
    from buffer.workers.leases import LeaseBoard


@dataclass(eq=False)
class JobContext:
    """The generator-facing part of a job."""

    id: str
    task_type: str
    generator_file: str
    #: The ``/start_rollout`` payload the generator runs with (as the service checked it).
    data: dict[str, Any]
    #: The service's own address: where a generator of the job writes, reads the policy, opens
    #: gateway sessions when it names no other buffer.
    buffer_url: str | None = None
    #: Running in a worker process of the service: its sink writes to ``buffer_url`` over HTTP.
    in_worker: bool = False
    #: What a sink for this service is, in the service's own process (handed over by the
    #: service: no HTTP round trip). None in a worker process.
    writer: TrajectorySink | None = field(default=None, repr=False)
    #: Hosts (lower case) a ``remote_buffer_url`` may name to be sent the service's own API key
    #: (``--send-api-key-to``); to any other, only a key the client gave itself.
    api_key_hosts: frozenset[str] = frozenset()
    #: The service's own key, in a worker process (from its ``WorkerSpec``, never from its
    #: environment): what its sinks, leases and policy mirror send to ``buffer_url`` and to
    #: the ``api_key_hosts`` (``key_for``). None in the service's process and outside a job.
    api_key: str | None = field(default=None, repr=False)
    #: In a worker process the service started: the descriptor of its admission socket to the
    #: service (``buffer.policy.channel``: grants pushed, not asked for over HTTP). None elsewhere.
    policy_channel: int | None = field(default=None, repr=False)
    #: The toolkit's counts, for ``GET /jobs/{id}`` (a worker process publishes them to a file).
    progress: dict[str, Any] = field(default_factory=dict)
    #: The service's lease board, for a generator running in the service's own process.
    lease_board: LeaseBoard | None = field(default=None, repr=False)
    #: Tasks its generator leaves running until the run ends (the leases' heartbeat).
    background: set[asyncio.Task[None]] = field(default_factory=set, repr=False)
    #: Trajectories a buffer refused as invalid, whichever sink of the job wrote them, and why
    #: the first was: a job that lost any fails (``refusal``), even if its generator went on.
    refused: int = 0
    first_refusal: str | None = None
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _refusals: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def cancel_requested(self) -> bool:
        """Whether the job was cancelled: a sync generator (which no one can interrupt inline)
        may look at it and return."""
        return self._cancel.is_set()

    def request_cancel(self) -> None:
        """Mark the job cancelled (the service's cancel, a worker's SIGTERM); thread-safe."""
        self._cancel.set()

    def record_refusal(self, reason: str) -> None:
        """A sink of the job had a trajectory refused (thread-safe: a sync generator's own)."""
        with self._refusals:
            self.refused += 1
            if self.first_refusal is None:
                self.first_refusal = reason[:500]

    def refusal(self) -> str | None:
        """What fails the job when its sinks had trajectories refused; None when none were."""
        if not self.refused:
            return None
        return f"the buffer refused {self.refused} trajectories of the job (the first: {self.first_refusal})"

    def may_send_api_key(self, url: str) -> bool:
        """Whether the service's own key may go to ``url`` (one of ``api_key_hosts``)."""
        return (urlsplit(url).hostname or "").lower() in self.api_key_hosts

    def key_for(self, url: str) -> str | None:
        """The service's own key when ``url`` is this job's buffer (its address as the service
        gave it) or names one of ``api_key_hosts``; None for any other address."""
        if self.api_key is None:
            return None
        if self.buffer_url is not None and _origin(url) == _origin(self.buffer_url):
            return self.api_key
        return self.api_key if self.may_send_api_key(url) else None


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


_current: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar("current_job", default=None)


def current_job() -> JobContext | None:
    """The job whose generator is running in this context, if any."""
    return _current.get()


@contextlib.contextmanager
def running(job: JobContext) -> Iterator[JobContext]:
    """Make ``job`` the current job in this context until the block ends (then the one before)."""
    token = _current.set(job)
    try:
        yield job
    finally:
        _current.reset(token)
