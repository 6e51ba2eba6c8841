"""Nothing of a job survives its worker SIGKILLed from outside (the OOM killer, an operator's
``kill -9``), which can kill nothing it started: a process its generator detached (``setsid``,
even one that keeps forking away) is killed by the service, which reaps it if it adopted it,
and writes nothing more; the service's own other children are left alone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from buffer.paths import ROOT
from buffer.processes import free_port, wait_ready
from buffer.workers import lineage
from buffer.workers.lineage import WORKER_MARK
from tests.support.calls import wait_for
from tests.workers.test_orphans import alive, run_worker, service_command, wait_for_file

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and uses Linux's child subreapers"),
]

# Forks away for ever: each generation forks, leaves its session and lets its parent exit,
# noting its pid; the last argument names it in ``ps`` (and here, in /proc/*/cmdline).
HOPPER = (
    "import os, sys, time\n"
    "while True:\n"
    "    if os.fork():\n"
    "        os._exit(0)\n"
    "    os.setsid()\n"
    "    with open(sys.argv[1], 'a') as f:\n"
    "        f.write(f'{os.getpid()}\\n')\n"
    "    time.sleep(0.02)\n"
)

# Starts a hopper and a sleeper, each in a session of its own, notes the sleeper's pid, waits
# for the hopper's first, then waits to be killed.
HOPPING = """
import os, subprocess, sys, time

TASK_TYPE = "hopping"
START_ROLLOUT_FIELDS = ('marker', 'pids', 'sleeper')

def run_rollout(data):
    subprocess.Popen([sys.executable, "-c", {hopper!r}, data["pids"], data["marker"]], start_new_session=True)
    sleep = "import time; time.sleep(300)"
    sleeper = subprocess.Popen([sys.executable, "-c", sleep, data["marker"]], start_new_session=True)
    with open(data["sleeper"], "w") as f:
        f.write(str(sleeper.pid))
    while not os.path.exists(data["pids"]):
        time.sleep(0.01)
    while True:
        time.sleep(0.1)
"""

# Detaches a process (a double fork) that exits at once, waits until it is a zombie of the
# worker (which adopted it), then returns.
OUTLIVED = """
import os, subprocess, sys, time

TASK_TYPE = "outlived"
START_ROLLOUT_FIELDS = ('pidfile',)

def run_rollout(data):
    code = "import os, sys\\nif os.fork(): os._exit(0)\\nos.setsid()\\nprint(os.getpid(), flush=True)"
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    with open(data["pidfile"], "w") as f:
        f.write(str(pid))
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
"""

# The first worker detaches a daemon that writes a trajectory every 20 ms to the buffer; the
# worker that replaces it (lost: SIGKILLed) detaches nothing and writes nothing.
ORPHAN_WRITER = """
import asyncio, os, subprocess, sys
from buffer.current import current_job

TASK_TYPE = "orphan_writer"

DAEMON = '''
import os, sys, time, httpx
url, n = sys.argv[1], 0
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
with httpx.Client(trust_env=False, timeout=5) as client:
    while True:
        n += 1
        client.post(url + "/buffer/write", json={{
            "instance_id": f"orphan-{{n}}", "uid": f"orphan-{{n}}", "task_type": "orphan_writer",
            "messages": [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "a"}}],
            "reward": 1.0,
        }})
        time.sleep(0.02)
'''

async def run_rollout(data):
    if not os.path.exists({pidfile!r}):
        command = [sys.executable, "-c", DAEMON, current_job().buffer_url, {pidfile!r}]
        subprocess.Popen(command, start_new_session=True)
    await asyncio.sleep(3600)
