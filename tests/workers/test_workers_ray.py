"""A job's workers as Ray actors on a local Ray instance (CPU only), started by the service
under test with ``--ray-address local``: the run completes with exact counts, and a cancel
stops the actors."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.paths import ROOT
from buffer.processes import free_port, started, wait_ready
from tests.support.calls import wait_for

pytest.importorskip("ray", reason="Ray is not installed here (pip install 'rollout-buffer[ray]')")

TOOLKIT = """
from buffer.toolkit import run_rollouts
TASK_TYPE = "toolkit"

async def run_rollout(data):
    await run_rollouts(data, reward=lambda sample, episode: float(sample.repeat))
"""

WAITING = """
import pathlib, time
TASK_TYPE = "waiting"

def run_rollout(data):
    pathlib.Path(__file__).with_suffix(".started").touch()  # the test cancels it from then on
    while True:
        time.sleep(0.1)
"""


@pytest.fixture
def service(tmp_path: Path, simulator: str) -> Iterator[tuple[httpx.Client, str]]:
    generators = tmp_path / "generator"
    generators.mkdir()
    (generators / "toolkit_generator.py").write_text(TOOLKIT)
    (generators / "waiting_generator.py").write_text(WAITING)
    port = free_port()
    command = [sys.executable, "-m", "buffer", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generators), "--ray-address", "local", "--worker-grace-s", "1"]
    command += ["--input-roots", str(ROOT / "generator" / "data")]
    with started(command, "service", tmp_path / "service.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the service")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, trust_env=False) as http:
            yield http, simulator


def _wait(http: httpx.Client, job_id: str, until: Any, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = http.get(f"/jobs/{job_id}").json()["data"]
        if until(job):
            return job
        time.sleep(0.2)
    raise AssertionError(http.get(f"/jobs/{job_id}").json()["data"])


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_job_on_ray_actors_completes_with_exact_counts_and_cancels(
    service: tuple[httpx.Client, str], tmp_path: Path
) -> None:
    http, engine = service
    start = {
        "task_type": "toolkit",
        "input_file": str(ROOT / "generator" / "data" / "math.jsonl"),
        "remote_engine_url": engine,
        "num_repeat_per_sample": 2,
        "num_process": 16,
        "num_workers": 2,
    }
    job = http.post("/start_rollout", json=start).json()["job"]
    done = _wait(http, job["id"], lambda job: job["status"] != "running", 240)
    assert done["status"] == "succeeded", done
    assert [worker["ray_actor"] is not None for worker in done["workers"]] == [True, True]
    assert done["counters"]["written"] == 64 * 2
    assert done["progress"]["completed"] == 64 * 2  # the actors' last counts, added up
    items = http.post("/get_rollout_data", json={"task_type": "toolkit"}).json()["data"]["data"]
    instances = Counter(item["instance_id"] for item in items)
    assert len(instances) == 64
    assert set(instances.values()) == {2}

    waiting = http.post("/start_rollout", json={"task_type": "waiting"}).json()["job"]
    # As a worker process, a running actor shows its memory (asked every second).
    _wait(http, waiting["id"], lambda job: job["workers"] and job["workers"][0]["rss_bytes"], 60)
    wait_for((tmp_path / "generator" / "waiting_generator.started").exists, 60, "the actor's run_rollout")
    response = http.post(f"/jobs/{waiting['id']}/cancel")
    assert response.status_code == 200, response.text
    cancelled = response.json()["data"]
    assert cancelled["status"] == "cancelled"
    assert cancelled["workers"][0]["status"] != "running"
