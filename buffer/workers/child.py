"""The worker process: ``python -m buffer.workers.child`` runs one job's generator.

The service starts it in a process group of its own with the job's ``WorkerSpec`` on stdin.
It imports the generator file afresh, runs ``run_rollout(data)`` (sync or async: the same
files as in the service) with ``current_job()`` set (a ``buffer.current.JobContext`` built from
the spec), so the toolkit's sink writes back to the service over HTTP, and leaves its outcome
in ``result_file`` before it exits: 0 when the generator returned, 1 when it raised (the file
says what and where), 2 when it was cancelled. Its generator's progress goes to the service
down a pipe, its last report before it exits (``buffer.workers.progress``). It imports nothing
of the service: a worker's own machinery is a dozen modules, so it starts in tens of
milliseconds.

SIGTERM is a cancel: an async generator's task is cancelled, a sync one gets ``Cancelled``
raised in its thread (and ``current_job().cancel_requested`` turns true). The service kills
the whole group after its grace period whatever the generator does.

Nothing of a job outlives its worker, nor a worker its service (``lineage``): the worker is a
child subreaper, so a process its generator detaches (``setsid``, a double fork) stays below it,
and every process below it is killed when it exits. The service starts it through a bootstrap
(``buffer.workers.process``) whose first line has the kernel SIGKILL it when the service dies,
and which exits at once if the service is gone already; once its generator could have started
anything, that is handed over to a lifeline, a pipe whose write end only the service holds:
at its end of file (the service killed outright, so it could not stop its workers), the worker
kills every process below it and its group, itself included. Nothing keeps writing for a
service that will not come back as the same process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from buffer.core.registry import Generator, LoadError, load_generator, where
from buffer.current import JobContext, running
from buffer.logs import configure_logging
from buffer.workers.lineage import (
    become_subreaper,
    kill_descendants,
    reap_children,
    set_parent_death_signal,
    watch_lifeline,
)
from buffer.workers.progress import ProgressPipe, Report, ReportedProgress
from buffer.workers.spec import WorkerSpec

logger = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_CANCELLED = 2
ORPHAN_CHECK_S = 0.5


class Cancelled(BaseException):
    """Raised in a sync generator's thread when the service cancels the job."""


def main(parent: int | None = None, lifeline: int | None = None, progress: int | None = None) -> None:
    """Run the job's generator: the ``WorkerSpec`` on stdin; ``parent``, the service's pid,
    ``lifeline``, the read end of its pipe (both None run by hand: its parent then);
    ``progress``, the write end of the pipe its reports go down (``buffer.workers.progress``)."""
    become_subreaper()
    _watch_parent(os.getppid() if parent is None else parent, lifeline)
    set_parent_death_signal(0)  # the lifeline's from now: it takes what the generator starts along
    spec = WorkerSpec.from_json(json.loads(sys.stdin.read()))
    if spec.policy_fd is not None:
        try:
            os.set_inheritable(spec.policy_fd, False)  # what the generator starts holds no copy
        except OSError:  # not passed after all: the generator asks over HTTP
            spec = dataclasses.replace(spec, policy_fd=None)
    configure_logging(spec.log_level, levels=spec.log_levels)
    pipe: ProgressPipe | None = None
    if progress is not None:
        os.set_inheritable(progress, False)  # what the generator starts holds no copy
        pipe = ProgressPipe(progress)
    code = run(spec, report=None if pipe is None else pipe.send)
    if pipe is not None:
        pipe.close()  # its last report is written: the service reads to the end of file
    kill_descendants(os.getpid())  # what the generator left running (detached or not) ends here
    reap_children()  # and what it adopted that exited: not left to the service as zombies
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # threads a generator left behind do not hold the exit up


