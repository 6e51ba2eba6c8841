"""A job that stopped unfinished: the crash-loop guard counts crashes without progress, and a
start of the same plan makes only what is missing (issue 22)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from buffer.core.registry import GeneratorRegistry
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.processes import free_port, wait_ready
from buffer.service.app import create_app
from buffer.service.jobs import JobManager, JobStatus, plan_of
from buffer.service.settings import Settings
from tests.support.calls import wait_for
from tests.support.factories import FakeClock, trajectory
from tests.support.paths import REPO
from tests.support.stores import on_journal

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

# Raises at once: a job that ends unfinished.
FAILING = """
TASK_TYPE = "recorder"
START_ROLLOUT_FIELDS = ("out",)

def run_rollout(data):
    raise RuntimeError("the engine went away")
"""


# -- the crash-loop guard -------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("progress", [True, False])
async def test_only_crashes_without_trajectories_written_between_them_stop_a_job(
    generator_dir: Path, tmp_path: Path, progress: bool
) -> None:
    (generator_dir / "recorder_generator.py").write_text(RECORDER)
    registry = GeneratorRegistry(generator_dir)
    registry.refresh()
    buffer = RolloutBuffer()
    buffer.job_started("rec", "recorder", {"out": str(tmp_path / "data.json")})
    buffer.write(trajectory("q1", task_type="rec"))
    assert buffer.crashes_if_resumed("rec") == 1  # the first crash
    buffer.job_resumed("rec", 1)
    if progress:
        buffer.write(trajectory("q2", task_type="rec"))  # the resumed run wrote: it went on
    assert buffer.crashes_if_resumed("rec") == (1 if progress else 2)
    jobs = JobManager(buffer, "http://127.0.0.1:8889", isolation="inline")
    (job,) = await jobs.resume(registry)
    try:
        if progress:
            assert job.status is JobStatus.RUNNING
            assert buffer.jobs["rec"]["crashes"] == 1
        else:
            assert job.status is JobStatus.FAILED
            assert "2 times in a row" in str(job.error)
            assert buffer.jobs == {}
    finally:
        await jobs.shutdown()


def test_the_count_and_an_unfinished_job_survive_restarts(tmp_path: Path) -> None:
    """What a crash is measured against is what the records replay to, compacted or not."""
    clock = FakeClock()

    first = on_journal(tmp_path / "data", clock)
    first.buffer.job_started("rec", "recorder", {}, plan="p")
    first.buffer.write(trajectory("q1", task_type="rec"))
    first.buffer.job_resumed("rec", 1)  # as after a crash: progress counts from here
    first.stop()
    second = on_journal(tmp_path / "data", clock)  # the records replayed
    assert second.buffer.crashes_if_resumed("rec") == 2
    second.buffer.write(trajectory("q2", task_type="rec"))
    second.store.compact()
    second.stop()
    third = on_journal(tmp_path / "data", clock)  # from the snapshot
    assert third.buffer.crashes_if_resumed("rec") == 1
    third.buffer.job_ended("rec", finished=False)
    third.stop()
    fourth = on_journal(tmp_path / "data", clock)
    assert fourth.buffer.jobs == {}  # nothing to resume
    assert fourth.buffer.job_continues("rec", "recorder", "p")
    assert not fourth.buffer.job_continues("rec", "recorder", "another plan")
    assert fourth.buffer.resume_point("rec")["open_groups"] == [["q1", [None]], ["q2", [None]]]
    fourth.store.compact()
    fourth.stop()
    fifth = on_journal(tmp_path / "data", clock)
    assert fifth.buffer.job_continues("rec", "recorder", "p")
    fifth.buffer.job_started("rec", "recorder", {}, plan="p", resumed=True)
    assert not fifth.buffer.job_continues("rec", "recorder", "p")  # running again
    fifth.stop()


# -- a start of the same plan ---------------------------------------------------------------


def test_a_start_after_an_unfinished_job_of_the_same_plan_continues_it(
    generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "recorder_generator.py").write_text(FAILING)
    out = tmp_path / "data.json"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1?"}\n')
    start = {
        "task_type": "recorder",
        "rollout_name": "rec",
        "num_repeat_per_sample": 2,
        "input_file": str(rows),
        "num_epoch": "2",  # slime sends numbers as strings: the same plan
        "out": str(out),
    }
    settings = Settings(
        generator_dir=generator_dir,
        data_dir=tmp_path / "data",
        job_isolation="inline",
        input_roots=[tmp_path],
    )
    with TestClient(create_app(settings)) as client:
        failed = client.post("/start_rollout", json=start).json()["job"]
        wait_for(
            lambda: client.get(f"/jobs/{failed['id']}").json()["data"]["status"] == "failed", 30, "it fails"
        )
        items = [trajectory("a", 1.0, task_type="rec", extra_info={"repeat": r}) for r in (0, 1)]
        items.append(trajectory("b", 0.0, task_type="rec", extra_info={"repeat": 1}))
        assert client.post("/buffer/write_batch", json=items).status_code == 200
        (generator_dir / "recorder_generator.py").write_text(RECORDER)
    with TestClient(create_app(settings)) as client:  # the unfinished job survives a restart
        assert client.post("/start_rollout", json={**start, "num_epoch": 2}).status_code == 200
        wait_for(out.exists, 30, "the job's data")
        resumed = json.loads(out.read_text())["resume"]
        assert resumed == {"finished_groups": [["a", 1]], "open_groups": [["b", [1]]]}
        out.unlink()
        # another plan (a third epoch) starts afresh
        assert (
            client.post("/start_rollout", json={**start, "num_epoch": 3, "restart": True}).status_code == 200
        )
        wait_for(out.exists, 30, "the job's data")
        assert "resume" not in json.loads(out.read_text())


def test_a_start_with_restart_or_its_own_resume_makes_its_whole_plan(
    generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "recorder_generator.py").write_text(RECORDER)
    out = tmp_path / "data.json"
    start = {"task_type": "recorder", "rollout_name": "rec", "num_repeat_per_sample": 2, "out": str(out)}
    settings = Settings(generator_dir=generator_dir, job_isolation="inline")
    with TestClient(create_app(settings)) as client:
        job = client.post("/start_rollout", json=start).json()["job"]
        wait_for(out.exists, 30, "the job's data")
        assert "resume" not in json.loads(out.read_text())
        items = [trajectory("a", float(r), task_type="rec", extra_info={"repeat": r}) for r in (0, 1)]
        assert client.post("/buffer/write_batch", json=items).status_code == 200
        client.post(f"/jobs/{job['id']}/cancel")  # cancelled: unfinished
        out.unlink()
        own = {"finished_groups": [], "open_groups": []}
        assert client.post("/start_rollout", json={**start, "resume": own}).status_code == 200
        wait_for(out.exists, 30, "the job's data")
        assert json.loads(out.read_text())["resume"] == own
        out.unlink()
        assert client.post("/start_rollout", json={**start, "restart": True}).status_code == 200
        wait_for(out.exists, 30, "the job's data")
        assert "resume" not in json.loads(out.read_text())


def test_the_plan_is_the_fields_that_define_it() -> None:
    base = {"input_file": "/d/rows.jsonl", "num_repeat_per_sample": 4, "skip_instance_ids": [3, "x"]}
    same = {**base, "num_epoch": "1", "seed": 0, "shuffle": True, "skip_instance_ids": ["x", "3"]}
    assert plan_of(base) == plan_of({**same, "num_process": 64, "remote_engine_url": "http://e:1"})
    for other in ({"num_epoch": 2}, {"seed": 1}, {"shuffle": False}, {"input_file": "/d/b.jsonl"}):
        assert plan_of({**base, **other}) != plan_of(base)
    assert plan_of({**base, "skip_instance_ids": ["x"]}) != plan_of(base)
    assert plan_of({**base, "num_epoch": "many"}) is None


# -- end to end: killed, not resumed, started again ----------------------------------------

# The toolkit's loop over its plan; its reward kills the service (jobs run inline) once it has
# scored as many trajectories as the file data["control"] says (-1: never).
FLAKY = """
import os, signal
from pathlib import Path
from buffer.toolkit import run_rollouts

