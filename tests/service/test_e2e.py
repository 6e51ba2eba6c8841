"""End to end: the real service in a subprocess on a loopback port, driven as slime's trainer
drives it (``slime_plugins/rollout_buffer/rollout_buffer_example.py``).

Each test starts ``python buffer.py`` with its own generator folder, waits for ``/health``
and stops the process afterwards, whether the test passed or not.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from tests.support.paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

REPO_ROOT = REPO
GROUP_SIZE = 4
REQUIRED_KEYS = {"uid", "instance_id", "messages", "reward", "extra_info"}
META_KEYS = {"total_samples", "num_groups", "avg_group_size", "avg_reward", "finished_groups"}

# --- generators ------------------------------------------------------------------------

# Writes GROUP_SIZE trajectories for each of three instances over HTTP, rewards varied in
# [0, 1]; one trajectory of "inst-c" failed (reward -1). It records the data it was given
# and waits for a "go" file first, so the test can see the job running.
REPLAY_GENERATOR = """
import json
import time
from pathlib import Path

import httpx

TASK_TYPE = "replay"
HERE = Path(__file__).resolve().parent
INSTANCES = ["inst-a", "inst-b", "inst-c"]
FAILED = ("inst-c", 2)


def reward_for(index, k, n):
    if (INSTANCES[index], k) == FAILED:
        return -1.0
    return ((index + k) % n) / max(n - 1, 1)


def run_rollout(data):
    (HERE / "received.json").write_text(json.dumps(data))
    deadline = time.monotonic() + 30
    while not (HERE / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never created the go file")
        time.sleep(0.02)
    n = int(data["num_repeat_per_sample"])
    url = data["remote_buffer_url"] + "/buffer/write"
    with httpx.Client(timeout=10, trust_env=False) as client:
        for index, instance_id in enumerate(INSTANCES):
            for k in range(n):
                trajectory = {
                    "uid": f"{instance_id}-{k}",
                    "instance_id": instance_id,
                    "messages": [
                        {"role": "user", "content": f"question {instance_id}"},
                        {"role": "assistant", "content": f"answer {k}"},
                    ],
                    "reward": reward_for(index, k, n),
                    "extra_info": {"timestamp": time.time(), "k": k},
                }
                response = client.post(url, json=trajectory)
                response.raise_for_status()
                assert response.json()["success"], response.text
"""

BOOM_SYNC_GENERATOR = """
TASK_TYPE = "boom_sync"


def run_rollout(data):
    raise RuntimeError("sync generator exploded on purpose")
"""

BOOM_ASYNC_GENERATOR = """
TASK_TYPE = "boom_async"


async def run_rollout(data):
    raise ValueError("async generator exploded on purpose")
"""

BOOM_EXIT_GENERATOR = """
import sys

TASK_TYPE = "boom_exit"


def run_rollout(data):
    sys.exit(3)
"""


def replay_rewards(n: int) -> dict[str, list[float]]:
    """The raw rewards REPLAY_GENERATOR writes, by instance id, in writing order."""
    instances = ["inst-a", "inst-b", "inst-c"]
    return {
        instance_id: [
            -1.0 if (instance_id, k) == ("inst-c", 2) else ((index + k) % n) / max(n - 1, 1) for k in range(n)
        ]
        for index, instance_id in enumerate(instances)
    }


# --- the service -------------------------------------------------------------------------


@dataclass
class Service:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_env() -> dict[str, str]:
    """The environment without the service's own variables, so flags alone configure it."""
    return {key: value for key, value in os.environ.items() if not key.startswith("ROLLOUT_BUFFER_")}


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10, trust_env=False) as http:
        yield http


