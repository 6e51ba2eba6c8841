"""Nothing is dropped silently (issue 22): a job whose trajectories the buffer refused as invalid
ends failed, saying how many, in the service's process and in a worker process, through
``run_rollouts`` and through a generator writing with ``open_sink`` that swallows the errors.
Each test runs a real service process (worker processes need a port to write back to)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.processes import free_port, started, wait_ready
from tests.support.calls import wait_for

GENERATORS = {
    # The toolkit's run: rows marked "bad" get a reward that is no number, which the buffer refuses.
    "refusing_run": """
from buffer.toolkit import run_rollouts
from buffer.toolkit.types import Episode

TASK_TYPE = "refusing_run"

async def answer(llm, sample, **sampling):
    return Episode([*sample.messages, {"role": "assistant", "content": "4"}], "stop")

async def reward(sample, episode):
    return "not a number" if sample.row["bad"] else 1.0

async def run_rollout(data):
    await run_rollouts(data, reward=reward, rollout=answer)
""",
    # Its own sink, every error swallowed: it returns as if all went well.
    "refusing_sink": """
from buffer.toolkit.sink import RejectedTrajectory, open_sink

TASK_TYPE = "refusing_sink"

async def run_rollout(data):
    sink = await open_sink(data.get("remote_buffer_url"))
    for i in range(24):
        trajectory = {
            "uid": f"u{i}",
            "instance_id": f"q{i // 4}",
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "reward": "not a number" if i % 6 == 0 else 1.0,
            "extra_info": {"repeat": i % 4},
        }
        try:
            await sink.write(trajectory)
        except RejectedTrajectory:
            pass
    try:
        await sink.aclose()
    except RejectedTrajectory:
        pass
""",
}


@pytest.fixture(scope="module", params=["inline", "process"])
def service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, simulator: str
) -> Iterator[Service]:
    directory = tmp_path_factory.mktemp(f"refused-{request.param}")
    generators = directory / "generator"
    generators.mkdir()
    for name, source in GENERATORS.items():
        (generators / f"{name}_generator.py").write_text(source)
    rows = [{"instance_id": f"q{i}", "prompt": f"{i} + 1?", "bad": i == 2} for i in range(6)]
    (directory / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    port = free_port()
    command = [sys.executable, "-m", "buffer", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generators), "--job-isolation", request.param]
    command += ["--input-roots", str(directory), "--group-size", "4", "--worker-grace-s", "1"]
    with started(command, "service", directory / "service.log") as process:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", process, 60, "the service")
        yield Service(url, directory / "rows.jsonl", simulator)


class Service:
    def __init__(self, url: str, rows: Path, engine: str) -> None:
        self.url = url
        self.rows = rows
        self.engine = engine  # the start checks that it answers; the rollouts never call it

    def run_job(self, task_type: str) -> dict[str, Any]:
        """Start ``task_type`` on 6 rows of 4 repeats (24 trajectories); the job once it ended."""
        start = {"task_type": task_type, "input_file": str(self.rows), "remote_engine_url": self.engine}
        start["num_repeat_per_sample"] = 4
        with httpx.Client(base_url=self.url, timeout=30) as client:
            response = client.post("/start_rollout", json=start)
            assert response.status_code == 200, response.text
            job_id = response.json()["job"]["id"]

            def ended() -> dict[str, Any] | None:
                job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()["data"]
                return job if job["status"] != "running" else None

            job: dict[str, Any] = wait_for(ended, 90, f"the {task_type} job")
            return job


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("task_type", ["refusing_run", "refusing_sink"])
def test_a_job_whose_writes_were_refused_fails_saying_how_many(service: Service, task_type: str) -> None:
    job = service.run_job(task_type)
    assert job["status"] == "failed", job
    assert "refused 4 " in str(job["error"]), job["error"]
    assert "reward" in str(job["error"]), job["error"]  # why the first was refused
    assert job["counters"]["written"] == 20  # the others went in
    if task_type == "refusing_run":
        assert job["progress"]["rejected"] == 4
        assert "refused 4 of 24 trajectories" in job["error"]
