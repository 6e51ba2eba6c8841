"""GET /metrics: the Prometheus text format, read from the buffer and the jobs at scrape time."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from buffer.demo import closing_line
from buffer.service.jobs import Job
from buffer.toolkit.runner import Progress
from buffer.toolkit.types import Completion, TokenCapture
from buffer.workers.process import WorkerOutcome
from tests.support.calls import WAITING, job_status, read, wait_for, write_all
from tests.support.factories import group, write_generator
from tests.support.paths import REPO

Labels = tuple[tuple[str, str], ...]
DASHBOARD = REPO / "docs" / "grafana" / "rollout-buffer.json"


def scrape(client: TestClient) -> dict[tuple[str, Labels], float]:
    """Every sample of ``/metrics``, by name and sorted labels."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, Labels], float], name: str, **labels: str) -> float:
    return samples[f"rollout_buffer_{name}", tuple(sorted(labels.items()))]


def test_buffer_metrics_count_writes_reads_states_discards_and_rewards(client: TestClient) -> None:
    write_all(
        client, group("q1", [0, 1, 0, 1], task_type="math") + group("q2", [1, 0, 1, 0], task_type="math")
    )
    write_all(client, group("q3", [1, 1, 1, 1], task_type="other"))  # no diversity: invalid
    write_all(client, group("q4", [0.5, 0.5], task_type="other"))  # half a group: pending
    read(client, {"task_type": "math", "batch_size": 4})

    samples = scrape(client)
    assert value(samples, "trajectories_written_total", task="math") == 8
    assert value(samples, "trajectories_delivered_total", task="math") == 4
    assert value(samples, "groups_delivered_total", task="math") == 1
    assert value(samples, "groups", task="math", state="ready") == 1
    assert value(samples, "groups", task="math", state="pending") == 0
    assert value(samples, "items", task="math", state="ready") == 4
    assert value(samples, "reward_mean", task="math") == 0.5
    assert value(samples, "rewards_total", task="math") == 8
    # A summary's sum and count: rate(sum) / rate(count) is a windowed mean in Prometheus.
    assert value(samples, "reward_count", task="math") == 8
    assert value(samples, "reward_sum", task="math") == pytest.approx(4.0)
    assert value(samples, "reward_sum", task="other") == pytest.approx(5.0)
    assert value(samples, "served_group_age_seconds_count", task="math") == 1  # one group read
    assert value(samples, "served_group_age_seconds_sum", task="math") >= 0

    assert value(samples, "trajectories_written_total", task="other") == 6
    assert value(samples, "trajectories_delivered_total", task="other") == 0
    assert value(samples, "groups_discarded_total", task="other", reason="invalid_group") == 1
    assert value(samples, "groups_set_aside_total", task="other") == 0
    assert value(samples, "groups", task="other", state="pending") == 1
    assert value(samples, "items", task="other", state="pending") == 2
    assert value(samples, "reward_mean", task="other") == pytest.approx(5 / 6)
    assert value(samples, "reward_std", task="other") == pytest.approx(0.2581988897)
    assert value(samples, "jobs", state="running") == 0


def with_logprobs(item: dict[str, Any], *kinds: str | None) -> dict[str, Any]:
    """``item`` with one token record per kind: logprobs of that kind (None: the turn does not say)."""
    item["messages"] = [item["messages"][0]] + [
        {"role": "assistant", "content": "\\boxed{2}", "generated": True} for _ in kinds
    ]
    item["turns"] = []
    for n, kind in enumerate(kinds):
        turn: dict[str, Any] = {
            "prompt_ids": [1, 2] if n == 0 else [3],
            "prompt_offset": 0 if n == 0 else 4,
            "output_ids": [4, 5],
            "output_logprobs": [-0.5, -0.25],
            "finish_reason": "stop",
            "message_index": n + 1,
        }
        if kind is not None:
            turn["logprobs"] = kind
        item["turns"].append(turn)
    return item


def test_trajectories_with_logprobs_are_counted_by_what_those_are(client: TestClient) -> None:
    items = group("q1", [0, 1, 0, 1], task_type="math")
    with_logprobs(items[0], "sampling")
    with_logprobs(items[1], "sampling", "raw")  # one turn the trainer cannot have: the whole is raw
    with_logprobs(items[2], "unknown", "sampling")
    with_logprobs(items[3], None)  # a writer that does not say: unknown
    write_all(client, items + group("q2", [0, 1, 0, 1], task_type="math"))  # text only: not counted
    samples = scrape(client)
    assert value(samples, "trajectories_logprobs_total", task="math", kind="sampling") == 1
    assert value(samples, "trajectories_logprobs_total", task="math", kind="raw") == 1
    assert value(samples, "trajectories_logprobs_total", task="math", kind="unknown") == 2


def test_trajectories_sampled_under_a_grammar_are_counted_as_constrained(client: TestClient) -> None:
    items = group("q1", [0, 1], task_type="math")
    with_logprobs(items[0], "constrained")
    with_logprobs(items[1], "sampling", "constrained")  # its tool call was forced: not all sampling
    write_all(client, items)
    samples = scrape(client)
    assert value(samples, "trajectories_logprobs_total", task="math", kind="constrained") == 2
    assert value(samples, "trajectories_logprobs_total", task="math", kind="sampling") == 0


