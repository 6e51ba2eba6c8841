"""Running generators in the background, as jobs with a status.

By default (``isolation="process"``) a job's generator runs in worker processes of its own
(``buffer.workers``): ``num_workers`` of them (default 1), each in its own process group, each
taking its work from the service's lease board (``buffer.workers.leases``, ``data["leases"]``;
toolkit generators). A worker that fails or exits fails the job with what happened (its
exception and where, or its exit code) and stops the others; the service carries on. A cancel
stops every worker's whole group, SIGTERM then SIGKILL after ``grace_s``, and returns only once
they are gone: a restart never runs two at once.

A worker lost is not a bug of the generator: killed by SIGKILL (the OOM killer, an operator),
a Ray actor that died, or a worker that stopped renewing its leases for ``lease_ttl_s`` (its
event loop blocked; the service kills it first, so it cannot write what another now makes).
Its items go back on the board for the others, and a new worker takes its place (at most
``MAX_WORKER_RESTARTS`` times; after that the others carry on without it): no group is lost,
none is made twice.

With ``isolation="inline"`` (tests, debugging) an async ``run_rollout`` runs as a task on the
service's event loop; a sync one in a thread of its own (a generator may run for hours, so it
must not hold a slot of a shared pool). Every job is owned: it has a status, its failure is
logged with the traceback and kept on the job (its description says only ``where`` it
happened: no traceback reaches a client), and shutdown cancels and awaits what still runs.

Inline, Python cannot stop a thread, so cancelling a sync generator is cooperative: the job turns
``cancelled`` at once, and the generator can see ``current_job().cancel_requested``
(``buffer.current``) and return. An async generator is cancelled outright.

A ``Job`` is a ``buffer.current.JobContext`` with the service's bookkeeping added (status,
timings, error, workers): inline, the generator's ``current_job()`` is the job itself, so what
it reports (``progress``) and what it is told (the cancel) need no copying between two objects,
while the generator side imports only the ``JobContext`` leaf, never this module. An inline job
is handed a ``LocalSink`` of the service's buffer as its ``writer`` and the lease board.

A job whose trajectories the buffer refused as invalid fails, saying how many, even if its
generator caught the errors and returned (``JobContext.refusal``; in a worker process too).

With a data folder, the jobs running when the service stops run again after its restart
(``resume``), each given in ``data["resume"]`` what it had produced (the buffer's
``resume_point``) so it makes only what is missing. A job that was running at
``MAX_CRASHES`` stops in a row without a clean shutdown and without writing a trajectory
between them (a generator that kills the process, or exhausts its memory, before it makes
anything) is not resumed again: it is listed as failed, with the reason. A crash after the job
wrote since its last start counts as the first again: a long run killed now and then goes on.

A job that did not finish (failed, cancelled, not resumed) is continued by the next start of
the same generator with the same plan (``plan_of``: the data set, epochs, repeats, seed,
shuffle, keys and skips): it is given the same ``data["resume"]`` and makes only what is
missing, unless the start says ``restart`` or brings its own ``resume``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import functools
import importlib.util
import itertools
import logging
import os
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from buffer import paths
from buffer.core.registry import Generator, GeneratorRegistry, where
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.current import JobContext, running
from buffer.errors import InvalidInput, UnknownJob
from buffer.keys import API_KEY_VARIABLE
from buffer.lease_terms import lease_settings
from buffer.logs import outside_request
from buffer.policy.state import follow_policy
from buffer.service.engine_check import EngineStatus, watch_engines
from buffer.service.job_address import SERVICE_URL_FIELD, rehomed
from buffer.service.job_policy import JobPolicy
from buffer.service.local_sink import LocalSink
from buffer.service.plans import plan_of
from buffer.workers import ray_worker
from buffer.workers.leases import LeaseBoard
from buffer.workers.process import WorkerOutcome, WorkerProcess
from buffer.workers.progress import merged_reports
from buffer.workers.ray_worker import RayWorker
from buffer.workers.spec import WorkerSpec

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0  # how long a cancel waits for an inline async generator to stop
#: At most this many worker processes per job.
MAX_WORKERS = 64
#: The /start_rollout fields the service reads to run a job (not the generator): known for every
#: generator, including one that lists the fields it reads in ``START_ROLLOUT_FIELDS``.
JOB_FIELDS = frozenset({"num_workers", "ray_address", "lease_ttl_s"})
#: A job's worker lost (killed, hung) is replaced at most this many times.
MAX_WORKER_RESTARTS = 2
#: A job's worker silent this long (no claim, no heartbeat) is taken for hung (``lease_ttl_s``).
DEFAULT_LEASE_TTL_S = 30.0
#: After a worker is gone, how long its last writes have to reach the buffer before its items
#: are handed to others (a write it sent just before it died is still read from the socket).
RELEASE_SETTLE_S = 0.5
Isolation = Literal["process", "inline"]
#: A job running at this many crashes of the service in a row, with no trajectory written
#: between them, is not resumed again.
MAX_CRASHES = 2


class JobStatus(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(eq=False, kw_only=True)
class Job(JobContext):
    """A job as the service keeps it: the generator's ``JobContext`` and what only the service
    reads (the fields below are keyword-only: they follow the context's)."""

    #: The task's count of written trajectories when the job started (``counters.written``).
    written_at_start: int = 0
    status: JobStatus = JobStatus.RUNNING
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    error: str | None = None
    traceback: str | None = None  # for the log only
    where: str | None = None  # the innermost frame of the generator's code
    workers: list[WorkerProcess | RayWorker] = field(default_factory=list, repr=False)
    restarts: int = 0  # of its workers, after one was lost
    #: What the probes of its ``remote_engine_url`` found while it runs (``EngineWatch``).
    engine: EngineStatus | None = None
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.status is not JobStatus.RUNNING

    def reported_progress(self) -> dict[str, Any]:
        """What its generator last reported (the toolkit's counts): its workers' reports
        (``buffer.workers.progress``) added up, those of workers it replaced included, or,
        inline, its own. What ``/jobs``, ``/metrics`` and the dashboard all show."""
        if not self.workers:
            return dict(self.progress)  # a generator thread may be updating it
        return merged_reports([(worker.progress(), worker.outcome is not None) for worker in self.workers])

    def describe(self, written_now: int) -> dict[str, Any]:
        end = self.finished_at or time.time()
        return {
            "id": self.id,
            "task_type": self.task_type,
            "generator_file": self.generator_file,
            "status": self.status.value,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "duration_s": round(end - self.started_at, 3),
            "counters": {"written": written_now - self.written_at_start},
            "progress": self.reported_progress(),
            "error": self.error,
            "where": self.where,
            "workers": [worker.describe() for worker in self.workers],
            "worker_restarts": self.restarts,
            "engine": self.engine.describe() if self.engine else None,
            "warning": self.engine.warning() if self.engine and not self.done else None,
        }


class JobManager:
    def __init__(
        self,
        buffer: RolloutBuffer,
        buffer_url: str,
        keep: int = 1000,
        *,
        policy: JobPolicy | None = None,
        isolation: Isolation = "process",
        grace_s: float = 5.0,
        api_key: str | None = None,
        log_level: str = "info",
        log_levels: dict[str, str] | None = None,
        ray_address: str | None = None,
        worker_env_api_key: bool = False,
        check_engines: bool = True,
    ) -> None:
        """``api_key``: the service's own, given to its workers (in their spec) to write back
        to it; ``ray_address``: run workers as Ray actors there (a job's ``ray_address`` too);
        ``worker_env_api_key``: put the key in the workers' environment too (for a generator
        whose own subprocesses write), where by default it is not; ``check_engines``: probe a
        job's engines while it runs (``buffer.service.engine_check``), unless it runs on Ray."""
        self.isolation = isolation
        self.ray_address = ray_address
        self._api_key = api_key
        self.grace_s = grace_s
        self._log_level = log_level
        self._log_levels = dict(log_levels or {})
        self._worker_env_api_key = worker_env_api_key
        self._worker_env = _worker_env(api_key if worker_env_api_key else None)
        self._locks: dict[str, asyncio.Lock] = {}
        #: Work leases: a job's workers, and remote ones (``rollout-buffer worker --leases``), of
        #: as many tasks as the buffer keeps (``--max-tasks``).
        self.leases = LeaseBoard(max_tasks=buffer.max_tasks, settle_at_start=bool(buffer.task_types()))
        self._buffer = buffer
        self._buffer_url = buffer_url
        self.policy = policy or JobPolicy(input_roots=(Path.cwd(),))
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._ids = itertools.count(1)
        self._keep = keep
        self._stopping = False
        self.check_engines = check_engines
        #: Each running job's ``EngineWatch`` task.
        self._watches: set[asyncio.Task[None]] = set()

    async def check(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` as a job may run it (``JobPolicy.check``): call before ``start``."""
        checked = await self.policy.check(data, self._buffer_url)
        workers = checked.get("num_workers", 1)
        if isinstance(workers, str) and workers.isdigit():  # slime sends numbers as strings
            workers = int(workers)
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise InvalidInput.one("num_workers", f"a whole number from 1 to {MAX_WORKERS}, not {workers!r}")
        if workers > 1 and self.isolation == "inline":
            raise InvalidInput.one("num_workers", "more than 1 needs worker processes; jobs run inline here")
        checked["num_workers"] = workers
        ttl_s = checked.get("lease_ttl_s", DEFAULT_LEASE_TTL_S)
        try:
            ttl_s = float(ttl_s)
        except (TypeError, ValueError):
            ttl_s = -1.0
        if isinstance(checked.get("lease_ttl_s"), bool) or not 0 < ttl_s <= 3600:
            raise InvalidInput.one("lease_ttl_s", "seconds, more than 0 and at most 3600")
        checked["lease_ttl_s"] = ttl_s
        checked[SERVICE_URL_FIELD] = self._buffer_url  # a job resumed elsewhere: ``rehomed``
        ray_address = checked.get("ray_address")
        if ray_address is not None and not (isinstance(ray_address, str) and ray_address):
            raise InvalidInput.one("ray_address", "a Ray cluster's address, e.g. ray://head:10001, or local")
        if (ray_address or self.ray_address) and importlib.util.find_spec("ray") is None:
            raise InvalidInput.one(
                "ray_address", "Ray is not installed here: pip install 'rollout-buffer[ray]'"
            )
        return checked

    def engines_checked(self, data: dict[str, Any]) -> bool:
        """Whether the service probes the engines of a job of ``data`` (not on Ray: its engines
        may be reachable only from the cluster)."""
        return self.check_engines and not (data.get("ray_address") or self.ray_address)

    def lock(self, name: str) -> asyncio.Lock:
        """Held while a job of the task ``name`` is being started or replaced, so two requests
        at once never leave two running."""
        return self._locks.setdefault(name, asyncio.Lock())

    def start(
        self, generator: Generator, data: dict[str, Any], *, name: str | None = None, restart: bool = False
    ) -> Job:
        """Run ``generator.run_rollout(data)`` in the background, as the buffer task ``name``
        (default: the generator's task type), ``data`` as ``check`` returned it. Call on the
        event loop.

        Where the task's last job, of this generator and plan, did not finish, this one
        continues it: ``data["resume"]`` says what that one made, as for a job resumed after a
        restart. Not with ``restart`` (the whole plan again), nor when ``data`` brings its own
        ``resume``."""
        task_type = name or generator.task_type
        plan = plan_of(data)
        continues = (
            not restart
            and "resume" not in data
            and self._buffer.job_continues(task_type, generator.task_type, plan)
        )
        if continues:
            data["resume"] = self._buffer.resume_point(task_type)
        job = self._new_job(task_type, str(generator.path), data)
        self._buffer.job_started(task_type, generator.task_type, data, plan=plan, resumed=continues)
        self._launch(job, generator)
        logger.info(
            "%s: started %s (%s)%s",
            job.id,
            task_type,
            generator.path,
            ", making what its unfinished job did not" if continues else "",
        )
        return job

    async def resume(self, registry: GeneratorRegistry, *, enabled: bool = True) -> list[Job]:
        """Start again the jobs the buffer restored as running (``enabled``; else forget them),
        each to make only what its earlier runs did not; fail those caught in a crash loop.

        Each resume is on disk before its generator runs: one that kills the process at once
        still counts as a crash."""
        jobs: list[Job] = []
        launches: list[tuple[Job, Generator]] = []
        for task_type, spec in list(self._buffer.jobs.items()):
            generator = registry.generators.get(spec["generator"])
            if not enabled or generator is None:
                if enabled:
                    logger.error("not resuming %s: no generator %r now", task_type, spec["generator"])
                self._buffer.job_ended(task_type, finished=False)  # a start of its plan continues it
                continue
            crashes = self._buffer.crashes_if_resumed(task_type)
            if crashes >= MAX_CRASHES:
                reason = (
                    f"the service stopped without shutting down {crashes} times in a row while this "
                    "job ran, with no trajectory written in between (a generator that kills the "
                    "process or exhausts its memory?)"
                )
                jobs.append(self._not_resumed(task_type, generator, spec["data"], reason))
                continue
            try:
                data = await self.check(spec["data"])
            except InvalidInput as exc:  # the policy changed since it started
                jobs.append(self._not_resumed(task_type, generator, spec["data"], exc.message))
                continue
            data = await rehomed(data, spec["data"].get(SERVICE_URL_FIELD), self._buffer_url)
            self._buffer.job_resumed(task_type, crashes)
            data["resume"] = self._buffer.resume_point(task_type)
            job = self._new_job(task_type, str(generator.path), data)
            launches.append((job, generator))
            jobs.append(job)
            logger.info(
                "%s: resuming the %s rollout that was running when the service %s",
                job.id,
                task_type,
                "crashed" if crashes else "stopped",
            )
        await self._buffer.wait_durable()
        for job, generator in launches:
            self._launch(job, generator)
        return jobs

    def _not_resumed(self, task_type: str, generator: Generator, data: dict[str, Any], why: str) -> Job:
        job = self._new_job(task_type, str(generator.path), data)
        reason = (
            f"not resumed: {why}; /start_rollout with the same plan makes what it did not "
            '(with "restart": true, the whole plan again)'
        )
        self._finish(job, JobStatus.FAILED, reason)
        logger.error("%s: %s rollout %s", job.id, task_type, reason)
        return job

    def _new_job(self, task_type: str, generator_file: str, data: dict[str, Any]) -> Job:
        job = Job(
            id=f"job-{next(self._ids)}",
            task_type=task_type,
            generator_file=generator_file,
            data=data,
            buffer_url=self._buffer_url,
            api_key_hosts=self.policy.api_key_hosts,
            written_at_start=self._buffer.written(task_type),
        )
        self._jobs[job.id] = job
        self._forget_old()
        return job

    def _launch(self, job: Job, generator: Generator) -> None:
        # Started or resumed after a restart alike: its generator follows the policy, admitted.
        consumed = functools.partial(self._buffer.consumed_groups, job.task_type)
        follow_policy(self._buffer.policy, self._buffer_url, job.task_type, job.data, consumed)
        run = self._run_workers if self.isolation == "process" else self._run
        loop, outside = asyncio.get_running_loop(), outside_request()  # the job's lines, not the request's
        job._task = loop.create_task(run(job, generator), name=job.id, context=outside)
        if self.engines_checked(job.data):
            job.engine = outside.run(
                watch_engines, job.id, job.data.get("remote_engine_url"), lambda: job.done, self._watches
            )

    async def _run_workers(self, job: Job, generator: Generator) -> None:
        opened = self.leases.open(job.task_type, _settle_s(job.data))
        try:
            failure = await self._run_round(job, generator)
            if failure is not None and not job.done:
                status = JobStatus.CANCELLED if failure.status == "cancelled" else JobStatus.FAILED
                self._finish(job, status, failure.error, at=failure.where)
                logger.error("%s: %s worker %s: %s", job.id, job.task_type, failure.status, failure.error)
        except asyncio.CancelledError:
            await asyncio.shield(self._stop_workers(job))
            self._finish(job, JobStatus.CANCELLED)
            raise
        except Exception as exc:  # a worker could not be started at all
            await self._stop_workers(job)
            self._finish(job, JobStatus.FAILED, f"could not start a worker process: {exc}")
            logger.exception("%s: could not start a worker process", job.id)
        else:
            if not job.done:
                self._finish(job, JobStatus.SUCCEEDED)
                logger.info("%s: %s generator finished", job.id, job.task_type)
        finally:
            self.leases.close(job.task_type, opened, finished=job.status is JobStatus.SUCCEEDED)

    async def _run_round(self, job: Job, generator: Generator) -> WorkerOutcome | None:
        """Run the job's workers until all succeed (None) or one fails (its outcome; the others
        are stopped). A worker lost, or hung past its lease, is replaced: see the docstring."""
        data = job.data
        count = int(data.get("num_workers", 1))
        ttl_s = float(data.get("lease_ttl_s", DEFAULT_LEASE_TTL_S))
        ray_address = data.get("ray_address") or self.ray_address
        # On a Ray cluster, the address the job names for the buffer: reachable from there.
        url = str(data.get("remote_buffer_url") or self._buffer_url) if ray_address else self._buffer_url
        generations = itertools.count()
        running: dict[asyncio.Future[WorkerOutcome], tuple[int, str, WorkerProcess | RayWorker]] = {}
        job.workers = []

        async def spawn(index: int) -> None:
            name = f"{job.id}/{index}.{next(generations)}"
            self.leases.own(job.task_type, name)
            share = _share_of(data, index, count)
            leases = lease_settings(
                name, ttl_s, share.get("num_process", 100), url=url, index=index, count=count
            )
            spec = WorkerSpec(
                job.id,
                job.task_type,
                str(generator.path),
                {**share, "leases": leases},
                url,
                index=index,
                count=count,
                log_level=self._log_level,
                log_levels=self._log_levels,
                api_key_hosts=tuple(sorted(self.policy.api_key_hosts)),
                api_key=self._api_key,
            )
            worker: WorkerProcess | RayWorker
            if ray_address:
                key = self._api_key if self._worker_env_api_key else None
                env = {API_KEY_VARIABLE: key} if key else {}
                worker = RayWorker(spec, str(ray_address), env)
            else:
                worker = WorkerProcess(spec, env=self._worker_env)
            job.workers.append(worker)
            await worker.start()
            running[asyncio.ensure_future(worker.wait())] = (index, name, worker)

        hung: set[str] = set()
        try:
            for index in range(count):
                await spawn(index)
            while running:
                done, _ = await asyncio.wait(
                    running, timeout=min(ttl_s / 4, 1.0), return_when=asyncio.FIRST_COMPLETED
                )
                if job.done:  # cancelled: the cancel stops the workers; let their wait() see it
                    for finished in done:
                        running.pop(finished)
                    continue
                for name in self.leases.expired(job.task_type):
                    stuck = next((w for _, n, w in running.values() if n == name), None)
                    if stuck is not None and name not in hung:
                        hung.add(name)
                        logger.warning(
                            "%s: worker %s has not renewed its leases for %g s: stopping it",
                            job.id,
                            name,
                            ttl_s,
                        )
                        await stuck.stop(0)
                for finished in done:
                    index, name, _ = running.pop(finished)
                    outcome = finished.result()
                    if outcome.status == "succeeded":
                        self.leases.release(job.task_type, name)
                        continue
                    if not (outcome.lost or name in hung):
                        await self._stop_workers(job)  # a bug of the generator: the job fails
                        return outcome
                    await asyncio.sleep(RELEASE_SETTLE_S)
                    released = self.leases.release(job.task_type, name)
                    if job.restarts < MAX_WORKER_RESTARTS:
                        job.restarts += 1
                        logger.warning(
                            "%s: worker %s lost (%s); its %d unmade items go back to the board, and "
                            "a new worker takes its place (%d of %d)",
                            job.id,
                            name,
                            outcome.error,
                            released,
                            job.restarts,
                            MAX_WORKER_RESTARTS,
                        )
                        await spawn(index)
                    elif running:
                        logger.warning(
                            "%s: worker %s lost (%s); the others take its %d unmade items",
                            job.id,
                            name,
                            outcome.error,
                            released,
                        )
                    else:
                        return outcome
            return None
        finally:
            for waiting in running:
                waiting.cancel()

    async def _stop_workers(self, job: Job) -> None:
        await asyncio.gather(*(worker.stop(self.grace_s) for worker in job.workers))

    async def _run(self, job: Job, generator: Generator) -> None:
        with running(job):
            await self._run_inline(job, generator)

    async def _run_inline(self, job: Job, generator: Generator) -> None:
        # In this process the toolkit writes to the buffer and claims from the board itself
        # (``buffer.toolkit.leased.BoardLeases``). Its writer counts refusals on it.
        job.writer = LocalSink(self._buffer, job)
        opened = self.leases.open(job.task_type, _settle_s(job.data))
        job.lease_board = self.leases
        ttl_s = float(job.data.get("lease_ttl_s", DEFAULT_LEASE_TTL_S))
        leases = lease_settings(f"{job.id}/0.0", ttl_s, job.data.get("num_process", 100))
        data = {**job.data, "leases": leases}
        try:
            if generator.is_async:
                await generator.run_rollout(data)
            else:
                await _run_in_own_thread(generator.run_rollout, data, name=job.id)
        except asyncio.CancelledError:
            self._finish(job, JobStatus.CANCELLED)
            raise
        except BaseException as exc:  # a generator may raise anything, SystemExit included
            error = f"{type(exc).__name__}: {exc}"
            self._finish(job, JobStatus.FAILED, error, traceback.format_exc(), where(exc, generator.path))
            logger.error("%s: %s generator failed: %s\n%s", job.id, job.task_type, exc, job.traceback)
            if isinstance(exc, KeyboardInterrupt):
                raise
        else:
            refusal = job.refusal()  # its generator caught them and returned: still no success
            self._finish(job, JobStatus.FAILED if refusal else JobStatus.SUCCEEDED, refusal)
            if refusal:
                logger.error("%s: %s generator returned, but %s", job.id, job.task_type, refusal)
            else:
                logger.info("%s: %s generator finished", job.id, job.task_type)
        finally:
            # A sync generator's tasks ran on its thread's loop, closed by now; the others on this.
            loop = asyncio.get_running_loop()
            for task in job.background:
                with contextlib.suppress(RuntimeError):  # its loop has closed
                    task.get_loop().call_soon_threadsafe(task.cancel)
            await asyncio.gather(*(t for t in job.background if t.get_loop() is loop), return_exceptions=True)
            self.leases.close(job.task_type, opened, finished=job.status is JobStatus.SUCCEEDED)

    def _finish(
        self,
        job: Job,
        status: JobStatus,
        error: str | None = None,
        tb: str | None = None,
        at: str | None = None,
    ) -> None:
        if job.done:  # cancelled already; a late result of its thread changes nothing
            return
        job.status, job.error, job.traceback, job.where = status, error, tb, at
        job.finished_at = time.time()
        if not self._stopping:  # stopped by the service's shutdown: it runs again after a restart
            self._buffer.job_ended(job.task_type, finished=status is JobStatus.SUCCEEDED)

    def _forget_old(self) -> None:
        while len(self._jobs) > self._keep:
            oldest = next((job_id for job_id, job in self._jobs.items() if job.done), None)
            if oldest is None:
                return
            del self._jobs[oldest]

    def running(self, task_type: str) -> Job | None:
        return next(
            (job for job in reversed(self._jobs.values()) if job.task_type == task_type and not job.done),
            None,
        )

    def get(self, job_id: str) -> Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise UnknownJob(job_id) from None

    def list(self) -> list[Job]:
        return list(self._jobs.values())

    def describe(self, job: Job) -> dict[str, Any]:
        return job.describe(self._buffer.written(job.task_type))

    async def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.done:
            return job
        job.request_cancel()
        self._finish(job, JobStatus.CANCELLED)
        if self.isolation == "process":
            # Every worker's group has gone before this returns: nothing writes after a cancel.
            await self._stop_workers(job)
            if job._task is not None:
                job._task.cancel()
                await asyncio.gather(job._task, return_exceptions=True)
        elif job._task is not None:
            job._task.cancel()
            # A generator that catches CancelledError and carries on must not hang the caller
            # (a cancel request, a restart, the service's shutdown).
            done, _ = await asyncio.wait({job._task}, timeout=CANCEL_WAIT_S)
            if not done:
                logger.warning("%s: its generator ignores cancellation; left running", job.id)
        logger.info("%s: cancelled", job.id)
        return job

    async def shutdown(self) -> None:
        """Stop every job; each runs again after a restart, and this stop is no crash."""
        self._stopping = True
        running = [job for job in self._jobs.values() if not job.done]
        for job in running:
            self._buffer.job_paused(job.task_type)
        await asyncio.gather(*(self.cancel(job.id) for job in running))
        for watch in self._watches:
            watch.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)
        await asyncio.to_thread(ray_worker.shutdown)


def _settle_s(data: dict[str, Any]) -> float:
    """How long the board of a resumed job settles (``LeaseBoard.open``): one lease term."""
    return float(data.get("lease_ttl_s", DEFAULT_LEASE_TTL_S)) if "resume" in data else 0.0


def _share_of(data: dict[str, Any], index: int, count: int) -> dict[str, Any]:
    """The data worker ``index`` of ``count`` runs with: its part of ``num_process`` (the
    trajectories in flight are the job's, spread over its workers)."""
    total = data.get("num_process")
    if count == 1 or total is None:
        return data
    total = int(total)
    return {**data, "num_process": max(1, total // count + (1 if index < total % count else 0))}


def _worker_env(api_key: str | None) -> dict[str, str]:
    """A worker's environment: the service's, this package first on its path, without the
    service's key (a worker gets it in its spec, and whatever the generator starts inherits
    this environment) unless ``api_key`` is given (``--worker-env-api-key``)."""
    env = dict(os.environ)
    env.pop(API_KEY_VARIABLE, None)
    root = str(paths.ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if api_key:
        env[API_KEY_VARIABLE] = api_key
    return env


async def _run_in_own_thread(fn: Callable[[dict[str, Any]], Any], data: dict[str, Any], *, name: str) -> Any:
    """Run ``fn(data)`` in a new daemon thread, with this context, and await its result."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def deliver(outcome: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the service stopped first
            loop.call_soon_threadsafe(settle, outcome)

    def target() -> None:
        try:
            result = context.run(fn, data)
        except BaseException as exc:
            deliver(functools.partial(future.set_exception, exc))
        else:
            deliver(functools.partial(future.set_result, result))

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future
