"""``rollout-buffer status`` and ``rollout-buffer tail`` against the real service, and ``/buffer/tail``.

The service runs once for the module (``python buffer.py`` on a free loopback port, group size 2,
with one generator that fails to import); each test writes to its own task so they stay apart.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from buffer.processes import free_port, started, wait_ready
from tests.support.factories import trajectory
from tests.support.paths import REPO

REPO_ROOT = REPO


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("console")
    generators = directory / "generator"
    generators.mkdir()
    (generators / "broken_generator.py").write_text('raise RuntimeError("no model configured")\n')
    port = free_port()
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--group-size", "2", "--log-level", "warning", "--generator-dir", str(generators)]
    with started(command, "buffer", directory / "buffer.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the buffer")
        yield f"http://127.0.0.1:{port}"


def write(url: str, *items: dict[str, Any]) -> None:
    response = httpx.post(f"{url}/buffer/write_batch", json=list(items), trust_env=False, timeout=30)
    assert response.status_code == 200, response.text


def console(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "buffer", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO_ROOT, check=False)


@pytest.fixture
def start_tail() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``rollout-buffer tail`` in the background, returned once it follows (its note on
    stderr); any still running at the end of the test is killed."""
    processes: list[subprocess.Popen[str]] = []

    def start(url: str, *args: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "buffer", "tail", "--url", url, "--interval-s", "0.1", *args]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT
        )
        processes.append(process)
        assert process.stderr is not None
        note = process.stderr.readline()
        assert note.startswith("following "), note
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_status_lists_tasks_counts_and_failed_generators(url: str) -> None:
    write(
        url,
        trajectory("a", 1.0, task_type="status"),
        trajectory("a", 0.0, task_type="status"),
        trajectory("b", 1.0, task_type="status"),
    )

    result = console("status", "--url", url, "--sample-s", "0.2")

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["task", "group"])
    assert header.split() == [
        "task", "group", "pending", "ready", "delivered", "discarded", "written", "rate/s", "reward",
    ]  # fmt: skip
    row = next(line for line in lines if line.split()[:1] == ["status"])
    # group size 2: "a" is ready, "b" pending; three written, rewards 1, 0, 1.
    assert row.split()[:7] == ["status", "2", "1", "1", "0", "0", "3"]
    assert row.endswith("0.667 ± 0.577")
    assert "Jobs" in lines
    failed = lines[lines.index("Failed generators") + 2]
    assert "broken" in failed
    assert "RuntimeError: no model configured" in failed


def test_status_of_a_closed_port_fails_in_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    result = console("status", "--url", url)

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"rollout-buffer status: cannot reach the buffer at {url}")


def test_tail_from_start_prints_the_recent_ones(url: str) -> None:
    items = [trajectory(f"q{index}", index / 2, task_type="from-start") for index in range(3)]
    write(url, *items)

    result = console("tail", "--url", url, "--task", "from-start", "--from-start", "--limit", "3")

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    for line, item in zip(lines, items, strict=True):
        fields = line.split()
        assert fields[1:4] == ["from-start", item["instance_id"], item["uid"]]
        assert fields[4:] == ["reward", f"{item['reward']:.4f}"]


def test_tail_follows_only_new_trajectories(
    url: str, start_tail: Callable[..., subprocess.Popen[str]]
) -> None:
    old = trajectory("old", task_type="follow")
    write(url, old)
    process = start_tail(url, "--task", "follow", "--limit", "2")
    new = [trajectory("new", 1.0, task_type="follow"), trajectory("new", 0.0, task_type="follow")]

    write(url, trajectory("elsewhere", task_type="other"), new[0])
    write(url, new[1])
    stdout, _ = process.communicate(timeout=20)

    assert process.returncode == 0
    assert [line.split()[3] for line in stdout.splitlines()] == [item["uid"] for item in new]


def test_tail_stops_cleanly_on_ctrl_c(url: str, start_tail: Callable[..., subprocess.Popen[str]]) -> None:
    process = start_tail(url)

    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=20)

    assert process.returncode == 0
    assert (stdout, stderr) == ("", "")


def test_tail_route_pages_after_a_sequence_number(make_client: Callable[..., TestClient]) -> None:
    client = make_client(group_size=2)
    items = [trajectory(f"q{index}", float(index)) for index in range(5)]
    assert client.post("/buffer/write_batch", json=items).status_code == 200

    def tail(**params: Any) -> dict[str, Any]:
        response = client.get("/buffer/tail", params=params)
        assert response.status_code == 200, response.text
        assert response.json()["success"] is True
        data: dict[str, Any] = response.json()["data"]
        return data

    everything = tail(after=0)
    assert [item["uid"] for item in everything["items"]] == [item["uid"] for item in items]
    assert [item["seq"] for item in everything["items"]] == [1, 2, 3, 4, 5]
    assert everything["last_seq"] == 5
    first = everything["items"][0]
    assert (first["task_type"], first["instance_id"], first["reward"]) == ("default", "q0", 0.0)
    assert isinstance(first["time"], float)

    page = tail(after=2, limit=2)
    assert ([item["seq"] for item in page["items"]], page["last_seq"]) == ([3, 4], 4)
    assert tail(after=5) == {"items": [], "last_seq": 5}
    assert tail(after=10**9) == {"items": [], "last_seq": 5}  # where the present is
    assert len(tail()["items"]) == 5  # after defaults to 0

    for limit in (0, 1001):
        refused = client.get("/buffer/tail", params={"limit": limit})
        assert refused.status_code == 422
        assert refused.json()["errors"][0]["field"] == "limit"
    assert client.get("/buffer/tail", params={"after": -1}).status_code == 422


def test_tail_route_on_an_empty_buffer(make_client: Callable[..., TestClient]) -> None:
    response = make_client(group_size=2).get("/buffer/tail")
    assert response.json()["data"] == {"items": [], "last_seq": 0}