"""


def running_with(marker: str) -> list[int]:
    """The processes whose command line has ``marker`` (a zombie's is empty)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes().split(b"\0"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def in_proc(pid: int) -> bool:
    """Whether ``pid`` is still in /proc: running, or a zombie no one has reaped."""
    return Path(f"/proc/{pid}").exists()


@pytest.fixture
def subreaper() -> Iterator[None]:
    """This process a child subreaper for the test, so that what a worker leaves comes here and
    shows as its zombie; not after it (a later test's orphans are init's, as the service's are)."""
    assert lineage.become_subreaper()
    yield
    lineage._prctl(lineage._PR_SET_CHILD_SUBREAPER, 0)


@pytest.fixture
def hopper_pids(tmp_path: Path) -> Iterator[Path]:
    pids = tmp_path / "hopper.pids"
    yield pids
    if pids.exists():  # whatever the test left behind
        for line in pids.read_text().split():
            if alive(int(line)):
                os.kill(int(line), signal.SIGKILL)


async def test_a_detached_process_ends_with_its_worker_sigkilled_from_outside(
    tmp_path: Path, hopper_pids: Path, subreaper: None
) -> None:
    # The hopper's generations come to this process (a subreaper): the kill must find them here.
    marker = f"hopper-{os.getpid()}-{time.monotonic_ns()}"
    sleeper = tmp_path / "sleeper.pid"
    data = {"pids": str(hopper_pids), "marker": marker, "sleeper": str(sleeper)}
    # The service's own children, which no worker's end may touch: one in its session, one not.
    bystanders = [
        await asyncio.create_subprocess_exec("sleep", "300"),
        await asyncio.create_subprocess_exec("sleep", "300", start_new_session=True),
    ]
    try:
        worker = await run_worker(tmp_path, HOPPING.format(hopper=HOPPER), data)
        await wait_for_file(hopper_pids)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)  # it can kill nothing it started
        outcome = await worker.wait()
        assert outcome.lost, outcome
        # Every generation of the hopper is gone; the sleeper too, and reaped (held by pidfd,
        # re-parented to this process): not left here as a zombie.
        assert not running_with(marker), running_with(marker)
        generations = (await asyncio.to_thread(hopper_pids.read_text)).split()
        assert not [p for p in map(int, generations) if alive(p)]
        assert not in_proc(int(await asyncio.to_thread(sleeper.read_text)))
        assert all(b.returncode is None for b in bystanders)
        assert all(alive(b.pid) for b in bystanders)
    finally:
        for bystander in bystanders:
            bystander.kill()
            await bystander.wait()  # asyncio's own children: their status is still asyncio's
    assert [b.returncode for b in bystanders] == [-signal.SIGKILL, -signal.SIGKILL]


async def test_a_workers_processes_carry_its_mark(tmp_path: Path, hopper_pids: Path) -> None:
    marker = f"hopper-{os.getpid()}-{time.monotonic_ns()}"
    data = {"pids": str(hopper_pids), "marker": marker, "sleeper": str(tmp_path / "sleeper.pid")}
    worker = await run_worker(tmp_path, HOPPING.format(hopper=HOPPER), data)
    first = int((await wait_for_file(hopper_pids)).split()[0])
    environ = await asyncio.to_thread(Path(f"/proc/{first}/environ").read_bytes)
    marks = [e for e in environ.split(b"\0") if e.startswith(WORKER_MARK.encode() + b"=")]
    assert len(marks) == 1, marks
    assert marks[0].startswith(f"{WORKER_MARK}=job-1/0:".encode()), marks
    await worker.stop(0)
    await worker.wait()
    assert not running_with(marker)


async def test_a_worker_leaves_no_zombie_of_what_it_adopted(tmp_path: Path, subreaper: None) -> None:
    pidfile = tmp_path / "outlived.pid"
    worker = await run_worker(tmp_path, OUTLIVED, {"pidfile": str(pidfile)})
    assert (await worker.wait()).status == "succeeded"
    assert not in_proc(int(pidfile.read_text()))  # reaped by the worker, not handed on


@pytest.mark.e2e
def test_a_daemon_of_a_sigkilled_worker_writes_no_more(tmp_path: Path) -> None:
    generators = tmp_path / "generator"
    generators.mkdir()
    pidfile = tmp_path / "daemon.pid"
    (generators / "orphan_writer_generator.py").write_text(ORPHAN_WRITER.format(pidfile=str(pidfile)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "service.log", "ab")  # noqa: SIM115 - closed below
    service = subprocess.Popen(
        service_command(generators, port, tmp_path / "data"), cwd=ROOT, stdout=log, stderr=log
    )
    daemon: int | None = None
    try:
        wait_ready(f"{url}/health", service, 60, "the service")
        answer = httpx.post(f"{url}/start_rollout", json={"task_type": "orphan_writer"}, trust_env=False)
        assert answer.status_code == 200, answer.text

        def written() -> int:
            stats = httpx.get(f"{url}/buffer/stats", trust_env=False).json()
            tasks = stats["data"]["data"]
            return int(tasks[0]["total_written"]) if tasks else 0

        wait_for(lambda: pidfile.exists() and written() >= 3, 60, "the daemon writing")
        daemon = int(pidfile.read_text())
        job = httpx.get(f"{url}/jobs/{answer.json()['job_id']}", trust_env=False).json()
        (worker,) = [w["pid"] for w in job["data"]["workers"] if w["status"] == "running"]
        os.kill(worker, signal.SIGKILL)
        # Killed by the service, once it saw the worker gone (re-parented to init, which reaps it).
        wait_for(lambda: not alive(daemon), 30, f"the daemon {daemon} gone")
        before = written()
        time.sleep(1.0)  # it wrote every 20 ms
        assert written() == before
        assert service.poll() is None
    finally:
        service.terminate()
        service.wait(timeout=30)
        log.close()
        if daemon is not None and alive(daemon):
            os.kill(daemon, signal.SIGKILL)
