"""A job resumed by a service restarted on another port writes where the service is now
(issue 24): its data keeps the address it started with, which named the service then."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.processes import free_port, wait_ready
from buffer.service.job_address import SERVICE_URL_FIELD, rehomed
from tests.support.calls import wait_for
from tests.support.paths import REPO

# Writes a trajectory every 0.1 s to the buffer its data names, until cancelled.
BEACON = """
import asyncio
from buffer.toolkit.sink import open_sink
from tests.support.factories import trajectory

TASK_TYPE = "beacon"

async def run_rollout(data):
    sink = await open_sink(data["remote_buffer_url"])
    try:
        for index in range(10_000):
            await sink.write(trajectory(f"q{index}", task_type=data["task_type"]))
            await asyncio.sleep(0.1)
    finally:
        await sink.aclose()
"""


@contextmanager
def buffer_process(port: int, data_dir: Path, generator_dir: Path, log: Path) -> Iterator[str]:
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port), "--group-size", "1"]
    command += ["--data-dir", str(data_dir), "--generator-dir", str(generator_dir), "--log-level", "info"]
    with log.open("ab") as output:
        process = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", process, 60, "the buffer")
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # a stop, not a crash: its job resumes after
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def written(client: httpx.Client) -> int:
    """The trajectories of the beacon task written so far, restored ones included."""
    tasks: dict[str, Any] = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]
    return int(tasks["beacon"]["total_written"]) if "beacon" in tasks else 0


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_job_resumed_by_the_service_on_another_port_writes_to_it(
    generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "beacon_generator.py").write_text(BEACON)
    data_dir, log = tmp_path / "data", tmp_path / "buffer.log"
    with (
        buffer_process(free_port(), data_dir, generator_dir, log) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        assert client.post("/start_rollout", json={"task_type": "beacon"}).status_code == 200
        wait_for(lambda: written(client) >= 3, 60, "the first run's writes")
    with (
        buffer_process(free_port(), data_dir, generator_dir, log) as url,  # another port
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        restored = written(client)
        assert restored >= 3
        wait_for(lambda: written(client) >= restored + 3, 60, "the resumed job's writes, here")
        (job,) = client.get("/jobs").json()["data"]["jobs"]
        assert job["status"] == "running"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ("http://127.0.0.1:1000", "http://127.0.0.1:2000"),  # the default: the service's own address
        ("http://localhost:1000", "http://localhost:2000"),  # the trainer's name for it: kept
        ("http://192.0.2.1:1000", "http://192.0.2.1:1000"),  # another machine's buffer, on purpose
        ("http://127.0.0.1:3000", "http://127.0.0.1:3000"),  # another buffer of this machine
    ],
)
async def test_a_remote_buffer_url_follows_the_service_only_where_it_named_it(
    sent: str, expected: str
) -> None:
    data = await rehomed({"remote_buffer_url": sent}, "http://127.0.0.1:1000", "http://127.0.0.1:2000")
    assert data == {"remote_buffer_url": expected, SERVICE_URL_FIELD: "http://127.0.0.1:2000"}
