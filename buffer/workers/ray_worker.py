"""A job's workers as Ray actors, for a job run with ``--ray-address`` (or its ``ray_address``).

Ray places the actors on its cluster (no scheduling of our own); each actor runs the same
worker code as a worker process (``child.run``) and writes to the buffer over HTTP, to the
job's ``remote_buffer_url``: give one the cluster's machines can reach (the default, the
service's loopback address, only works on a one-machine cluster). An actor makes itself the
leader of a process group first, so a stop takes what the generator started with it: SIGTERM to
the group, SIGKILL after the grace period, then ``ray.kill``. ``address="local"`` starts a Ray
instance of the service's own (tests, one machine). Ray is an optional extra:
``pip install 'rollout-buffer[ray]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from buffer.workers.process import WorkerOutcome
from buffer.workers.spec import WorkerSpec

logger = logging.getLogger(__name__)

#: How long a stop waits, after the grace period, for the actor's run to end before ``ray.kill``.
KILL_WAIT_S = 5.0
_connected: str | None = None
_connect_lock = threading.Lock()


class RayUnavailable(RuntimeError):
    """Ray is not installed, or its cluster cannot be reached."""


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` once per process (blocking: call in a thread)."""
    global _connected
    with _connect_lock:
        if _connected is not None:
            if _connected != address:
                raise RayUnavailable(f"this service is connected to Ray at {_connected}, not {address}")
            return
        ray = _ray()
        options: dict[str, Any] = {"address": address, "ignore_reinit_error": True, "log_to_driver": True}
        if address == "local":
            options["include_dashboard"] = False
        ray.init(**options)
        _connected = address


def shutdown() -> None:
    """Leave the cluster (and stop a ``local`` one); call in a thread."""
    global _connected
    with _connect_lock:
        if _connected is None:
            return
        _ray().shutdown()
        _connected = None


class GeneratorActor:
    """The actor: one job's worker. Threaded (two calls at once), so ``terminate`` runs while
    ``run`` does."""

    def run(self, raw_spec: dict[str, Any]) -> dict[str, Any]:
        from buffer.workers import child

        with contextlib.suppress(OSError):  # a group of its own: terminate() stops its children too
            os.setpgrp()
        spec = WorkerSpec.from_json(raw_spec)
        outcome: dict[str, Any] = {}
        code = child.run(spec, outcome)
        return {"returncode": code, **outcome}

    def terminate(self, grace_s: float) -> None:
        group = os.getpgrp()
        if group != os.getpid():  # run() has not started: nothing of the generator's to stop
            return
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGTERM)
        time.sleep(grace_s)
        os.killpg(group, signal.SIGKILL)


@dataclass(eq=False)
class RayWorker:
    """The service's handle on one actor; the same interface as ``WorkerProcess``."""

    spec: WorkerSpec
    address: str
    env: dict[str, str] = field(default_factory=dict)
    outcome: WorkerOutcome | None = None
    _actor: Any = field(default=None, repr=False)
    _ref: Any = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return None

    async def start(self) -> None:
        await asyncio.to_thread(connect, self.address)
        ray = _ray()
        actor_class = ray.remote(num_cpus=1, max_concurrency=2)(GeneratorActor)
        options: dict[str, Any] = {}
        if self.env:
            options["runtime_env"] = {"env_vars": self.env}
        self._actor = actor_class.options(**options).remote()
        self._ref = asyncio.wrap_future(self._actor.run.remote(self.spec.to_json()).future())
        logger.info(
            "%s: worker %d/%d started as a Ray actor", self.spec.job_id, self.spec.index + 1, self.spec.count
        )

    async def wait(self) -> WorkerOutcome:
        ray = _ray()

        try:
            raw: dict[str, Any] = await asyncio.shield(self._ref)
        except ray.exceptions.RayActorError as exc:
            self.outcome = WorkerOutcome("failed", None, f"the Ray actor died: {_first_line(exc)}", lost=True)
        except ray.exceptions.RayError as exc:
            self.outcome = WorkerOutcome("failed", None, f"Ray: {_first_line(exc)}")
        else:
            self.outcome = WorkerOutcome(
                raw.get("status", "failed"), raw.get("returncode"), raw.get("error"), raw.get("where")
            )
        return self.outcome

    async def stop(self, grace_s: float) -> None:
        if self._actor is None:
            return
        ray = _ray()
        # The actor signals its own group, then kills it: its run() ends, one way or another.
        self._actor.terminate.remote(grace_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._ref), grace_s + KILL_WAIT_S)
        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)
        if self.outcome is None:
            self.outcome = WorkerOutcome("cancelled", None, "stopped: ray.kill")

    def rss_bytes(self) -> int | None:
        return None

    def progress(self) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        outcome = self.outcome
        return {
            "index": self.spec.index,
            "ray_actor": None if self._actor is None else self._actor._actor_id.hex(),
            "status": "running" if outcome is None else outcome.status,
            "exit": None if outcome is None else (outcome.error or outcome.status),
        }


def _ray() -> Any:
    """The ``ray`` module, imported only when a job uses it (an optional extra, and slow)."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise RayUnavailable("Ray is not installed: pip install 'rollout-buffer[ray]'") from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
