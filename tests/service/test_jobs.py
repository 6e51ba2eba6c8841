"""Generator jobs across restarts: a resumed job makes only what is missing; a crash loop stops."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from buffer.core.hooks import Hooks
from buffer.core.registry import Generator, GeneratorRegistry
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.processes import free_port, wait_ready
from buffer.service import jobs as jobs_module
from buffer.service.app import create_app
from buffer.service.jobs import MAX_WORKER_RESTARTS, JobManager, JobStatus
from buffer.service.settings import Settings
from buffer.workers.process import WorkerOutcome
from buffer.workers.spec import WorkerSpec
from tests.support.calls import until, wait_for
from tests.support.factories import trajectory
from tests.support.paths import REPO

ROOT = REPO

# Writes the data it was started with to data["out"], then runs until cancelled.
RECORDER = """
import asyncio, json

TASK_TYPE = "recorder"
START_ROLLOUT_FIELDS = ('out',)

async def run_rollout(data):
    with open(data["out"], "w") as out:
        json.dump(data, out)
    await asyncio.Event().wait()
"""


@contextmanager
def service(generator_dir: Path, data_dir: Path, **overrides: Any) -> Iterator[TestClient]:
    overrides = {"job_isolation": "inline", **overrides}  # a TestClient has no port for workers
    settings = Settings(generator_dir=generator_dir, data_dir=data_dir, group_size=3, **overrides)
    with TestClient(create_app(settings)) as client:
        yield client


def write(client: TestClient, instance_id: str, repeats: list[int], task_type: str = "rec") -> None:
    items = [
        trajectory(instance_id, float(r % 2), task_type=task_type, extra_info={"repeat": r, "epoch": 0})
        for r in repeats
    ]
    assert client.post("/buffer/write_batch", json=items).status_code == 200


def test_a_resumed_job_is_told_what_its_earlier_run_made(generator_dir: Path, tmp_path: Path) -> None:
    (generator_dir / "recorder_generator.py").write_text(RECORDER)
    out = tmp_path / "data.json"
    start = {"task_type": "recorder", "rollout_name": "rec", "num_repeat_per_sample": 3, "out": str(out)}
    with service(generator_dir, tmp_path / "data") as client:
        write(client, "old", [0, 1, 2])  # before the job: not its work
        assert client.post("/start_rollout", json=start).status_code == 200
        write(client, "a", [0, 1, 2])
        write(client, "b", [0, 1, 2])
        assert len(client.post("/get_rollout_data", json={"task_type": "rec"}).json()["data"]["data"]) == 9
        client.app.state.services.buffer.journal.compact()  # type: ignore[attr-defined]
        write(client, "a", [0, 1, 2])  # its second epoch
        write(client, "c", [2, 0])
    with service(generator_dir, tmp_path / "data") as client:
        resumed = json.loads(out.read_text())["resume"]
        assert sorted(resumed["finished_groups"]) == [["a", 2], ["b", 1]]
        assert resumed["open_groups"] == [["c", [2, 0]]]
        # started afresh, the job counts from its new start
        assert client.post("/start_rollout", json={**start, "restart": True}).status_code == 200
        write(client, "d", [0, 1, 2])
    with service(generator_dir, tmp_path / "data"):
        resumed = json.loads(out.read_text())["resume"]
        assert resumed == {
            "finished_groups": [["d", 1]],
            "open_groups": [["c", [2, 0]]],
            "finished_epochs": [["d", 0, 1]],  # its trajectories say their epoch
            "open_epochs": [["c", 0]],
        }


@pytest.mark.anyio
async def test_a_job_running_at_two_crashes_in_a_row_is_failed_not_resumed(generator_dir: Path) -> None:
    (generator_dir / "recorder_generator.py").write_text(RECORDER)
    registry = GeneratorRegistry(generator_dir)
    registry.refresh()
    buffer = RolloutBuffer()
    buffer.job_started("rec", "recorder", {"out": "/dev/null"})
    assert buffer.crashes_if_resumed("rec") == 1  # restored without a clean stop: one crash
    buffer.job_paused("rec")
    assert buffer.crashes_if_resumed("rec") == 0  # a clean stop breaks the run of crashes
    buffer.job_resumed("rec", 1)
    assert buffer.crashes_if_resumed("rec") == 2
    jobs = JobManager(buffer, "http://127.0.0.1:8889")
    (job,) = await jobs.resume(registry)
    assert job.status is JobStatus.FAILED
    assert "2 times in a row" in str(job.error)
    assert buffer.jobs == {}  # ended: the next start does not try again


@contextmanager
def buffer_process(
    port: int, data_dir: Path, generator_dir: Path, log: Path, *extra: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--generator-dir", str(generator_dir), *extra]
    with log.open("ab") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


# The toolkit's own loop, slowed by its reward so that a kill lands mid-run.
SLOW = """
import asyncio
from buffer.toolkit import run_rollouts