@pytest.fixture
def start_service(tmp_path: Path, client: httpx.Client) -> Iterator[Callable[[dict[str, str]], Service]]:
    """Write the given generator files into ``tmp_path``, start the service over that folder
    and wait until ``/health`` answers. Every process started is stopped at teardown."""
    started: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def start(generators: dict[str, str]) -> Service:
        for name, source in generators.items():
            (tmp_path / name).write_text(textwrap.dedent(source))
        port = _free_port()
        log_path = tmp_path / f"service-{port}.log"
        log_file = log_path.open("wb")
        process = subprocess.Popen(
            [
                sys.executable,
                "buffer.py",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--generator-dir",
                str(tmp_path),
                "--log-level",
                "warning",
                "--input-roots",
                "/",  # slime's payload names a file on the trainer's machine
            ],
            cwd=REPO_ROOT,
            env=_clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        started.append((process, log_file))
        service = Service(f"http://127.0.0.1:{port}", process, log_path)
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"the service exited with {process.returncode} before it was ready:\n{service.log()}"
                )
            try:
                if client.get(f"{service.url}/health", timeout=1).status_code == 200:
                    return service
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the service was not ready within 30 s:\n{service.log()}")
            time.sleep(0.05)

    yield start
    for process, log_file in started:
        try:
            _stop(process)
        finally:
            log_file.close()


# --- helpers ------------------------------------------------------------------------------


def wait_for(
    what: str, check: Callable[[], Any], timeout_s: float = 20, service: Service | None = None
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if service is not None and service.process.poll() is not None:
            pytest.fail(f"the service died while waiting for {what}:\n{service.log()}")
        if time.monotonic() > deadline:
            log = f":\n{service.log()}" if service is not None else ""
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}{log}")
        time.sleep(0.05)


def post_get_rollout_data(client: httpx.Client, url: str, with_body: bool) -> httpx.Response:
    if with_body:
        return client.post(f"{url}/get_rollout_data", json={})
    return client.post(f"{url}/get_rollout_data")