def test_a_turn_that_misnames_what_its_logprobs_are_is_refused(client: TestClient) -> None:
    item = with_logprobs(group("q1", [0])[0], "sampled")
    refused = client.post("/buffer/write", json=item)
    assert refused.status_code == 422
    assert "turns.0.logprobs" in refused.text


def test_a_scrape_reads_the_state_of_now_not_of_the_first_scrape(client: TestClient) -> None:
    scrape(client)
    write_all(client, group("q1", [0, 1, 0, 1]))
    assert value(scrape(client), "groups", task="default", state="ready") == 1


LLM_GENERATOR = """
from buffer.toolkit import run_rollouts

TASK_TYPE = "local"

async def run_rollout(data):
    await run_rollouts(data, reward=lambda sample, episode: float(sample.repeat))
"""


def test_llm_metrics_come_from_the_progress_of_the_tasks_jobs(
    make_client: Callable[..., TestClient], generator_dir: Path, tmp_path: Path, simulator: str
) -> None:
    write_generator(generator_dir, "local_generator.py", LLM_GENERATOR)
    write_generator(generator_dir, "waiting_generator.py", WAITING)
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "What is 1 + 1?", "label": "2"}\n{"prompt": "What is 2 + 2?", "label": "4"}\n'
    )
    client = make_client(input_roots=[tmp_path])
    payload = {"task_type": "local", "input_file": str(data), "remote_engine_url": simulator}
    job = client.post("/start_rollout", json={**payload, "num_repeat_per_sample": "2"}).json()
    waiting = client.post("/start_rollout", json={"task_type": "waiting"}).json()
    wait_for(lambda: job_status(client, job["job_id"]) != "running")
    assert job_status(client, job["job_id"]) == "succeeded"

    samples = scrape(client)
    assert value(samples, "jobs", state="succeeded") == 1
    assert value(samples, "jobs", state="running") == 1
    assert value(samples, "jobs", state="failed") == 0
    assert value(samples, "task_jobs", task="local", state="succeeded") == 1
    assert value(samples, "task_jobs", task="waiting", state="running") == 1
    # Two prompts, two answers each, one request each: the simulator never fails here.
    assert value(samples, "llm_requests_total", task="local") == 4
    assert value(samples, "llm_retries_total", task="local") == 0
    assert value(samples, "llm_errors_total", task="local") == 0
    assert value(samples, "generator_trajectories_completed_total", task="local") == 4
    assert value(samples, "llm_request_latency_seconds_count", task="local") == 4
    assert value(samples, "llm_request_latency_seconds_bucket", task="local", le="+Inf") == 4
    assert value(samples, "llm_request_latency_seconds_sum", task="local") > 0
    assert value(samples, "trajectories_written_total", task="local") == 4
    assert value(samples, "llm_finish_reasons_total", task="local", reason="stop") == 4
    assert value(samples, "llm_response_tokens_count", task="local") == 4
    assert value(samples, "llm_response_tokens_sum", task="local") > 0
    assert ("rollout_buffer_generator_trajectories_per_second", (("task", "local"),)) not in samples

    client.post(f"/jobs/{waiting['job_id']}/cancel")
    samples = scrape(client)
    assert value(samples, "jobs", state="cancelled") == 1
    assert value(samples, "jobs", state="running") == 0


def test_progress_counts_requests_retries_and_latency_buckets() -> None:
    progress = Progress("t", total=3)
    progress.record([Completion("a", "stop", latency_s=0.07, attempts=1)])
    # Three requests: one failed and was retried, one continued an aborted answer.
    progress.record([Completion("b", "stop", latency_s=3.0, attempts=3, continuations=1)])
    progress.record([Completion("c", "stop", latency_s=0.1, attempts=1)])
    snapshot = progress.snapshot()
    assert (snapshot["requests"], snapshot["retries"]) == (5, 1)
    buckets = snapshot["latency_s_buckets"]
    bounds = ("0.05", "0.1", "2.5", "5.0", "+Inf")
    assert [buckets[le] for le in bounds] == [0, 2, 2, 3, 3]
    assert snapshot["latency_s_count"] == 3
    assert snapshot["latency_s_sum"] == pytest.approx(3.17)


def test_progress_counts_finish_reasons_and_answer_lengths() -> None:
    progress = Progress("t", total=3)
    progress.record([Completion("a", "stop", usage={"completion_tokens": 7})])
    # No usage: the ids count.
    progress.record([Completion("b", "length", tokens=TokenCapture([9], [1, 2, 3]))])
    progress.record([Completion("c", "length")])  # no length known: not in the mean
    snapshot = progress.snapshot()
    assert snapshot["finish_reasons"] == {"stop": 1, "length": 2}
    assert (snapshot["response_tokens_count"], snapshot["response_tokens_sum"]) == (2, 10)