TASK_TYPE = "slow"

async def reward(sample, episode):
    await asyncio.sleep(0.05)
    return float(sample.repeat % 2)

async def run_rollout(data):
    await run_rollouts(data, reward=reward)
"""


def totals(client: httpx.Client) -> dict[str, Any]:
    stats: dict[str, Any] = client.get("/buffer/stats").json()["data"]["data"][0]
    return stats


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_resumed_after_sigkill_makes_each_group_exactly_once(
    simulator: str, generator_dir: Path, tmp_path: Path, workers: int
) -> None:
    (generator_dir / "slow_generator.py").write_text(SLOW)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"instance_id": f"q{i}", "prompt": f"{i} + 1?"}) + "\n" for i in range(12))
    )
    port, data_dir, log = free_port(), tmp_path / "data", tmp_path / "buffer.log"
    start = {
        "task_type": "slow",
        "input_file": str(rows),
        "remote_engine_url": simulator,
        "num_repeat_per_sample": 4,
        "num_epoch": 2,
        "num_process": 4,
        "num_workers": workers,  # each resumed worker leases from the same, resumed plan
        "max_tokens": 16,
        "group_timeout_seconds": 120,
    }
    received: list[dict[str, Any]] = []
    extra = ("--input-roots", str(tmp_path))
    with buffer_process(port, data_dir, generator_dir, log, *extra) as (process, url):
        wait_ready(f"{url}/health", process, 60, "the buffer")
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.post("/start_rollout", json=start).status_code == 200
            wait_for(lambda: totals(client)["total_written"] >= 12, 60, "writes")
            received += client.post("/get_rollout_data", json={"task_type": "slow"}).json()["data"]["data"]
            wait_for(lambda: totals(client)["total_written"] >= 40, 60, "writes")
        process.send_signal(signal.SIGKILL)
        process.wait()
    with buffer_process(port, data_dir, generator_dir, log, *extra) as (process, url):
        wait_ready(f"{url}/health", process, 60, "the buffer")
        with httpx.Client(base_url=url, timeout=30) as client:

            def finished() -> bool:
                jobs = client.get("/jobs").json()["data"]["jobs"]
                return bool(jobs) and all(job["status"] != "running" for job in jobs)

            wait_for(finished, 60, "the resumed job")
            (job,) = client.get("/jobs").json()["data"]["jobs"]
            assert job["status"] == "succeeded", job
            assert 0 < job["progress"]["total"] < 96  # it made only what was missing
            while batch := client.post("/get_rollout_data", json={"batch_size": -1}).json()["data"]["data"]:
                received += batch  # a read returns one group per instance: one read per epoch
            stats = totals(client)
    per_group = Counter((item["instance_id"], item["extra_info"]["repeat"]) for item in received)
    assert len(received) == 96, Counter(item["instance_id"] for item in received)
    assert set(per_group.values()) == {2}  # each repeat once per epoch
    assert stats["pending_items"] == 0
    assert "resuming the slow rollout that was running when the service crashed" in log.read_text()


# Kills the process it runs in, a moment after it starts: the service, when jobs run inline.
KILLER = """
import asyncio, os, signal

TASK_TYPE = "killer"

