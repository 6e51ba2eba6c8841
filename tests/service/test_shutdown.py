"""SIGTERM stops the service well within ``docker stop``'s 10 s, and loses nothing: the jobs'
workers stop first, while the port is open, so their last writes land; then the long polls
answer at once and the port closes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.processes import free_port, wait_ready
from buffer.service.app import create_app
from buffer.service.gateway.service import GatewayConfig
from buffer.service.settings import Settings
from tests.support.calls import wait_for
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e

#: A generator that writes steadily through the toolkit's sink, and once cancelled sends what
#: it has queued and one last trajectory, then says how many the buffer acknowledged (the
#: first ``written`` uids: the sink sends its batches one at a time, in order).
STEADY = """
import asyncio, json, pathlib
from buffer.current import current_job
from buffer.toolkit.sink import HttpSink

TASK_TYPE = "steady"
START_ROLLOUT_FIELDS = ("record_to",)

def is_valid_group(group, min_valid_group_size, task_type):
    return True, len(group[1]) >= min_valid_group_size  # every trajectory a group to read

def trajectory(n):
    return {
        "instance_id": f"q{n}",
        "uid": f"t-{n}",
        "messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}],
        "reward": 1.0,
    }

async def run_rollout(data):
    sink = HttpSink(current_job().buffer_url)
    n = 0
    try:
        while True:
            await sink.write(trajectory(n))
            n += 1
            await asyncio.sleep(0.002)
    finally:
        await sink.write(trajectory(n))  # the last write, made as the job is stopped
        await sink.aclose()
        pathlib.Path(data["record_to"]).write_text(json.dumps({"written": sink.written}))
"""


@contextmanager
def service(generator_dir: Path, data_dir: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generator_dir), "--data-dir", str(data_dir), "--group-size", "1"]
    command += ["--input-roots", str(generator_dir), "--no-resume-jobs", "--durability", "flush"]
    with log.open("ab") as output:
        process = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", process, 60, "the buffer")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_stops_workers_then_long_polls_within_10_s_losing_nothing(tmp_path: Path) -> None:
    generators = tmp_path / "generators"
    generators.mkdir()
    (generators / "steady_generator.py").write_text(STEADY)
    record = generators / "written.json"
    log = tmp_path / "buffer.log"
    with (
        service(generators, tmp_path / "data", log) as (process, url),
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        started = client.post("/start_rollout", json={"task_type": "steady", "record_to": str(record)})
        assert started.status_code == 200, started.text
        wait_for(
            lambda: client.get("/buffer/stats").json()["data"]["data"][0]["total_written"] >= 50,
            60,
            "the worker writing",
        )
        state = client.get("/policy").json()["data"]
        watch: dict[str, Any] = {}

        def long_poll() -> None:  # a worker elsewhere, mirroring the policy: unchanged, so it waits
            params = {"paused": str(state["paused"]).lower(), "wait_s": 60, "worker": "elsewhere"}
            watch["answer"] = httpx.get(f"{url}/policy/watch", params=params, timeout=90)

        poller = threading.Thread(target=long_poll)
        poller.start()
        wait_for(lambda: "elsewhere" in client.get("/policy").json()["data"]["workers"], 30, "the watch")

        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
        stopped_s = time.monotonic() - sent
        poller.join(timeout=60)

    assert code == 0
    assert stopped_s < 10, f"the stop took {stopped_s:.1f} s"
    assert watch["answer"].status_code == 200
    text = log.read_text()
    assert "writing to the buffer failed" not in text, text
    written = json.loads(record.read_text())["written"]
    assert written > 50

    with (
        service(generators, tmp_path / "data", log) as (_, url),
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        answer = client.post("/get_rollout_data", json={"task_type": "steady"}).json()
    stored = {item["uid"] for item in answer["data"]["data"]}
    missing = {f"t-{n}" for n in range(written)} - stored
    assert not missing, f"{len(missing)} acknowledged trajectories lost, e.g. {sorted(missing)[:5]}"


@pytest.mark.anyio
async def test_every_long_poll_answers_at_once_when_the_service_stops(generator_dir: Path) -> None:
    """A trainer's read, a worker's watch and an agent's call held by a pause: each would wait a
    minute; the stop (``Services.begin_shutdown``) answers them at once."""
    app = create_app(Settings(generator_dir=generator_dir, host="127.0.0.1"))
    async with app.router.lifespan_context(app):
        app.state.gateway.config = GatewayConfig(pause_wait_s=60)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=90) as client:
            opened = await client.post(
                "/sessions",
                json={"task_type": "agent", "instance_id": "q1", "remote_engine_url": "http://127.0.0.1:9"},
            )
            assert opened.status_code == 200, opened.text
            session = opened.json()["data"]["session_id"]
            assert (await client.post("/policy/pause", json={"mode": "drain"})).status_code == 200
            polls = [
                client.post("/get_rollout_data", json={"wait_s": 60}),
                client.get("/policy/watch", params={"paused": "true", "pause": 1, "wait_s": 60}),
                client.post(
                    f"/sessions/{session}/v1/chat/completions",
                    json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
                ),
            ]
            waiting = [asyncio.ensure_future(poll) for poll in polls]
            done, _ = await asyncio.wait(waiting, timeout=0.5)
            assert not done  # each waits for what it asked
            app.state.services.begin_shutdown()
            read, watch, call = await asyncio.wait_for(asyncio.gather(*waiting), 30)
    assert read.status_code == 200
    assert read.json()["success"] is False  # nothing was ready
    assert watch.status_code == 200
    assert call.status_code == 503  # held by the pause: retry (elsewhere, or after the restart)
