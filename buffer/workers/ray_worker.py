"""A job's workers as Ray actors, for a job run with ``--ray-address`` (or its ``ray_address``).

Ray places the actors on its cluster (no scheduling of our own); each actor runs the same
worker code as a worker process (``child.run``) and writes to the buffer over HTTP, to the
job's ``remote_buffer_url``: give one the cluster's machines can reach (the default, the
service's loopback address, only works on a one-machine cluster). An actor makes itself the
leader of a process group first, so a stop takes what the generator started with it: SIGTERM to
the group, SIGKILL after the grace period, then ``ray.kill``. ``address="local"`` starts a Ray
instance of the service's own (tests, one machine). Ray is an optional extra:
``pip install 'rollout-buffer[ray]'``.

As a worker process does, an actor reports its generator's progress (the toolkit's counts) and
its resident memory: the service asks it (``report``) every ``REPORT_INTERVAL_S`` while it runs,
and its last counts come back with its outcome, for ``GET /jobs/{id}``.
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

from buffer import paths
from buffer.workers.process import WorkerOutcome, rss_of
from buffer.workers.spec import WorkerSpec

logger = logging.getLogger(__name__)

#: How long a stop waits, after the grace period, for the actor's run to end before ``ray.kill``.
KILL_WAIT_S = 5.0
#: How often the service asks a running actor for its progress and memory.
REPORT_INTERVAL_S = 1.0
#: This package's folder: first on the path of a ``local`` instance's actors.
_PACKAGE_ROOT = str(paths.ROOT)
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
    """The actor: one job's worker. Threaded (three calls at once), so ``terminate`` and
    ``report`` run while ``run`` does."""

    def __init__(self) -> None:
        self._progress: dict[str, Any] = {}

    def run(self, raw_spec: dict[str, Any]) -> dict[str, Any]:
        from buffer.workers import child

        with contextlib.suppress(OSError):  # a group of its own: terminate() stops its children too
            os.setpgrp()
        outcome: dict[str, Any] = {}
        code = child.run(WorkerSpec.from_json(raw_spec), outcome, report=self._keep)
        return {"returncode": code, **outcome, "progress": self._progress}

    def _keep(self, progress: dict[str, Any]) -> None:
        self._progress = progress

    def report(self) -> dict[str, Any]:
        """The generator's last progress (handed over at each change: ``child.run``'s
        ``report``), and this actor's resident memory."""
        return {"progress": self._progress, "rss_bytes": rss_of(os.getpid()), "pid": os.getpid()}

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
    _report: dict[str, Any] = field(default_factory=dict, repr=False)
    _reporter: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        """The actor's process id, on its node (as it last reported)."""
        pid = self._report.get("pid")
        return pid if isinstance(pid, int) else None

    async def start(self) -> None:
        await asyncio.to_thread(connect, self.address)
        ray = _ray()
        actor_class = ray.remote(num_cpus=1, max_concurrency=3)(GeneratorActor)
        options: dict[str, Any] = {}
        env = dict(self.env)
        if self.address == "local":  # the service's own instance runs the service's own code
            paths = (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", ""))
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        if env:
            options["runtime_env"] = {"env_vars": env}
        self._actor = actor_class.options(**options).remote()
        self._ref = asyncio.wrap_future(self._actor.run.remote(self.spec.to_json()).future())
        self._reporter = asyncio.create_task(self._poll(), name=f"{self.spec.job_id}-ray-report")
        logger.info(
            "%s: worker %d/%d started as a Ray actor", self.spec.job_id, self.spec.index + 1, self.spec.count
        )

    async def wait(self) -> WorkerOutcome:
        ray = _ray()

        try:
            raw: dict[str, Any] = await asyncio.shield(self._ref)
            if isinstance(raw.get("progress"), dict):
                self._report["progress"] = raw["progress"]
        except ray.exceptions.RayActorError as exc:
            self.outcome = WorkerOutcome("failed", None, f"the Ray actor died: {_first_line(exc)}", lost=True)
        except ray.exceptions.RayError as exc:
            self.outcome = WorkerOutcome("failed", None, f"Ray: {_first_line(exc)}")
        else:
            self.outcome = WorkerOutcome(
                raw.get("status", "failed"), raw.get("returncode"), raw.get("error"), raw.get("where")
            )
        finally:
            await self._stop_polling()
        # Its run is over: free the actor's process and its CPU for the next job's actors.
        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)
        return self.outcome

    async def _poll(self) -> None:
        """Ask the actor for its progress and memory while it runs; a call that fails (the
        actor busy starting, or gone) leaves the last report as it was."""
        while self.outcome is None:
            try:
                raw = await asyncio.wrap_future(self._actor.report.remote().future())
            except Exception as exc:  # Ray's errors, whatever their kind: the next call may answer
                logger.debug("%s: no report from its Ray actor: %s", self.spec.job_id, exc)
            else:
                if isinstance(raw, dict):
                    self._report.update(raw)
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def _stop_polling(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reporter

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
        await self._stop_polling()

    def rss_bytes(self) -> int | None:
        """The actor's resident memory as it last reported; None once it has ended."""
        rss = self._report.get("rss_bytes")
        return rss if self.outcome is None and isinstance(rss, int) else None

    def progress(self) -> dict[str, Any]:
        """What the generator last reported (the toolkit's counts), kept once it has ended."""
        progress = self._report.get("progress")
        return progress if isinstance(progress, dict) else {}

    def describe(self) -> dict[str, Any]:
        outcome = self.outcome
        return {
            "index": self.spec.index,
            "ray_actor": None if self._actor is None else self._actor._actor_id.hex(),
            "pid": self.pid,
            "rss_bytes": self.rss_bytes(),
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
