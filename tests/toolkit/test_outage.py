"""The policy server goes down in the middle of a run and comes back: generation resumes, the
failures are counted, and no trajectory is lost or written twice.

In process first (``run_rollouts`` against the simulator app, a short outage), then end to
end: the service runs the shipped math generator against the simulator process, and the
simulator is made to fail every request for 10 s while the job is under way.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.simulator import SimConfig, create_sim_app
from buffer.toolkit.llm import ChatClient, RetryPolicy
from buffer.toolkit.runner import run_rollouts
from buffer.toolkit.types import Episode, Sample
from tests.support.calls import until, wait_for
from tests.support.factories import Collected

OUTAGE_S = 10.0


def math_rows(path: Path, count: int) -> Path:
    rows = [
        {"instance_id": f"m{i}", "prompt": f"What is {i} + 2?", "label": str(i + 2)} for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- in process ------------------------------------------------------------------------


class DownAfter(Collected):
    """A sink that keeps what is written and, at the ``after``-th trajectory, takes the
    simulator down for ``seconds``."""

    def __init__(self, start_outage: Callable[[], None], after: int) -> None:
        super().__init__()
        self._start_outage = start_outage
        self._after = after

    async def write(self, trajectory: dict[str, Any]) -> None:
        await super().write(trajectory)
        if len(self.trajectories) == self._after:
            self._start_outage()


def one(sample: Sample, episode: Episode) -> float:
    return 1.0


@pytest.mark.anyio
async def test_a_run_rides_out_an_outage_and_its_progress_counts_the_failures(tmp_path: Path) -> None:
    app = create_sim_app(SimConfig(latency_mean_s=0.01, accuracy=1.0, seed=0))
    # Down at the 10th trajectory, up again once three requests have failed: counted, not timed.
    sink = DownAfter(lambda: app.state.outage.start(600, "503"), after=10)
    failed = app.state.simulator.stats.by_status

    async def end_the_outage() -> None:
        await until(lambda: failed[503] >= 3, what="requests failing in the outage")
        app.state.outage.start(0, "503")

    data = {
        "task_type": "math",
        "input_file": str(math_rows(tmp_path / "rows.jsonl", 20)),
        "remote_engine_url": "http://sim",
        "num_repeat_per_sample": 2,
        "num_process": 4,
    }
    retry = RetryPolicy(backoff_s=0.01, max_backoff_s=0.05)
    transport = httpx.ASGITransport(app=app)
    async with ChatClient("http://sim", retry=retry, transport=transport) as llm:
        llm.stats.failed("HTTP 500")  # a failure before the run is not the run's
        ending = asyncio.ensure_future(end_the_outage())
        progress = await run_rollouts(data, reward=one, sink=sink, llm=llm)
        await asyncio.wait_for(ending, 30)
    assert (progress.completed, progress.total, progress.failed) == (40, 40, 0)
    assert Counter(t["instance_id"] for t in sink.trajectories) == {f"m{i}": 2 for i in range(20)}
    assert len({t["uid"] for t in sink.trajectories}) == 40
    assert progress.request_failures == progress.retries > 0
    assert progress.request_failures_by_kind == {"HTTP 503": progress.request_failures}
    snapshot = progress.snapshot()
    assert snapshot["request_failures"] == progress.request_failures  # what the job shows
    assert "LLM requests failed" in progress.line()


# -- end to end ------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_the_math_generator_resumes_after_a_ten_second_outage_and_loses_nothing(
    process: Callable[..., str], tmp_path: Path
) -> None:
    """Dropped connections through the generator's real (aiohttp) transport; the 503 mode
    goes through the same retries, in process above."""
    rows, repeats = 60, 4
    engine = process(
        "-m", "buffer.simulator", "--latency-mean-s", "0.1", "--seed", "0", "--log-level", "warning",
        name="simulator",
    )  # fmt: skip
    buffer_url = process("buffer.py", "--log-level", "warning", "--input-roots", str(tmp_path), name="buffer")
    with httpx.Client(base_url=buffer_url, timeout=30, trust_env=False) as client:
        job_id = client.post(
            "/start_rollout",
            json={
                "task_type": "math",
                "evaluation": True,  # keep every group as written, so every trajectory can be counted
                "input_file": str(math_rows(tmp_path / "math.jsonl", rows)),
                "remote_engine_url": engine,
                "num_repeat_per_sample": repeats,
                "num_process": 8,
                "sampling_params": {"max_tokens": 256},
            },
        ).json()["job_id"]

        def job() -> dict[str, Any]:
            """The job as ``GET /jobs`` shows it."""
            jobs = client.get("/jobs").json()["data"]["jobs"]
            found: dict[str, Any] = next(j for j in jobs if j["id"] == job_id)
            return found

        wait_for(
            lambda: job()["progress"].get("completed", 0) >= 40, 60, "40 trajectories before the outage", 0.1
        )
        outage = {"seconds": OUTAGE_S, "mode": "reset"}
        assert httpx.post(f"{engine}/outage", json=outage, trust_env=False, timeout=30).status_code == 200
        during = wait_for(lambda: job()["progress"].get("request_failures"), 60, "failures on the job", 0.1)
        assert job()["status"] == "running"  # the failures show while the job runs

        done = wait_for(
            lambda: (lambda j: j if j["status"] != "running" else None)(job()), 120, "the job's end", 0.1
        )
        stats = client.get("/buffer/stats").json()["data"]
        items: list[dict[str, Any]] = []
        while len(items) < rows * repeats:
            body = client.post("/get_rollout_data", json={"task_type": "math", "wait_s": 1}).json()
            assert body["success"], f"{len(items)} of {rows * repeats} trajectories read"
            items += body["data"]["data"]
    simulator = httpx.get(f"{engine}/stats", trust_env=False, timeout=30).json()

    assert done["status"] == "succeeded", done
    progress = done["progress"]
    assert progress["completed"] == progress["total"] == rows * repeats
    assert (progress["failed"], progress["rejected"]) == (0, 0)
    assert progress["request_failures"] >= during > 0
    assert progress["retries"] > 0
    assert "ReadError" in progress["request_failures_by_kind"]  # a response cut short
    # Each connection the simulator dropped is a failure the job counted (a client may count
    # more: a kept-alive connection the server closed as it was reused); each trajectory took
    # one answer.
    assert progress["request_failures"] >= simulator["dropped"] > 0
    assert simulator["by_status"] == {"200": rows * repeats}

    math = stats["meta_info"]["tasks"]["math"]
    assert (math["total_written"], stats["data"][0]["duplicates"]) == (rows * repeats, 0)
    assert len(items) == rows * repeats
    assert len({item["uid"] for item in items}) == rows * repeats
    assert Counter(item["instance_id"] for item in items) == {f"m{i}": repeats for i in range(rows)}
    assert any(item["extra_info"]["attempts"] > 1 for item in items)