def run(spec: WorkerSpec, outcome: dict[str, Any] | None = None, report: Report | None = None) -> int:
    """Run the generator ``spec`` names in this process; its exit code (0 when it returned).
    ``outcome`` gets what ``result_file`` would (for a caller in this process); ``report``
    is handed the job's progress at each change, and once more, whole, before this returns."""
    generator = load_generator(Path(spec.generator_file))
    if isinstance(generator, LoadError):
        logger.error(
            "%s: cannot load %s: %s\n%s", spec.job_id, generator.path, generator.error, generator.traceback
        )
        failure = {"status": "failed", "error": generator.error, "where": generator.where}
        _leave(spec, failure)
        if outcome is not None:
            outcome.update(failure)
        return EXIT_FAILED
    data = dict(spec.data, worker={"index": spec.index, "count": spec.count})
    job = JobContext(
        id=spec.job_id,
        task_type=spec.task_type,
        generator_file=spec.generator_file,
        data=data,
        buffer_url=spec.buffer_url,
        in_worker=True,
        api_key_hosts=frozenset(spec.api_key_hosts),
        api_key=spec.api_key,
        policy_channel=spec.policy_fd,
    )
    if report is not None:
        job.progress = ReportedProgress(report)
    with running(job):
        status = _run(generator, job)
    if report is not None:
        report(dict(job.progress))  # the last counts (a generator may have replaced the dict)
    _leave(spec, status)
    if outcome is not None:
        outcome.update(status)
    return {"succeeded": 0, "cancelled": EXIT_CANCELLED}.get(status["status"], EXIT_FAILED)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (the ``fast`` extra; uvicorn[standard] brings it):
    the generator's requests and their parsing are most of a worker's time, and asyncio's own
    loop, in Python, spent a third of it. None: asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _run(generator: Generator, job: JobContext) -> dict[str, Any]:
    try:
        if generator.is_async:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(_run_async(generator, job))
        else:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, lambda sig, frame: _cancel_sync(job, frame))
            generator.run_rollout(job.data)
    except (Cancelled, asyncio.CancelledError):
        return {"status": "cancelled"}
    except BaseException as exc:  # SystemExit and KeyboardInterrupt included: all are failures
        tb = traceback.format_exc()
        logger.error("%s: %s generator failed: %s\n%s", job.id, job.task_type, exc, tb)
        return {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "where": where(exc, generator.path),
        }
    if job.cancel_requested:
        return {"status": "cancelled"}
    refusal = job.refusal()  # its sinks had trajectories refused, and it returned regardless
    if refusal is not None:
        logger.error("%s: %s generator returned, but %s", job.id, job.task_type, refusal)
        return {"status": "failed", "error": refusal, "where": None}
    return {"status": "succeeded"}


async def _run_async(generator: Generator, job: JobContext) -> None:
    task = asyncio.current_task()
    assert task is not None

    def cancel() -> None:
        job.request_cancel()
        task.cancel()

    if threading.current_thread() is threading.main_thread():
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, cancel)
    await generator.run_rollout(job.data)


def _cancel_sync(job: JobContext, frame: FrameType | None) -> None:
    if os.getpid() != _own_pid:  # a process the generator forked: just stop
        os._exit(EXIT_CANCELLED)
    job.request_cancel()
    raise Cancelled


_own_pid = os.getpid()


def _watch_parent(parent: int, lifeline: int | None) -> None:
    """Kill every process below this one, and this process group, once the service that
    started it is gone: at the end of file of ``lifeline``, else when its parent changes."""

    def gone() -> None:
        kill_descendants(os.getpid())
        if os.getpgrp() == os.getpid():  # its own group, as the service starts it
            with contextlib.suppress(OSError):
                os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(EXIT_FAILED)

    if lifeline is not None:
        os.set_inheritable(lifeline, False)  # what the generator starts holds no copy
        watch_lifeline(lifeline, gone)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_CHECK_S)
        gone()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def _leave(spec: WorkerSpec, outcome: dict[str, Any]) -> None:
    if not spec.result_file:
        return
    _write_atomically(Path(spec.result_file), json.dumps(outcome))


if __name__ == "__main__":
    main()