def trainer_get_rollout_data(
    client: httpx.Client, service: Service, with_body: bool, timeout_s: float = 20
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """slime's ``get_rollout_data``: raise_for_status, loop while ``success`` is false, then
    unwrap ``data`` and check every item has the required keys."""

    def attempt() -> dict[str, Any] | None:
        response = post_get_rollout_data(client, service.url, with_body)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body if body["success"] else None

    body = wait_for("rollout data", attempt, timeout_s, service)
    data = body["data"]
    assert isinstance(data, dict)
    assert "data" in data
    meta_info, items = data["meta_info"], data["data"]
    for item in items:
        assert item.keys() >= REQUIRED_KEYS, item
    return items, meta_info


def assert_nothing_ready(client: httpx.Client, url: str) -> None:
    """Nothing ready is an HTTP 200 with success false and an empty list, both ways of asking."""
    for with_body in (True, False):
        response = post_get_rollout_data(client, url, with_body)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["success"] is False, body
        assert set(body["data"]) == {"data", "meta_info"}, body
        assert body["data"]["data"] == []
        assert isinstance(body["data"]["meta_info"], dict)
        assert body["data"]["meta_info"].keys() >= META_KEYS, body


def job_status(client: httpx.Client, url: str, job_id: str) -> dict[str, Any]:
    response = client.get(f"{url}/jobs/{job_id}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True
    job: dict[str, Any] = body["data"]
    return job


def wait_for_job(
    client: httpx.Client, service: Service, job_id: str, timeout_s: float = 10
) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        job = job_status(client, service.url, job_id)
        return job if job["status"] != "running" else None

    result: dict[str, Any] = wait_for(f"{job_id} to finish", finished, timeout_s, service)
    return result


def slime_start_payload(remote_buffer_url: str | None, engine_url: str, input_file: Path) -> dict[str, Any]:
    """Exactly what slime's trainer POSTs to /start_rollout: numbers as strings. The start is
    refused unless the engine answers and the input file exists."""
    payload: dict[str, Any] = {
        "num_process": "100",
        "num_epoch": "3",
        "remote_engine_url": engine_url,
        "task_type": "replay",
        "input_file": str(input_file),
        "num_repeat_per_sample": str(GROUP_SIZE),
        "max_tokens": "512",
        "sampling_params": {"max_tokens": 512, "temperature": 0.8, "top_p": 1.0},
        "tokenizer_path": "/nonexistent",
        "skip_instance_ids": [],
    }
    if remote_buffer_url is not None:
        payload["remote_buffer_url"] = remote_buffer_url
    return payload


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("send_buffer_url", "read_with_body"),
    [pytest.param(False, True, id="buffer-url-omitted"), pytest.param(True, False, id="buffer-url-set")],
)
def test_slime_trainer_round_trip(
    start_service: Callable[[dict[str, str]], Service],
    client: httpx.Client,
    tmp_path: Path,
    send_buffer_url: bool,
    read_with_body: bool,
) -> None:
    service = start_service({"replay_generator.py": REPLAY_GENERATOR})

    root = client.get(f"{service.url}/")
    assert root.status_code == 200
    assert root.json()["message"] == "Rollout Buffer Server is running"

    # The trainer may poll before anything exists: a 200 saying there is nothing.
    assert_nothing_ready(client, service.url)

    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "1 + 1?", "label": "2"}\n')
    # The replay generator calls no engine: any address that answers /health will do.
    payload = slime_start_payload(service.url if send_buffer_url else None, service.url, rows)
    started = client.post(f"{service.url}/start_rollout", json=payload)
    assert started.status_code == 200, started.text
    first = started.json()
    assert first["success"] is True, first
    job_id = first["job_id"]
    assert first["job"]["status"] == "running"

    # The generator got the trainer's dict, numbers parsed, the buffer's URL filled in.
    received_path = tmp_path / "received.json"
    wait_for("the generator to start", received_path.exists, 10, service)
    received = json.loads(received_path.read_text())
    assert received["remote_buffer_url"] == service.url
    assert received["num_repeat_per_sample"] == GROUP_SIZE
    assert received["task_type"] == "replay"
    assert received["input_file"] == str(rows.resolve())
    assert received["sampling_params"] == payload["sampling_params"]

    # Starting the running task again answers with the running job, not a second one.
    again = client.post(f"{service.url}/start_rollout", json=payload)
    assert again.status_code == 200, again.text
    assert again.json()["success"] is True
    assert again.json()["job_id"] == job_id
    jobs = client.get(f"{service.url}/jobs").json()["data"]["jobs"]
    assert [job["id"] for job in jobs] == [job_id]
    assert jobs[0]["status"] == "running"

    # Running but nothing written yet: still a 200 with nothing.
    assert_nothing_ready(client, service.url)

    (tmp_path / "go").touch()
    job = wait_for_job(client, service, job_id)
    assert job["status"] == "succeeded", job
    assert job["error"] is None
    assert job["counters"]["written"] == 3 * GROUP_SIZE
    jobs = client.get(f"{service.url}/jobs").json()["data"]["jobs"]
    assert [(job["id"], job["status"]) for job in jobs] == [(job_id, "succeeded")]

    items, meta_info = trainer_get_rollout_data(client, service, read_with_body)

    # Whole groups of exactly num_repeat_per_sample, every uid distinct.
    groups: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        groups.setdefault(item["instance_id"], []).append(item)
    raw = replay_rewards(GROUP_SIZE)
    assert set(groups) == set(raw)
    assert all(len(group) == GROUP_SIZE for group in groups.values())
    uids = [item["uid"] for item in items]
    assert len(set(uids)) == len(uids), uids

    # meta_info covers everything written since the last read, the failed trajectory too.
    assert meta_info.keys() >= META_KEYS, meta_info
    all_raw = [reward for rewards in raw.values() for reward in rewards]
    assert meta_info["total_samples"] == len(all_raw)
    assert meta_info["num_groups"] == len(raw)
    assert meta_info["avg_group_size"] == pytest.approx(GROUP_SIZE)
    assert meta_info["avg_reward"] == pytest.approx(sum(all_raw) / len(all_raw))
    assert sorted(meta_info["finished_groups"]) == sorted(groups)

    for instance_id, group in groups.items():
        written = [reward for reward in raw[instance_id] if reward >= 0]
        for item in group:
            assert "raw_reward" in item, item
            assert 0 <= item["raw_reward"] <= 1, item  # the failed one was filtered out
            assert isinstance(item["messages"], list)
            assert isinstance(item["extra_info"], dict)
        # GRPO: the group's normalised rewards average to zero.
        assert sum(item["reward"] for item in group) / len(group) == pytest.approx(0, abs=1e-6), group
        originals = [item for item in group if "padded_from" not in item["extra_info"]]
        assert sorted(item["raw_reward"] for item in originals) == pytest.approx(sorted(written))
        if len(written) == GROUP_SIZE:
            assert len(originals) == GROUP_SIZE
            mean = sum(written) / len(written)
            std = math.sqrt(sum((r - mean) ** 2 for r in written) / len(written))
            for item in group:
                assert item["reward"] == pytest.approx((item["raw_reward"] - mean) / std, abs=1e-6)
        else:
            # The failed trajectory was dropped and the group padded with fresh uids.
            assert instance_id == "inst-c"
            assert "inst-c-2" not in {item["uid"] for item in group}
            copies = [item for item in group if "padded_from" in item["extra_info"]]
            assert len(copies) == GROUP_SIZE - len(written)
            original_uids = {item["uid"] for item in originals}
            for copy in copies:
                assert copy["extra_info"]["padded_from"] in original_uids
                assert copy["uid"] not in original_uids

    # Everything was taken: the next polls find nothing, and the window started afresh.
    assert_nothing_ready(client, service.url)
    empty = client.post(f"{service.url}/get_rollout_data", json={}).json()
    assert empty["data"]["meta_info"]["total_samples"] == 0
    assert empty["data"]["meta_info"]["finished_groups"] == []
    assert service.process.poll() is None


