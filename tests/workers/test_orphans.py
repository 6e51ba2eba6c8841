"""Nothing of a job outlives it: a worker dies with its service, however early the service is
killed; what a generator detaches (``setsid``, a double fork) ends with its worker; the
service's key is not in a worker's environment unless asked; a worker's output reaches the
service's log capped."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.keys import API_KEY_VARIABLE
from buffer.paths import ROOT
from buffer.processes import free_port, wait_ready
from buffer.service.jobs import _worker_env
from buffer.workers.output import WorkerOutput
from buffer.workers.process import WorkerProcess
from buffer.workers.spec import WorkerSpec
from tests.support.calls import until

# Writes a trajectory every 20 ms, forever; notes each process that runs it.
SLOW_WRITER = """
import asyncio, os
from buffer.toolkit.sink import open_sink

TASK_TYPE = "slow"

async def run_rollout(data):
    with open({pids!r}, "a") as pids:
        pids.write(f"{{os.getpid()}}\\n")
    sink = await open_sink(None)
    n = 0
    while True:
        n += 1
        await sink.write({{
            "instance_id": f"{{os.getpid()}}-{{n}}",
            "uid": f"{{os.getpid()}}-{{n}}",
            "messages": [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "a"}}],
            "reward": 1.0,
        }})
        await asyncio.sleep(0.02)
"""

# A daemon: forks, its parent exits, it leaves the session and sleeps forever.
DAEMON = (
    "import os, sys, time\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "os.setsid()\n"
    "with open(sys.argv[1] + '.tmp', 'w') as f:\n"
    "    f.write(str(os.getpid()))\n"
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "while True:\n"
    "    time.sleep(0.1)\n"
)

# Detaches a daemon, then returns (or, deaf, ignores SIGTERM and sleeps).
DETACHER = """
import os, signal, subprocess, sys, time

TASK_TYPE = "detacher"
START_ROLLOUT_FIELDS = ('deaf', 'pidfile')

def run_rollout(data):
    if data.get("deaf"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.run([sys.executable, "-c", {daemon!r}, data["pidfile"]], start_new_session=True, check=True)
    while not os.path.exists(data["pidfile"]):
        time.sleep(0.01)
    while data.get("deaf"):
        time.sleep(0.1)
"""

# Leaves what its environment and its subprocess's say of the key, and what its sink sends.
KEY_PROBE = """
import json, os, subprocess, sys
from buffer.toolkit.sink import open_sink

TASK_TYPE = "key_probe"
START_ROLLOUT_FIELDS = ('out',)

async def run_rollout(data):
    sink = await open_sink(None)
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('ROLLOUT_BUFFER_API_KEY', ''))"],
        capture_output=True, text=True, check=True,
    )
    with open(data["out"], "w") as out:
        json.dump({
            "env": os.environ.get("ROLLOUT_BUFFER_API_KEY"),
            "subprocess": child.stdout.strip() or None,
            "sink": sink.authorization,
        }, out)
    await sink.aclose()
"""

# Prints without end: 8 MB of short lines, and a 100 KB one.
NOISY = """
import sys

TASK_TYPE = "noisy"

def run_rollout(data):
    line = "x" * 99 + "\\n"
    for _ in range(80_000):
        sys.stdout.write(line)
    sys.stderr.write("y" * 100_000 + "\\n")
    sys.stdout.flush()
    sys.stderr.flush()
"""

pytestmark = pytest.mark.anyio


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead already, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def workers_of(service_pid: int) -> list[int]:
    """The worker processes the service ``service_pid`` started (their command line names it)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        # The bootstrap's first argument, after the code that names buffer.workers.child.
        code = next((i for i, arg in enumerate(args) if b"buffer.workers.child" in arg), None)
        ours = code is not None and args[code + 1 : code + 2] == [str(service_pid).encode()]
        if ours and alive(int(cmdline.parent.name)):
            found.append(int(cmdline.parent.name))
    return found


