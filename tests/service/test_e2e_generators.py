"""End to end: the shipped generators in the real service, against the real simulated policy
server, driven as a trainer drives them; and the example script itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = REPO
Process = Callable[..., str]


def drain(client: httpx.Client, task_type: str, groups: int, timeout_s: float = 60) -> list[Any]:
    """Poll as slime's trainer does until all ``groups`` groups have finished, returned or
    discarded; returns the items read."""
    items: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.post("/get_rollout_data", json={"task_type": task_type, "wait_s": 1})
        response.raise_for_status()
        body = response.json()
        if body["success"]:
            items += body["data"]["data"]
        task = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"][task_type]
        settled = task["delivered_groups"] + sum(task["discarded_groups"].values()) + task["set_aside_groups"]
        if settled == groups and not task["ready_groups"]:
            return items
        assert time.monotonic() < deadline, f"only {settled} of {groups} groups finished"


def wait_job(client: httpx.Client, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()["data"]
        if job["status"] != "running":
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still running")


def math_rows(path: Path, count: int) -> Path:
    rows = [
        {"instance_id": f"m{i}", "prompt": f"What is {i} + {i + 2}?", "label": str(2 * i + 2)}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_math_generator_runs_through_aborts_and_errors_and_its_groups_reach_the_trainer(
    process: Process, tmp_path: Path
) -> None:
    engine = process(
        "-m", "buffer.simulator", "--latency-mean-s", "0.02", "--accuracy", "0.5", "--abort-rate", "0.3",
        "--error-rate", "0.2", "--seed", "1", "--log-level", "warning", name="simulator",
    )  # fmt: skip
    buffer_url = process("buffer.py", "--log-level", "warning", "--input-roots", str(tmp_path), name="buffer")
    with httpx.Client(base_url=buffer_url, timeout=30, trust_env=False) as client:
        started_job = client.post(
            "/start_rollout",
            json={
                "task_type": "math",
                "input_file": str(math_rows(tmp_path / "math.jsonl", 6)),
                "remote_engine_url": engine,
                "num_repeat_per_sample": "4",
                "num_epoch": "1",
                "num_process": "16",
                "abort_retry_delay_s": 0.01,
                "sampling_params": {"max_tokens": 256, "temperature": 1.0},
            },
        ).json()
        items = drain(client, "math", groups=6)
        job = wait_job(client, started_job["job_id"])
    assert job["status"] == "succeeded"
    assert job["progress"]["completed"] == 24
    assert items, "some groups have both right and wrong answers at accuracy 0.5"
    infos = [item["extra_info"] for item in items if "padded_from" not in item["extra_info"]]
    assert {info["finish_reason"] for info in infos} <= {"stop", "length", "abort", "error"}
    assert any(info["continuations"] for info in infos)  # aborted answers were continued
    assert any(info["attempts"] > 1 + info["continuations"] for info in infos)  # errors were retried
    assert {item["raw_reward"] for item in items} <= {0.0, 1.0, -1.0}
    assert all(item["extra_info"]["label"] == str(2 * int(item["instance_id"][1:]) + 2) for item in items)


def test_the_calculator_generator_uses_its_tool_and_its_own_data(process: Process) -> None:
    engine = process("-m", "buffer.simulator", "--latency-mean-s", "0.01", "--seed", "2", name="simulator")
    buffer_url = process("buffer.py", "--log-level", "warning", name="buffer")
    with httpx.Client(base_url=buffer_url, timeout=30, trust_env=False) as client:
        job = client.post(
            "/start_rollout",
            json={"task_type": "calculator", "remote_engine_url": engine, "num_repeat_per_sample": "2"},
        ).json()
        done = wait_job(client, job["job_id"])
        read = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]["calculator"]
    assert done["status"] == "succeeded", done
    assert done["progress"]["completed"] == 64  # 32 problems of generator/data/calculator.jsonl, twice
    assert read["total_written"] == 64
    assert done["progress"]["failed"] == 0


def test_the_example_script_runs_and_stops_everything(tmp_path: Path) -> None:
    env = {**os.environ, "STEPS": "2", "LOG_DIR": str(tmp_path), "PYTHON": sys.executable}
    command = [
        "bash",
        str(REPO / "rollout_buffer_example.sh"),
        "--groups-per-step",
        "4",
        "--sim-latency-s",
        "0.05",
    ]
    result = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1", "step 2"]
    assert all("4 groups, 32 samples, mean raw reward" in line for line in steps)
    assert any(line.startswith("stopped rollout buffer") for line in lines)
    assert any(line.startswith("stopped simulated policy server") for line in lines)


def test_a_long_poll_its_client_abandoned_takes_nothing(process: Process, tmp_path: Path) -> None:
    buffer_url = process(
        "buffer.py",
        "--group-size",
        "4",
        "--log-level",
        "warning",
        "--input-roots",
        str(tmp_path),
        name="buffer",
    )
    item = {"instance_id": "q", "messages": [{"role": "user", "content": "q"}], "extra_info": {}}
    with httpx.Client(base_url=buffer_url, timeout=10, trust_env=False) as client:
        client.post("/buffer/write", json={**item, "reward": 0.0})
        with pytest.raises(httpx.ReadTimeout):  # the trainer gives up on its read
            client.post("/get_rollout_data", json={"wait_s": 5}, timeout=0.5)
        for reward in (1.0, 0.0, 1.0):  # the group completes while that read still waits
            client.post("/buffer/write", json={**item, "reward": reward})
        time.sleep(1.5)  # the abandoned read most likely woke by now (if not, this read races it)
        # A read that waits: a group the abandoned read held and gave back is taken here too.
        body = client.post("/get_rollout_data", json={"wait_s": 30}, timeout=60).json()
    assert len(body["data"]["data"]) == 4  # the group went to the next read, not to the closed one


def test_a_wrong_model_name_fails_the_job_with_the_engines_message(process: Process, tmp_path: Path) -> None:
    """vLLM answers a wrong model name with a 404: the job fails at once, saying so, and writes nothing."""
    import http.server
    import threading

    said = "The model `no-such-model` does not exist."

    class Vllm(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = json.dumps(
                {"error": {"message": said, "type": "NotFoundError", "param": "model", "code": 404}}
            )
            self.send_response(404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, format: str, *args: Any) -> None:
            return None

    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Vllm)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        buffer_url = process(
            "buffer.py", "--log-level", "warning", "--input-roots", str(tmp_path), name="buffer"
        )
        with httpx.Client(base_url=buffer_url, timeout=30, trust_env=False) as client:
            started = client.post(
                "/start_rollout",
                json={
                    "task_type": "math",
                    "input_file": str(math_rows(tmp_path / "math.jsonl", 200)),
                    "remote_engine_url": f"http://127.0.0.1:{engine.server_address[1]}",
                    "model": "no-such-model",
                    "num_repeat_per_sample": "8",
                    "num_process": "64",
                },
            ).json()
            job = wait_job(client, started["job_id"], timeout_s=30)
            written = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"].get("math", {})
    finally:
        engine.shutdown()
        engine.server_close()
    assert job["status"] == "failed"
    assert said in job["error"]
    assert "HTTP 404" in job["error"]
    assert written.get("total_written", 0) == 0