@pytest.mark.parametrize("argv", [["buffer.py"], ["-m", "buffer"]], ids=["buffer.py", "python-m-buffer"])
def test_help(argv: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, *argv, "--help"],
        cwd=REPO_ROOT,
        env=_clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for flag in ("--port", "--generator-dir", "--group-size", "--host", "--log-level"):
        assert flag in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("filename", "source", "error"),
    [
        pytest.param(
            "boom_sync_generator.py",
            BOOM_SYNC_GENERATOR,
            "RuntimeError: sync generator exploded on purpose",
            id="sync-raises",
        ),
        pytest.param(
            "boom_async_generator.py",
            BOOM_ASYNC_GENERATOR,
            "ValueError: async generator exploded on purpose",
            id="async-raises",
        ),
        pytest.param("boom_exit_generator.py", BOOM_EXIT_GENERATOR, "SystemExit: 3", id="sync-exits"),
    ],
)
def test_failing_generator_does_not_take_the_service_down(
    start_service: Callable[[dict[str, str]], Service],
    client: httpx.Client,
    filename: str,
    source: str,
    error: str,
) -> None:
    service = start_service({filename: source})
    task_type = filename.removesuffix("_generator.py")
    response = client.post(
        f"{service.url}/start_rollout", json={"task_type": task_type, "num_repeat_per_sample": "2"}
    )
    assert response.status_code == 200, response.text
    job_id = response.json()["job_id"]

    job = wait_for_job(client, service, job_id)
    assert job["status"] == "failed", job
    assert job["task_type"] == task_type
    assert job["error"] == error
    last_line = len(source.splitlines())  # where each of them fails
    assert job["where"].endswith(f"/{filename}:{last_line} in run_rollout"), job
    assert "traceback" not in job
    assert job["finished_at"] is not None

    # The service still answers, and the failed task can be started again.
    assert service.process.poll() is None
    assert client.get(f"{service.url}/health").json()["status"] == "ok"
    assert client.get(f"{service.url}/").json()["message"] == "Rollout Buffer Server is running"
    assert_nothing_ready(client, service.url)
    retry = client.post(f"{service.url}/start_rollout", json={"task_type": task_type})
    assert retry.status_code == 200, retry.text
    assert retry.json()["message"] == "Rollout started"
    assert retry.json()["job_id"] != job_id
    assert wait_for_job(client, service, retry.json()["job_id"])["status"] == "failed"
    jobs = client.get(f"{service.url}/jobs").json()["data"]["jobs"]
    assert [job["status"] for job in jobs] == ["failed", "failed"]
