"""A worker process as the service sees it: started, watched, stopped with its whole group.

Each worker is a fresh interpreter (``sys.executable -c BOOTSTRAP``, which runs
``buffer.workers.child``: nothing of the service's state, threads or locks is inherited, as a
``fork`` would), the leader of a new process group (set at ``exec``, so no moment exists where
it could escape a stop), given its ``WorkerSpec`` on stdin. ``stop`` sends SIGTERM to the
group, waits the grace period, then SIGKILL to every process below the worker (it is a child
subreaper: a generator's ``setsid`` daemon is one of them) and to the group: processes the
generator started (``multiprocessing`` pools, shell commands) go with it. When the worker exits
on its own, what it left in its group is killed too.

However the worker ends (SIGKILLed from outside too: the OOM killer, an operator's ``kill -9``,
when it can kill nothing it started), once it has, the service kills every process left of it
(``lineage.end_lineage``): its environment carries a mark of its own (``WORKER_MARK``) that
whatever its generator starts inherits, detached or not, and the service SIGKILLs every process
carrying it (those whose parent died are init's to reap).

A worker dies with its service, however the service ends (``lineage``): the bootstrap's first
line asks the kernel to SIGKILL it when the service dies, before it imports anything, and it
exits if its parent is no longer the service that started it (gone before that line ran); the
service holds the write end of a pipe (the lifeline) whose end of file tells the worker,
once its generator runs, to kill all it started and itself.

Its stdout and stderr come to the service's log line by line, capped (``output``); its
generator's progress comes down a pipe of its own, read to the end (``progress``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.policy.channel import serve_worker
from buffer.policy.state import find_policy
from buffer.workers.lineage import WORKER_MARK, end_lineage, kill_descendants, new_mark
from buffer.workers.output import WorkerOutput
from buffer.workers.progress import receive
from buffer.workers.spec import WorkerSpec

logger = logging.getLogger(__name__)

#: The outcome a worker writes for each way it can end (``child``'s exit codes).
_EXIT_STATUS = {0: "succeeded", 2: "cancelled"}
#: How long a stop waits, after SIGKILL, for the group's processes to be gone.
KILL_WAIT_S = 2.0
#: How long, once a worker has exited, its output readers may take to read what is left.
OUTPUT_DRAIN_S = 2.0
#: A worker's first lines: before anything is imported, the kernel is to SIGKILL it when the
#: service dies (Linux's PR_SET_PDEATHSIG); if the service died before that, it exits. Then the
#: worker proper, given the service's pid and its end of the lifeline. Its arguments: the
#: service's pid, the lifeline's descriptor, its progress pipe's, and the job's id (to tell
#: workers apart in ``ps``).
BOOTSTRAP = """\
import os, sys
parent, lifeline, progress = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if sys.platform == "linux":
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
if os.getppid() != parent:  # the service is gone already
    os._exit(1)
