"""Remote lease workers across a restart of the service: the restarted service's lease board is
new and knows nothing of what was made; the workers learn the task's resume point from it and
offer only what is still to make, so every item of the plan is written exactly once, whether a
job of the task runs or the workers make its plan with none (its remote run's count)."""

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

from buffer.paths import ROOT
from buffer.processes import free_port, wait_ready
from buffer.workers.leases import LeaseBoard
from tests.support.calls import wait_for


def test_each_board_has_its_own_identity_and_grants_nothing_to_a_worker_of_another() -> None:
    board = LeaseBoard()
    first = board.open("t")
    identity = board.identity("t")
    assert identity is not None
    assert board.claim("t", "a", ["0|q1|0"], 5.0, board=identity) == ["0|q1|0"]
    board.close("t", first)
    board.open("t")  # the job's next run, or the service restarted: a new board
    assert board.identity("t") not in (None, identity)
    assert board.claim("t", "a", ["0|q1|1"], 5.0, board=identity) == []
    assert board.orphans("t", "a", 10, 5.0, board=identity) == ([], 0, 0)
    assert board.claim("t", "a", ["0|q1|1"], 5.0, board=board.identity("t")) == ["0|q1|1"]
    assert board.claim("t", "b", ["0|q1|2"], 5.0) == ["0|q1|2"]  # a worker naming no board: any


def test_the_resume_point_route_answers_for_any_task_and_makes_none(client: TestClient) -> None:
    response = client.get("/tasks/never_seen/resume_point")
    assert response.status_code == 200
    assert response.json()["data"]["resume"] == {"finished_groups": [], "open_groups": []}
    tasks = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]
    assert "never_seen" not in tasks


# The job: it makes nothing itself (the remote workers do), it only runs, so that the task has a
# job, resumed after the restart, and a resume point.
WAITER = """
import asyncio, os

TASK_TYPE = "leased_restart"
START_ROLLOUT_FIELDS = ('stop_file',)

async def run_rollout(data):
    while not os.path.exists(data["stop_file"]):
        await asyncio.sleep(0.1)
"""

# The remote workers' generator: the toolkit's loop, slowed by its reward so a kill lands mid-plan.
SLOW = """
import asyncio
from buffer.toolkit import run_rollouts

TASK_TYPE = "leased_restart"

async def reward(sample, episode):
    await asyncio.sleep(0.4)
    return float(sample.repeat % 2)

async def run_rollout(data):
    await run_rollouts(data, reward=reward)
"""

INSTANCES, REPEATS, EPOCHS = 6, 2, 2
PLAN = INSTANCES * REPEATS * EPOCHS  # 24 items


@contextmanager
def _service(port: int, data_dir: Path, generators: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--generator-dir", str(generators)]
    with log.open("ab") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the buffer")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _written(client: httpx.Client) -> int:
    stats = client.get("/buffer/stats").json()["data"]["data"]
    return int(stats[0]["total_written"]) if stats else 0


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_job", [True, False], ids=["with-a-job", "without-a-job"])
def test_remote_lease_workers_make_each_item_once_across_a_service_restart(
    simulator: str, tmp_path: Path, with_job: bool
) -> None:
    generators = tmp_path / "generator"
    generators.mkdir()
    (generators / "leased_restart_generator.py").write_text(WAITER)
    remote_generator = tmp_path / "remote_generator.py"
    remote_generator.write_text(SLOW)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"instance_id": f"q{i}", "prompt": f"{i} + 1?"}) + "\n" for i in range(INSTANCES))
    )
    stop_file = tmp_path / "stop"
    port, data_dir, log = free_port(), tmp_path / "data", tmp_path / "buffer.log"
    url = f"http://127.0.0.1:{port}"
    task = "leased_restart"
    data = {
        "input_file": str(rows),
        "remote_engine_url": simulator,
        "num_repeat_per_sample": REPEATS,
        "num_epoch": EPOCHS,
        "num_process": 2,
        "max_tokens": 16,
        "group_timeout_seconds": 300,
    }
    command = [sys.executable, "-m", "buffer", "worker", "--buffer", url, "--task", task]
    command += ["--generator", str(remote_generator), "--data", json.dumps(data), "--num-workers", "2"]
    command += ["--leases", "--lease-ttl-s", "6", "--log-level", "warning"]
    workers: list[subprocess.Popen[bytes]] = []
    received: list[dict[str, Any]] = []
    try:
        with _service(port, data_dir, generators, log) as service:
            with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
                start = {"task_type": task, "stop_file": str(stop_file), "num_repeat_per_sample": REPEATS}
                if with_job:
                    assert client.post("/start_rollout", json=start).status_code == 200
                with (tmp_path / "workers.log").open("ab") as output:
                    workers = [
                        subprocess.Popen(
                            [*command, "--worker-index", str(index)],
                            cwd=ROOT,
                            stdout=output,
                            stderr=subprocess.STDOUT,
                        )
                        for index in range(2)
                    ]
                wait_for(lambda: _written(client) >= PLAN // 2, 60, "half the plan written")
            service.send_signal(signal.SIGKILL)
            service.wait()
        with (
            _service(port, data_dir, generators, log),
            httpx.Client(base_url=url, timeout=30, trust_env=False) as client,
        ):
            assert [worker.wait(timeout=60) for worker in workers] == [0, 0]
            stop_file.touch()  # the resumed job ends

            def job_done() -> bool:
                jobs = client.get("/jobs").json()["data"]["jobs"]
                return bool(jobs) and all(job["status"] != "running" for job in jobs)

            if with_job:
                wait_for(job_done, 30, "the resumed job")
            while batch := client.post(
                "/get_rollout_data", json={"task_type": task, "batch_size": -1}
            ).json()["data"]["data"]:
                received += batch
            written = _written(client)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    made = Counter(
        (item["extra_info"]["epoch"], item["instance_id"], item["extra_info"]["repeat"]) for item in received
    )
    twice = {item: times for item, times in made.items() if times > 1}
    assert not twice, f"made more than once: {twice}"
    assert len(made) == PLAN, sorted(made)
    assert written == PLAN