GRADED_GENERATOR = """
from buffer.toolkit import run_rollouts

TASK_TYPE = "graded"

def reward(sample, episode):
    # Rows marked "graded" score by repeat (their groups are kept), the others all 0 (discarded).
    return float(sample.repeat) if sample.row.get("graded") else 0.0

async def run_rollout(data):
    await run_rollouts(data, reward=reward)
"""


def dashboard_metrics() -> set[str]:
    """The sample names the Grafana dashboard's queries read."""
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return {name for expr in expressions for name in re.findall(r"\brollout_buffer_[a-z_]+", expr)}


def nonzero(samples: dict[tuple[str, Labels], float]) -> set[str]:
    return {name for (name, _), sample in samples.items() if sample}


def test_every_dashboard_metric_has_a_nonzero_sample_from_a_job_in_worker_processes(
    process: Callable[..., str], tmp_path: Path
) -> None:
    """The default isolation (worker processes, two of them): each metric a dashboard query
    reads, by name, has a sample that is not 0 once the job has made trajectories (the LLM
    figures come from the workers' reports), and its last counts survive its stop."""
    generators = tmp_path / "generator"
    generators.mkdir()
    write_generator(generators, "graded_generator.py", GRADED_GENERATOR)
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"What is {n} + {n}?", "label": str(2 * n), "graded": n % 2 == 0} for n in range(4)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    engine = process(
        "-m", "buffer.simulator", "--latency-mean-s", "0.01", "--error-rate", "0.2",
        "--seed", "0", "--log-level", "warning", name="simulator",
    )  # fmt: skip
    url = process(
        "-m", "buffer", "--generator-dir", str(generators), "--group-size", "2",
        "--input-roots", str(tmp_path), "--log-level", "warning", name="service",
    )  # fmt: skip
    with httpx.Client(base_url=url, trust_env=False, timeout=30) as client:
        payload = {
            "task_type": "graded",
            "input_file": str(data),
            "remote_engine_url": engine,
            "num_repeat_per_sample": 2,
            "num_epoch": 100_000,  # runs until cancelled
            "num_process": 4,
            "num_workers": 2,
        }
        started = client.post("/start_rollout", json=payload)
        assert started.status_code == 200, started.text
        job_id = started.json()["job_id"]
        wanted = dashboard_metrics()
        assert len(wanted) >= 15

        def missing() -> set[str]:
            client.post("/get_rollout_data", json={"batch_size": 2})  # delivered groups, their age
            return wanted - nonzero(scrape(client))

        wait_for(lambda: not missing(), timeout_s=120, what="every dashboard metric nonzero")

        line = closing_line(client, job_id)  # the demo's: it stops the job first
        job = client.get(f"/jobs/{job_id}").json()["data"]
        assert job["status"] == "cancelled"
        written, completed = job["counters"]["written"], job["progress"]["completed"]
        assert line.startswith(f"generator: {completed} trajectories ({written} written)")
        # Its workers' last reports (failed trajectories are written too, with FAILURE_REWARD);
        # a write the stop cut short may have reached the buffer uncounted: 4 in flight at most.
        assert 0 < completed <= written <= completed + 4
        assert value(scrape(client), "generator_trajectories_completed_total", task="graded") == completed

        # A job that ends by itself: its last counts are exactly what it wrote.
        finite = client.post("/start_rollout", json={**payload, "num_epoch": 1, "restart": True}).json()
        wait_for(lambda: client.get(f"/jobs/{finite['job_id']}").json()["data"]["status"] != "running", 120)
        job = client.get(f"/jobs/{finite['job_id']}").json()["data"]
        assert job["status"] == "succeeded", job
        assert job["progress"]["completed"] == job["counters"]["written"] == 4 * 2
        total = value(scrape(client), "generator_trajectories_completed_total", task="graded")
        assert total == completed + 4 * 2


def test_a_jobs_progress_adds_up_its_workers_reports_counts_by_name_included() -> None:
    """What /jobs and /metrics read of a job with workers: their reports added up, the finish
    reasons and latency buckets by name; a replaced worker's counts stay, not its rate."""
    running = {
        "completed": 3,
        "trajectories_per_s": 2.0,
        "elapsed_s": 5.0,
        "finish_reasons": {"stop": 2, "length": 1},
        "latency_s_buckets": {"0.1": 1, "+Inf": 3},
    }
    replaced = {
        "completed": 4,
        "trajectories_per_s": 9.0,
        "elapsed_s": 7.0,
        "finish_reasons": {"stop": 4},
        "latency_s_buckets": {"0.1": 4, "+Inf": 4},
    }
    job = Job(id="job-1", task_type="t", generator_file="t_generator.py", data={}, buffer_url="http://x")
    job.workers = [
        cast(Any, SimpleNamespace(outcome=WorkerOutcome("failed", -9, lost=True), progress=lambda: replaced)),
        cast(Any, SimpleNamespace(outcome=None, progress=lambda: running)),
    ]
    assert job.reported_progress() == {
        "completed": 7,
        "trajectories_per_s": 2.0,
        "elapsed_s": 7.0,
        "finish_reasons": {"stop": 6, "length": 1},
        "latency_s_buckets": {"0.1": 5, "+Inf": 7},
    }
    assert replaced["finish_reasons"] == {"stop": 4}  # the reports themselves are left as they were