from buffer.workers.child import main
main(parent, lifeline, progress)
"""


@dataclass(slots=True)
class WorkerOutcome:
    """How a worker ended: its status, and for a failure, what happened and where."""

    status: str  # succeeded | failed | cancelled
    returncode: int | None
    error: str | None = None
    where: str | None = None
    #: Lost rather than failed: killed from outside (SIGKILL: the OOM killer, an operator) or
    #: its Ray actor died; the job replaces it instead of failing.
    lost: bool = False


@dataclass(eq=False)
class WorkerProcess:
    spec: WorkerSpec
    env: dict[str, str] | None = None
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    outcome: WorkerOutcome | None = None
    _directory: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    _progress: dict[str, Any] = field(default_factory=dict, repr=False)
    #: Reads its progress pipe to the end (``_keep_progress``).
    _receiver: asyncio.Task[None] | None = field(default=None, repr=False)
    #: The write end of its lifeline: closed when it has exited (or with this process).
    _lifeline: int | None = field(default=None, repr=False)
    _output: list[asyncio.Task[None]] = field(default_factory=list, repr=False)
    #: Its ``WORKER_MARK``: in its environment, and so in that of everything it starts.
    _mark: str = field(default="", repr=False)
    #: Serves its admission socket (``buffer.policy.channel``) until its end closes.
    _admission: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def start(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix=f"rollout-{self.spec.job_id}-")
        directory = Path(self._directory.name)
        spec = self.spec = dataclasses.replace(
            self.spec,
            result_file=str(directory / "outcome.json"),
        )
        # Pipes of its own, none inherited (the worker's ends are passed): its output's are not
        # asyncio's, whose wait() would wait for every process holding them to close them.
        lifeline, self._lifeline = os.pipe()
        self._mark = new_mark(f"{spec.job_id}/{spec.index}")
        env = {**(os.environ if self.env is None else self.env), WORKER_MARK: self._mark}
        (stdout, stdout_end), (stderr, stderr_end) = os.pipe(), os.pipe()
        progress, progress_end = os.pipe()
        # Admission pushed down a socket of its own, when the buffer it writes to is this
        # service's (``buffer.policy.channel``): no HTTP round trip per room.
        policy = find_policy(spec.buffer_url)
        admission: tuple[socket.socket, socket.socket] | None = None
        if policy is not None:
            admission = socket.socketpair()
            spec = self.spec = dataclasses.replace(spec, policy_fd=admission[1].fileno())
        passed = (lifeline, progress_end, *([] if admission is None else [admission[1].fileno()]))
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",  # not the working folder first on its path: slime's has a buffer.py of its own
                "-c",
                BOOTSTRAP,
                str(os.getpid()),
                str(lifeline),
                str(progress_end),
                spec.job_id,
                stdin=asyncio.subprocess.PIPE,
                stdout=stdout_end,
                stderr=stderr_end,
                env=env,
                pass_fds=passed,
                start_new_session=True,  # its own session and process group, set at exec
            )
        except BaseException:
            self._close_lifeline()
            os.close(stdout)
            os.close(stderr)
            os.close(progress)
            if admission is not None:
                admission[0].close()
            raise
        finally:
            for end in (lifeline, stdout_end, stderr_end, progress_end):
                os.close(end)
            if admission is not None:
                admission[1].close()
        name = f"{spec.job_id}/{spec.index}"
        if admission is not None and policy is not None:
            self._admission = asyncio.create_task(
                serve_worker(policy, admission[0], name), name=f"{name}-admission"
            )
        output = WorkerOutput(name)
        self._output = [
            asyncio.create_task(output.forward(stdout, logging.INFO), name=f"{name}-stdout"),
            asyncio.create_task(output.forward(stderr, logging.WARNING), name=f"{name}-stderr"),
        ]
        self._receiver = asyncio.create_task(
            receive(progress, self._keep_progress, name), name=f"{name}-progress"
        )
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(spec.to_json()).encode())
        with contextlib.suppress(ConnectionError):  # it died at once: wait() tells how
            await self.process.stdin.drain()
        self.process.stdin.close()
        logger.info("%s: worker %d/%d started, pid %d", spec.job_id, spec.index + 1, spec.count, self.pid)

    async def wait(self) -> WorkerOutcome:
        """Wait until it exits; kill what it left (``_end_lineage``); say how it ended."""
        assert self.process is not None
        try:
            code = await self.process.wait()
            self._kill_group(signal.SIGKILL)
            await self._end_lineage()
            self._close_lifeline()
            await self._end_output()
            await self._progress_received()  # its last word
            await self._admission_ended()
            self.outcome = self._read_outcome(code)
            return self.outcome
        finally:  # cancelled too (the service stopping): its folder goes with it
            if self._directory is not None:
                self._directory.cleanup()
                self._directory = None

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to its group, SIGKILL after ``grace_s``; returns once it has exited."""
        if self.process is None or self.process.returncode is not None:
            self._kill_group(signal.SIGKILL)
            return
        self._kill_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), grace_s)
        except TimeoutError:
            logger.warning(
                "%s: worker pid %d still running %g s after SIGTERM: killing its process group",
                self.spec.job_id,
                self.pid,
                grace_s,
            )
        if self.process.returncode is None:  # below it, while it lives: a subreaper's orphans too
            await asyncio.to_thread(kill_descendants, self.process.pid)
        self._kill_group(signal.SIGKILL)
        code = await self.process.wait()
        await self._end_lineage()
        # A signal is delivered when its process next runs: until then, one of its processes may
        # still send a write. Return once none is left (zombies, dead already, do not count).
        for _ in range(int(KILL_WAIT_S / 0.02)):
            if not await asyncio.to_thread(group_alive, self.process.pid):
                break
            await asyncio.sleep(0.02)
        await self._progress_received()
        await self._admission_ended()
        if self.outcome is None:  # how it ended, said now: the task in ``wait`` may be cancelled next
            self.outcome = self._read_outcome(code)

    def rss_bytes(self) -> int | None:
        """Its resident memory (Linux), None once it has exited."""
        if self.process is None or self.process.returncode is not None:
            return None
        return rss_of(self.process.pid)

    def progress(self) -> dict[str, Any]:
        """What the generator last reported (the toolkit's counts), kept once it has exited."""
        return self._progress

    def _keep_progress(self, report: dict[str, Any]) -> None:
        self._progress = report

    async def _progress_received(self) -> None:
        """Once it has exited: read its last report (the end of its progress pipe; a process
        it left holding the pipe does not hold this up past ``OUTPUT_DRAIN_S``)."""
        receiver = self._receiver
        if receiver is None:
            return
        done, _ = await asyncio.wait({receiver}, timeout=OUTPUT_DRAIN_S)  # (never cancels it)
        if not done:
            receiver.cancel()
        elif not receiver.cancelled() and receiver.exception() is not None:
            logger.warning("%s: its progress could not be read: %s", self.spec.job_id, receiver.exception())

    async def _admission_ended(self) -> None:
        """Once it has exited: its admission socket's end closed, what it was granted and did
        not take is released (within ``OUTPUT_DRAIN_S``, else at once)."""
        serving, self._admission = self._admission, None
        if serving is None:
            return
        done, _ = await asyncio.wait({serving}, timeout=OUTPUT_DRAIN_S)
        if not done:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving

    def describe(self) -> dict[str, Any]:
        outcome = self.outcome
        return {
            "index": self.spec.index,
            "pid": self.pid,
            "rss_bytes": self.rss_bytes(),
            "status": "running" if outcome is None else outcome.status,
            "exit": None if outcome is None else exit_text(outcome.returncode),
        }

    async def _end_lineage(self) -> None:
        """Once it has exited: SIGKILL every process left of it, wherever it went (``setsid``,
        re-parented to this service or to init), and reap those this service adopted."""
        assert self.process is not None
        if not await asyncio.to_thread(end_lineage, self._mark, self.process.pid):
            logger.warning("%s: processes of worker pid %d outlived it", self.spec.job_id, self.pid)

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                os.close(self._lifeline)
            self._lifeline = None

    async def _end_output(self) -> None:
        """Let its output readers take what is left in the pipes (what it left running in its
        group is dead by now; a detached process holding a pipe does not hold this up)."""
        if not self._output:
            return
        _, pending = await asyncio.wait(self._output, timeout=OUTPUT_DRAIN_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._output, return_exceptions=True)
        self._output = []

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def _read_outcome(self, code: int) -> WorkerOutcome:
        raw: dict[str, Any] = {}
        if self.spec.result_file:
            with contextlib.suppress(OSError, ValueError):
                raw = json.loads(Path(self.spec.result_file).read_text())
        status = raw.get("status") or _EXIT_STATUS.get(code, "failed")
        error = raw.get("error")
        if status == "failed" and error is None:  # it could not say: killed, or os._exit
            error = f"the worker process {exit_text(code)}"
        return WorkerOutcome(status, code, error, raw.get("where"), lost=code == -signal.SIGKILL)


def rss_of(pid: int) -> int | None:
    """The resident memory of process ``pid`` (Linux's /proc; None elsewhere or once gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` still runs (Linux's /proc; elsewhere: whether
    the group can still be signalled)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def exit_text(code: int | None) -> str | None:
    """``exited with code 3``, ``was killed by SIGKILL``."""
    if code is None:
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