async def run_rollout(data):
    await asyncio.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_generator_that_kills_the_service_is_failed_after_two_crashes(
    generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "killer_generator.py").write_text(KILLER)
    port, data_dir, log = free_port(), tmp_path / "data", tmp_path / "buffer.log"
    inline = ("--job-isolation", "inline")
    with buffer_process(port, data_dir, generator_dir, log, *inline) as (process, url):
        wait_ready(f"{url}/health", process, 60, "the buffer")
        assert httpx.post(f"{url}/start_rollout", json={"task_type": "killer"}, timeout=30).status_code == 200
        assert process.wait(timeout=30) == -signal.SIGKILL
    with buffer_process(port, data_dir, generator_dir, log, *inline) as (process, url):  # resumed once
        assert process.wait(timeout=30) == -signal.SIGKILL
    with buffer_process(port, data_dir, generator_dir, log, *inline) as (process, url):
        wait_ready(f"{url}/health", process, 60, "the buffer")
        (job,) = httpx.get(f"{url}/jobs", timeout=30).json()["data"]["jobs"]
        assert job["status"] == "failed"
        assert "2 times in a row" in job["error"]
        time.sleep(1.5)  # longer than the generator waits before it kills
        assert process.poll() is None


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_in_a_worker_process_a_generator_that_kills_itself_fails_only_its_job(
    generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "killer_generator.py").write_text(KILLER)
    port, data_dir, log = free_port(), tmp_path / "data", tmp_path / "buffer.log"
    with buffer_process(port, data_dir, generator_dir, log, "--worker-grace-s", "1") as (process, url):
        wait_ready(f"{url}/health", process, 60, "the buffer")
        job = httpx.post(f"{url}/start_rollout", json={"task_type": "killer"}, timeout=30).json()["job"]
        done = wait_for(
            lambda: (
                (j := httpx.get(f"{url}/jobs/{job['id']}", timeout=30).json()["data"])["status"] != "running"
                and j
            ),
            60,
            "the job",
        )
        assert done["status"] == "failed"
        assert done["error"] == "the worker process was killed by SIGKILL"
        assert done["worker_restarts"] == 2  # SIGKILL from outside is retried twice, then given up
        assert process.poll() is None


class _LostWorker:
    """A worker process stand-in: index 0 is killed (SIGKILL) at once, every time; the others
    succeed once it has been lost past its replacements."""

    losses = 0

    def __init__(self, spec: WorkerSpec, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.pid = None
        self.outcome: WorkerOutcome | None = None

    async def start(self) -> None:
        return None

    async def wait(self) -> WorkerOutcome:
        if self.spec.index == 0:
            _LostWorker.losses += 1
            self.outcome = WorkerOutcome("failed", -9, "the worker process was killed by SIGKILL", lost=True)
        else:
            await until(lambda: _LostWorker.losses > MAX_WORKER_RESTARTS, what="the last loss")
            self.outcome = WorkerOutcome("succeeded", 0)
        return self.outcome

    async def stop(self, grace_s: float) -> None:
        return None

    def progress(self) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"index": self.spec.index, "status": self.outcome.status if self.outcome else "running"}


@pytest.mark.anyio
@pytest.mark.parametrize(("workers", "status"), [(2, JobStatus.SUCCEEDED), (1, JobStatus.FAILED)])
async def test_a_worker_lost_past_its_replacements_leaves_the_work_to_the_others(
    monkeypatch: pytest.MonkeyPatch, workers: int, status: JobStatus
) -> None:
    """Each loss is replaced, twice at most; then the others finish the job (their leases take
    its items), or, with none left, the job fails with what happened."""
    monkeypatch.setattr(jobs_module, "WorkerProcess", _LostWorker)
    monkeypatch.setattr(_LostWorker, "losses", 0)
    monkeypatch.setattr(jobs_module, "RELEASE_SETTLE_S", 0.0)
    manager = JobManager(RolloutBuffer(), "http://127.0.0.1:8889")
    generator = Generator("t", Path("t_generator.py"), ModuleType("t"), lambda data: None, Hooks())
    job = manager.start(generator, {"num_workers": workers})
    assert job._task is not None
    await job._task
    assert job.status is status
    assert job.restarts == MAX_WORKER_RESTARTS
    assert len(job.workers) == workers + MAX_WORKER_RESTARTS
    if status is JobStatus.FAILED:
        assert job.error == "the worker process was killed by SIGKILL"
