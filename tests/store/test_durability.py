"""Nothing lost: restarts on a data folder, export, backpressure, SIGTERM, SIGKILL, a soak."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from buffer.processes import free_port, wait_ready
from buffer.service.app import create_app
from buffer.service.settings import Settings
from buffer.toolkit.sink import HttpSink
from tests.support.factories import group, trajectory
from tests.support.paths import REPO

ROOT = REPO


@contextmanager
def service(generator_dir: Path, data_dir: Path | None, **overrides: Any) -> Iterator[TestClient]:
    settings = Settings(generator_dir=generator_dir, data_dir=data_dir, group_size=4, **overrides)
    with TestClient(create_app(settings)) as client:
        yield client


def uids(answer: dict[str, Any]) -> list[str]:
    return [item["uid"] for item in answer["data"]["data"]]


def restorable(stats: dict[str, Any]) -> dict[str, Any]:
    """``/buffer/stats`` less the trainer's lag, which each process counts afresh."""
    for counters in stats["meta_info"]["tasks"].values():
        del counters["served_age_s_sum"], counters["served_age_count"]
    return stats


def test_a_restart_on_the_data_folder_restores_the_buffer(generator_dir: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with service(generator_dir, data_dir) as client:
        client.post("/buffer/write_batch", json=group("q1", [0, 1, 0, 1]))
        client.post("/buffer/write_batch", json=group("q2", [1, 0, 1, 0]))
        first = client.post("/get_rollout_data", json={"batch_size": 4}).json()
        client.post("/buffer/write_batch", json=group("q3", [0, 1]))  # pending
        stats = restorable(client.get("/buffer/stats").json()["data"])
    with service(generator_dir, data_dir) as client:
        assert restorable(client.get("/buffer/stats").json()["data"]) == stats
        second = client.post("/get_rollout_data", json={}).json()
        assert {item["instance_id"] for item in second["data"]["data"]} == {"q2"}
        assert not set(uids(first)) & set(uids(second))
        client.post("/buffer/write_batch", json=group("q3", [1, 0]))  # the pending group completes
        third = client.post("/get_rollout_data", json={}).json()
        assert {item["instance_id"] for item in third["data"]["data"]} == {"q3"}


def test_task_settings_survive_a_restart(generator_dir: Path, tmp_path: Path) -> None:
    (generator_dir / "math_generator.py").write_text('TASK_TYPE = "math"\ndef run_rollout(data):\n    pass\n')
    data_dir = tmp_path / "data"
    with service(generator_dir, data_dir) as client:
        start = {"task_type": "math", "num_repeat_per_sample": 2, "group_timeout_seconds": 77}
        assert client.post("/start_rollout", json=start).status_code == 200
    with service(generator_dir, data_dir) as client:
        math = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]["math"]
        assert math["group_size"] == 2
        client.post("/buffer/write_batch", json=group("q1", [0, 1]))  # unlabelled: the current task
        answer = client.post("/get_rollout_data", json={"task_type": "math"}).json()
        assert len(answer["data"]["data"]) == 2


def test_export_streams_what_reads_delivered_since_a_time(generator_dir: Path, tmp_path: Path) -> None:
    with service(generator_dir, tmp_path / "data") as client:
        client.post("/buffer/write_batch", json=group("q1", [0, 1, 0, 1]))
        first = client.post("/get_rollout_data", json={}).json()
        time.sleep(0.01)
        middle = time.time()
        client.post("/buffer/write_batch", json=group("q2", [0, 1, 0, 1]))
        second = client.post("/get_rollout_data", json={}).json()
        everything = client.get("/buffer/export")
        assert everything.status_code == 200
        assert everything.headers["content-type"] == "application/x-ndjson"
        lines = [orjson.loads(line) for line in everything.content.splitlines()]
        assert [line["trajectory"]["uid"] for line in lines] == uids(first) + uids(second)
        assert [line["read_id"] for line in lines] == [1] * 4 + [2] * 4
        since = client.get("/buffer/export", params={"since": middle}).content.splitlines()
        assert [orjson.loads(line)["trajectory"]["uid"] for line in since] == uids(second)
        iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(middle - 3600)) + "Z"
        assert len(client.get("/buffer/export", params={"since": iso}).content.splitlines()) == 8
        bad = client.get("/buffer/export", params={"since": "yesterday"})
        assert bad.status_code == 422
        assert "since" in bad.json()["message"]