TASK_TYPE = "flaky"
START_ROLLOUT_FIELDS = ('control',)

async def run_rollout(data):
    left = [int(Path(data["control"]).read_text())]

    async def reward(sample, episode):
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        left[0] -= 1
        return float(sample.repeat % 2)

    await run_rollouts(data, reward=reward)
"""


@contextmanager
def buffer_process(
    port: int, data_dir: Path, generator_dir: Path, log: Path, *extra: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--generator-dir", str(generator_dir), *extra]
    with log.open("ab") as output:
        process = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_killed_with_progress_it_resumes_and_a_start_after_it_was_given_up_makes_only_the_rest(
    simulator: str, generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "flaky_generator.py").write_text(FLAKY)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"instance_id": f"q{i}", "prompt": f"{i} + 1?"}) + "\n" for i in range(6))
    )
    control = tmp_path / "control"
    port, data_dir, log = free_port(), tmp_path / "data", tmp_path / "buffer.log"
    start = {
        "task_type": "flaky",
        "input_file": str(rows),
        "remote_engine_url": simulator,
        "num_repeat_per_sample": 2,
        "num_epoch": 2,
        "num_process": 1,
        "max_tokens": 16,
        "group_timeout_seconds": 600,
        "control": str(control),
    }
    extra = ("--job-isolation", "inline", "--input-roots", str(tmp_path))

    def run_until_killed(post: bool) -> None:
        with buffer_process(port, data_dir, generator_dir, log, *extra) as (process, url):
            if post:
                wait_ready(f"{url}/health", process, 60, "the buffer")
                assert httpx.post(f"{url}/start_rollout", json=start, timeout=30).status_code == 200

            def outcome() -> str | None:
                if process.poll() is not None:
                    return "killed"
                try:
                    jobs = httpx.get(f"{url}/jobs", timeout=5).json()["data"]["jobs"]
                except httpx.HTTPError:
                    return None  # not listening yet
                return "given up" if any(job["status"] == "failed" for job in jobs) else None

            assert wait_for(outcome, 90, "the job's end", interval_s=0.1) == "killed"
            assert process.wait() == -signal.SIGKILL

    control.write_text("3")
    run_until_killed(post=True)  # killed after it wrote: crash 1
    run_until_killed(post=False)  # resumed, wrote, killed: a crash with progress counts as the first
    control.write_text("0")
    run_until_killed(post=False)  # resumed (crash 1 again), killed before it wrote: crash 2
    control.write_text("-1")
    received: list[dict[str, Any]] = []
    with buffer_process(port, data_dir, generator_dir, log, *extra) as (process, url):
        wait_ready(f"{url}/health", process, 60, "the buffer")
        with httpx.Client(base_url=url, timeout=30) as client:
            (given_up,) = client.get("/jobs").json()["data"]["jobs"]
            assert given_up["status"] == "failed"
            assert "2 times in a row" in given_up["error"]
            job = client.post("/start_rollout", json=start).json()["job"]  # what the error says to do

            def ended() -> Any:
                described = client.get(f"/jobs/{job['id']}").json()["data"]
                return described if described["status"] != "running" else None

            done = wait_for(ended, 120, "the job started again")
            assert done["status"] == "succeeded", done
            assert 0 < done["progress"]["total"] < 24  # only what was missing
            while batch := client.post("/get_rollout_data", json={"batch_size": -1}).json()["data"]["data"]:
                received += batch  # a read returns one group per instance: one read per epoch
    made = Counter(
        (item["instance_id"], item["extra_info"]["epoch"], item["extra_info"]["repeat"]) for item in received
    )
    assert len(received) == 24, made
    assert set(made.values()) == {1}  # each sample of the plan made exactly once
    assert log.read_text().count("resuming the flaky rollout that was running when the service crashed") == 2