def none_left(service_pid: int, pids: Path) -> bool:
    """Whether no worker of the service ``service_pid`` runs, nor a process that ran its generator."""
    return not workers_of(service_pid) and not [p for p in pids.read_text().split() if alive(int(p))]


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def slow_writer(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    generators = tmp_path / "generator"
    generators.mkdir()
    pids = tmp_path / "pids.txt"
    pids.touch()
    (generators / "slow_generator.py").write_text(SLOW_WRITER.format(pids=str(pids)))
    yield generators, pids
    for line in pids.read_text().split():  # whatever the test left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line), signal.SIGKILL)


def service_command(generators: Path, port: int, data: Path, *extra: str) -> list[str]:
    address = ["--host", "127.0.0.1", "--port", str(port)]
    return [
        sys.executable,
        "buffer.py",
        *address,
        "--generator-dir",
        str(generators),
        "--data-dir",
        str(data),
        *extra,
    ]


@pytest.mark.e2e
def test_a_service_killed_as_its_workers_start_leaves_none_running(
    slow_writer: tuple[Path, Path], tmp_path: Path
) -> None:
    generators, pids = slow_writer
    port, data = free_port(), tmp_path / "data"
    log = open(tmp_path / "service.log", "ab")  # noqa: SIM115 - closed below
    try:
        for delay_s in (0.0, 0.0, 0.05, 0.2, 0.5, 1.0):  # before, while and after a worker starts
            service = subprocess.Popen(
                service_command(generators, port, data), cwd=ROOT, stdout=log, stderr=log
            )
            try:
                wait_ready(f"http://127.0.0.1:{port}/health", service, 60, "the service")
                answer = httpx.post(
                    f"http://127.0.0.1:{port}/start_rollout",
                    json={"task_type": "slow"},
                    trust_env=False,
                    timeout=30,
                )
                assert answer.status_code == 200, answer.text
                time.sleep(delay_s)
            finally:
                service.kill()
                service.wait()
            wait_until(
                functools.partial(none_left, service.pid, pids),
                60,
                f"workers outlived a service killed {delay_s} s after /start_rollout",
            )
        # Started again on the same port and data: nothing of the old jobs writes to it.
        command = service_command(generators, port, data, "--no-resume-jobs")
        service = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", service, 60, "the service")

            def written() -> int:
                stats = httpx.get(f"http://127.0.0.1:{port}/buffer/stats", trust_env=False, timeout=30).json()
                return int(stats["data"]["data"][0]["total_written"])

            before = written()
            time.sleep(1.0)  # an orphan writes every 20 ms
            assert written() == before
        finally:
            service.terminate()
            service.wait(timeout=30)
    finally:
        log.close()


async def run_worker(
    tmp_path: Path, source: str, data: dict[str, Any], env: dict[str, str] | None = None, **spec: Any
) -> WorkerProcess:
    generator = tmp_path / "probe_generator.py"
    generator.write_text(source)
    worker = WorkerProcess(
        WorkerSpec("job-1", "probe", str(generator), data, "http://127.0.0.1:9", **spec),
        env={**_worker_env(None), **(env or {})},
    )
    await worker.start()
    return worker


async def wait_for_file(path: Path, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(path.exists):
        assert time.monotonic() < deadline, f"no {path}"
        await asyncio.sleep(0.02)
    return await asyncio.to_thread(path.read_text)


async def test_a_daemon_a_generator_detached_ends_when_its_worker_does(tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    worker = await run_worker(tmp_path, DETACHER.format(daemon=DAEMON), {"pidfile": str(pidfile)})
    outcome = await worker.wait()
    assert outcome.status == "succeeded", outcome
    daemon = int(await wait_for_file(pidfile))
    try:
        await until(lambda: not alive(daemon), what="the daemon killed with its worker")
    finally:
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)


async def test_a_daemon_a_generator_detached_ends_when_its_worker_is_stopped(tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    data = {"pidfile": str(pidfile), "deaf": True}
    worker = await run_worker(tmp_path, DETACHER.format(daemon=DAEMON), data)
    daemon = int(await wait_for_file(pidfile))
    try:
        await worker.stop(0.3)  # deaf to SIGTERM: killed, and its daemon with it
        await until(lambda: not alive(daemon), what="the daemon killed with its worker")
        assert (await worker.wait()).status == "failed"
    finally:
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)


DEAF = """
import pathlib, signal, time
TASK_TYPE = "probe"
def run_rollout(data):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pathlib.Path(data["ready"]).write_text("deaf")
    while True:
        time.sleep(0.05)
"""


async def test_a_stopped_worker_says_how_it_ended_though_nobody_waited_for_it(tmp_path: Path) -> None:
    # A cancel answers with the workers' exits once ``stop`` returns; the task waiting in
    # ``wait`` is cancelled right after, so ``stop`` must not leave the telling to it.
    ready = tmp_path / "ready"
    worker = await run_worker(tmp_path, DEAF, {"ready": str(ready)})
    await wait_for_file(ready)
    await worker.stop(0.3)
    assert worker.describe()["exit"] == "was killed by SIGKILL"
    assert (await worker.wait()).status == "failed"


async def test_the_services_key_reaches_the_worker_not_its_environment(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    worker = await run_worker(tmp_path, KEY_PROBE, {"out": str(out)}, api_key="s3cret")
    assert (await worker.wait()).status == "succeeded"
    assert json.loads(out.read_text()) == {"env": None, "subprocess": None, "sink": "Bearer s3cret"}
    assert "s3cret" not in repr(worker)
    # --worker-env-api-key: the variable is back, for a generator's own subprocesses.
    env = _worker_env("s3cret")
    assert env[API_KEY_VARIABLE] == "s3cret"
    out.unlink()
    worker = await run_worker(tmp_path, KEY_PROBE, {"out": str(out)}, env=env, api_key="s3cret")
    assert (await worker.wait()).status == "succeeded"
    assert json.loads(out.read_text()) == {"env": "s3cret", "subprocess": "s3cret", "sink": "Bearer s3cret"}


def test_worker_env_drops_the_key_of_the_services_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_VARIABLE, "service-secret")
    assert API_KEY_VARIABLE not in _worker_env(None)  # the service's own, as its setting reads it


async def test_a_workers_output_reaches_the_log_capped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="buffer.workers.output")
    started = time.monotonic()
    worker = await run_worker(tmp_path, NOISY, {})
    assert (await worker.wait()).status == "succeeded"
    elapsed_s = time.monotonic() - started
    lines = [r for r in caplog.records if r.name == "buffer.workers.output" and "left out" not in r.message]
    logged = sum(len(r.getMessage()) for r in lines)
    assert lines, "nothing of its output was logged"
    assert logged <= 64 * 1024 * (elapsed_s + 1) + 100 * len(lines)  # its tag, on each line
    assert max(len(r.getMessage()) for r in lines) <= 4 * 1024 + 100
    dropped = [r for r in caplog.records if "left out" in r.message]
    assert dropped, "what was dropped is not counted"


async def test_output_is_cut_at_line_length_and_rate() -> None:
    output = WorkerOutput("w", max_bytes_s=1000, max_line_bytes=10, clock=lambda: 0.0)  # no refill
    read, write = os.pipe()
    os.write(write, b"short\n" + b"z" * 25 + b"\nnext\n" + b"aaaaaaaaa\n" * 2000)
    os.close(write)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("buffer.workers.output")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        await output.forward(read, logging.INFO)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert records[:3] == ["w: short", "w: zzzzzzzzzz [cut]", "w: next"]
    # A second's 1000 bytes, newlines counted: 6 + 11 + 5 for the first three, 10 for each next.
    assert sum(1 for r in records if r == "w: aaaaaaaaa") == (1000 - 6 - 11 - 5) // 10
    assert "left out of the log" in records[-1]