def test_export_needs_a_data_folder(generator_dir: Path) -> None:
    with service(generator_dir, None) as client:
        response = client.get("/buffer/export")
    assert response.status_code == 409
    assert "--data-dir" in response.json()["message"]


def test_a_full_buffer_answers_429_with_retry_after_and_keeps_what_it_has(generator_dir: Path) -> None:
    with service(generator_dir, None, max_buffered_trajectories=4) as client:
        client.post("/buffer/write_batch", json=group("q1", [0, 1, 0]))
        client.post("/buffer/write", json=trajectory("q2", 1))
        refused = client.post("/buffer/write", json=trajectory("q3", 1))
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert "--max-buffered-trajectories" in refused.json()["message"]
        assert client.post("/buffer/write", json=trajectory("q1", 1)).status_code == 200  # q1 is open
        answer = client.post("/get_rollout_data", json={}).json()
        assert {item["instance_id"] for item in answer["data"]["data"]} == {"q1"}
        assert client.post("/buffer/write", json=trajectory("q3", 1)).status_code == 200  # room again


@pytest.mark.anyio
async def test_the_http_sink_slows_down_on_429_and_loses_nothing(generator_dir: Path) -> None:
    """A generator faster than the trainer: every trajectory arrives, none twice."""
    settings = Settings(generator_dir=generator_dir, group_size=2, max_buffered_trajectories=8)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://buffer") as client:
            sink = HttpSink("http://buffer", client=client, batch_size=4, backoff_s=0.01, max_backoff_s=0.05)
            written = [item for i in range(20) for item in group(f"q{i}", [0, 1])]
            received: list[str] = []

            async def trainer() -> None:
                while len(received) < len(written):
                    answer = (await client.post("/get_rollout_data", json={"batch_size": 4})).json()
                    received.extend(uids(answer))
                    await asyncio.sleep(0.05)

            reading = asyncio.create_task(trainer())
            for item in written:
                await sink.write(item)
            await sink.aclose()
            await asyncio.wait_for(reading, 30)
    assert sorted(received) == sorted(item["uid"] for item in written)


@contextmanager
def buffer_process(data_dir: Path, log: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port), "--group-size", "4"]
    command += ["--data-dir", str(data_dir), "--log-level", "info", *extra]
    with log.open("ab") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", process, 60, "the buffer")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_flushes_exits_0_and_a_restart_has_everything(tmp_path: Path) -> None:
    log = tmp_path / "buffer.log"
    with buffer_process(tmp_path / "data", log, "--durability", "flush") as (process, url):
        with httpx.Client(base_url=url, timeout=30) as client:
            client.post("/buffer/write_batch", json=group("q1", [0, 1, 0, 1]) + group("q2", [1, 0]))
            client.post("/get_rollout_data", json={})  # q1 delivered
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    assert "the buffer is on disk in" in log.read_text()
    with buffer_process(tmp_path / "data", log) as (process, url):
        stats = httpx.get(f"{url}/buffer/stats").json()["data"]
        assert stats["data"][0]["pending_items"] == 2
        assert stats["data"][0]["total_read"] == 4


def test_a_long_poll_in_flight_is_answered_when_sigterm_comes(tmp_path: Path) -> None:
    with buffer_process(tmp_path / "data", tmp_path / "buffer.log") as (process, url):

        async def poll_then_stop() -> tuple[int, float]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                poll = asyncio.create_task(client.post("/get_rollout_data", json={"wait_s": 250}))
                await asyncio.sleep(1.0)  # the poll is waiting in the service
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                response = await poll
                return response.status_code, time.monotonic() - started

        status, waited_s = asyncio.run(poll_then_stop())
        assert status == 200
        assert waited_s < 60  # not the 250 s it asked to wait (with slack for a loaded machine)
        assert process.wait(timeout=60) == 0


def run_soak(*args: str) -> dict[str, Any]:
    """bench/soak.py's figures. Its amounts are counts (``--kills``, ``--min-acked``), not what
    fits in its seconds, and its drain waits for the last read however long (up to 300 s): a
    loaded machine makes the run longer, never smaller or a failure."""
    command = [sys.executable, "bench/soak.py", "--json", "--drain-s", "300", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout + done.stderr
    figures: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return figures


@pytest.mark.timeout(900)
def test_sigkill_in_the_middle_of_writes_and_reads_loses_nothing_and_repeats_nothing() -> None:
    """bench/soak.py kills the service with SIGKILL every 3 s, each kill timed to a read in
    flight, and restarts it on its folder; compaction runs every MiB. Writers retry until
    acknowledged. Every acknowledged uid is delivered exactly once."""
    figures = run_soak(
        "--seconds",
        "14",
        "--kill-every",
        "3",
        "--kills",
        "3",
        "--min-acked",
        "101",
        "--kill-on-read",
        "--compact-bytes",
        "1048576",
        "--writers",
        "6",
    )
    assert figures["kills"] >= 3
    assert figures["acked"] > 100
    assert figures["lost"] == 0
    assert figures["received_twice"] == figures["exported_twice"] == 0


@pytest.mark.timeout(900)
def test_thirty_seconds_of_writers_and_readers_deliver_every_uid_exactly_once() -> None:
    figures = run_soak("--seconds", "30", "--min-acked", "501")
    assert figures["acked"] > 500
    assert figures["received"] == figures["exported"] == figures["acked"]
    assert figures["lost"] == figures["received_twice"] == figures["unexpected"] == 0


@contextmanager
def small_disk(path: Path, size: str = "3m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the test (needs root)."""
    path.mkdir()
    try:
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
        subprocess.run(command, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"mounting a small tmpfs is not permitted here ({exc}): the disk-full test needs it")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill_up(path: Path) -> None:
    """Write ``path`` until the disk has no room left."""
    with path.open("wb") as file:
        try:
            while True:
                file.write(b"\0" * 65536)
                file.flush()
        except OSError:
            pass
        with contextlib.suppress(OSError):
            file.close()


def test_a_full_disk_answers_503_says_why_and_recovers_without_a_restart(
    generator_dir: Path, tmp_path: Path
) -> None:
    acked: set[str] = set()
    delivered: list[str] = []

    def write(client: TestClient, name: str) -> int:
        items = group(name, [0, 1, 0, 1])
        status = client.post("/buffer/write_batch", json=items).status_code
        if status == 200:
            acked.update(item["uid"] for item in items)
        return status

    def read(client: TestClient) -> int:
        answer = client.post("/get_rollout_data", json={})
        if answer.status_code == 200 and answer.json()["success"]:
            delivered.extend(uids(answer.json()))
        return answer.status_code

    with small_disk(tmp_path / "disk") as disk, service(generator_dir, disk / "data") as client:
        for i in range(5):
            assert write(client, f"q{i}") == 200
        fill_up(disk / "filler")
        assert read(client) in (200, 503)  # its export may still fit in the WAL, or not
        refused = [status for status in (write(client, f"full{i}") for i in range(400)) if status != 200]
        assert refused
        assert set(refused) == {503}
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "storage_failed"
        assert "No space left on device" in health.json()["reason"]
        before = len(delivered)
        assert read(client) == 503
        assert len(delivered) == before  # nothing handed out, nothing marked delivered
        (disk / "filler").unlink()  # space freed: no restart
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the service did not recover"
            time.sleep(0.05)
        assert write(client, "after") == 200
        assert read(client) == 200
        assert client.post("/get_rollout_data", json={}).json()["success"] is False  # all read
    assert acked <= set(delivered)  # nothing acknowledged lost
    assert len(delivered) == len(set(delivered))  # nothing twice


def test_a_full_disk_loses_nothing_across_a_restart(generator_dir: Path, tmp_path: Path) -> None:
    acked: set[str] = set()
    with small_disk(tmp_path / "disk") as disk:
        with service(generator_dir, disk / "data") as client:
            for i in range(5):
                items = group(f"q{i}", [0, 1, 0, 1])
                assert client.post("/buffer/write_batch", json=items).status_code == 200
                acked.update(item["uid"] for item in items)
            fill_up(disk / "filler")
            for i in range(400):
                items = group(f"full{i}", [0, 1, 0, 1])
                if client.post("/buffer/write_batch", json=items).status_code != 200:
                    break
                acked.update(item["uid"] for item in items)
            assert client.post("/get_rollout_data", json={}).status_code == 503
        (disk / "filler").unlink()
        with service(generator_dir, disk / "data") as client:
            answer = client.post("/get_rollout_data", json={}).json()
            assert acked <= set(uids(answer))


# Writes one trajectory of a new group every 20 ms until cancelled.
STEADY = """
import asyncio
from buffer.toolkit import open_sink

TASK_TYPE = "steady"
START_ROLLOUT_FIELDS = ('tag',)

async def run_rollout(data):
    sink = await open_sink(None)
    number = 0
    while True:
        number += 1
        await sink.write({
            "instance_id": f"{data['tag']}-{number}", "reward": 1.0,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        })
        await asyncio.sleep(0.02)
"""


def running_jobs(client: TestClient) -> list[dict[str, Any]]:
    return [job for job in client.get("/jobs").json()["data"]["jobs"] if job["status"] == "running"]


def test_a_job_running_when_the_service_stopped_runs_again_after_a_restart(
    generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "steady_generator.py").write_text(STEADY)
    data_dir = tmp_path / "data"
    with service(generator_dir, data_dir) as client:
        start = {"task_type": "steady", "rollout_name": "train", "num_repeat_per_sample": 2, "tag": "t"}
        assert client.post("/start_rollout", json=start).status_code == 200
    with service(generator_dir, data_dir) as client:
        (job,) = running_jobs(client)
        assert job["task_type"] == "train"
        assert job["generator_file"].endswith("steady_generator.py")
        client.post(f"/jobs/{job['id']}/cancel")  # ended by the user: not resumed again
    with service(generator_dir, data_dir) as client:
        assert running_jobs(client) == []
    with service(generator_dir, data_dir, resume_jobs=False) as client:
        assert client.post("/start_rollout", json=start).status_code == 200
    with service(generator_dir, data_dir, resume_jobs=False) as client:
        assert running_jobs(client) == []


def test_an_infinite_float_never_reaches_the_data_folder(generator_dir: Path, tmp_path: Path) -> None:
    (generator_dir / "math_generator.py").write_text('TASK_TYPE = "math"\ndef run_rollout(data):\n    pass\n')
    body = json.dumps({"task_type": "math", "group_timeout_seconds": float("inf")})  # "Infinity"
    with service(generator_dir, tmp_path / "data") as client:
        refused = client.post("/start_rollout", content=body, headers={"content-type": "application/json"})
        assert 400 <= refused.status_code < 500
        assert "group_timeout" in refused.text
        assert client.post("/buffer/write_batch", json=group("q1", [0, 1, 0, 1])).status_code == 200
    with service(generator_dir, tmp_path / "data") as client:  # and the folder still starts
        assert uids(client.post("/get_rollout_data", json={}).json())


def test_an_infinite_export_retention_stops_the_start_up(generator_dir: Path, tmp_path: Path) -> None:
    with (
        pytest.raises(ValueError, match="finite"),  # by the settings, or else by the journal
        service(generator_dir, tmp_path / "data", export_retention_hours=float("inf")),
    ):
        pass
