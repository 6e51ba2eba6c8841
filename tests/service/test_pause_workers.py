"""The trainer's pause waits for generators out of the service's process (issue 21, item 3).

A job's generator runs in worker processes by default: they mirror the gate through
``GET /policy/watch`` and say there what they still have in flight, so ``POST /policy/pause``
answers ``drained: true`` only once the engines have nothing left of theirs. Before, it looked
at the service's own gate only and answered at once while the workers' requests ran on (slime's
weight update then aborted them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from buffer.policy import Policy
from buffer.policy.state import WORKER_GRACE_S
from buffer.toolkit.remote_policy import RemotePolicy
from tests.support.calls import wait_for


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_drain_pause_waits_for_the_requests_of_worker_processes(
    process: Callable[..., str], tmp_path: Path
) -> None:
    engine = process(
        "-m", "buffer.simulator", "--latency-mean-s", "1.5", "--seed", "5", "--log-level", "warning",
        name="simulator",
    )  # fmt: skip
    url = process("buffer.py", "--log-level", "warning", "--input-roots", str(tmp_path), name="buffer")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"instance_id": f"q{i}", "prompt": f"{i} + 1?"}) + "\n" for i in range(32))
    )  # 8 waves of 8 requests: some are left to run after the resume, however slow the machine
    start = {
        "task_type": "math",
        "input_file": str(rows),
        "remote_engine_url": engine,
        "num_repeat_per_sample": 2,
        "num_process": 8,
        "max_tokens": 16,
    }
    with (
        httpx.Client(base_url=url, timeout=120, trust_env=False) as buffer,
        httpx.Client(base_url=engine, timeout=30, trust_env=False) as sim,
    ):
        assert buffer.post("/start_rollout", json=start).status_code == 200
        wait_for(lambda: sim.get("/stats").json()["in_flight"] > 0, 60, "requests at the engine")
        (job,) = buffer.get("/jobs").json()["data"]["jobs"]
        assert [worker["pid"] for worker in job["workers"]] != []  # in a worker process, the default

        at_once = buffer.post("/policy/pause", json={"mode": "drain", "timeout_s": 0}).json()["data"]
        assert at_once["drained"] is False  # the worker's requests are still at the engine
        assert at_once["in_flight"] > 0 or at_once["unpaused_workers"] > 0

        drained = buffer.post("/policy/pause", json={"mode": "drain", "timeout_s": 60}).json()["data"]
        engine_stats = sim.get("/stats").json()
        assert drained["drained"] is True, drained
        assert engine_stats["in_flight"] == 0  # drained means the engine has nothing of ours
        assert drained["in_flight"] == 0
        assert drained["unpaused_workers"] == 0
        requests = engine_stats["requests"]
        time.sleep(0.5)
        assert sim.get("/stats").json()["requests"] == requests  # nothing starts while paused
        assert buffer.post("/policy/resume", json={}).status_code == 200
        wait_for(lambda: sim.get("/stats").json()["requests"] > requests, 60, "requests after the resume")


@pytest.mark.anyio
async def test_a_mirror_reports_its_requests_in_flight_and_when_they_are_done(
    process: Callable[..., str],
) -> None:
    url = process("buffer.py", "--log-level", "warning", name="buffer")
    remote = await RemotePolicy.connect(url, "math")
    assert remote is not None
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as buffer:

            async def known() -> bool:
                return remote.name in (await buffer.get("/policy")).json()["data"]["workers"]

            deadline = time.monotonic() + 60
            while not await known():  # its first watch: from then on the service waits for it
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await remote.gate.enter()  # a request at the engine when the pause comes
            await remote.gate.enter()
            held = (await buffer.post("/policy/pause", json={"mode": "drain", "timeout_s": 5})).json()["data"]
            assert held["drained"] is False
            assert held["in_flight"] == 2
            assert held["unpaused_workers"] == 0
            workers = (await buffer.get("/policy")).json()["data"]["workers"]
            assert workers == {remote.name: {"paused": True, "in_flight": 2}}
            remote.gate.leave()
            remote.gate.leave()  # done: the mirror says so without waiting for its watch to end
            pause = buffer.post("/policy/pause", json={"mode": "drain", "timeout_s": 30})
            drained = (await asyncio.wait_for(pause, 20)).json()["data"]
            assert drained["drained"] is True
            assert drained["in_flight"] == 0
    finally:
        await remote.aclose()


@pytest.mark.anyio
async def test_a_worker_holds_the_drain_until_it_reports_and_a_gone_one_only_for_its_grace() -> None:
    now = [100.0]
    policy = Policy(clock=lambda: now[0])
    policy.watch_begins("w1", 1, None, 0)  # watching, its gate open
    policy.pause("drain")
    assert not await policy.drained(0)  # it has not said it saw the pause
    assert policy.unpaused_workers() == 1
    policy.watch_begins("w1", 3, policy.pauses, 2)
    assert not await policy.drained(0)
    assert policy.in_flight() == 2
    policy.watch_begins("w1", 2, policy.pauses, 0)  # an older report, overtaken: ignored
    assert policy.in_flight() == 2
    policy.watch_begins("w1", 4, policy.pauses, 0)
    assert await policy.drained(0)
    policy.watch_ends("w1")
    policy.watch_ends("w1")
    policy.watch_ends("w1")
    policy.watch_ends("w1")

    policy.resume(None)
    policy.watch_begins("w2", 1, None, 5)
    policy.pause("abort")
    policy.watch_ends("w2")  # died with requests out: no more watches
    assert not await policy.drained(0)
    assert policy.in_flight() == 5
    now[0] += WORKER_GRACE_S + 1
    assert await policy.drained(0)  # its count went with it
    assert policy.in_flight() == 0
    assert policy.snapshot()["workers"] == {}


@pytest.mark.anyio
async def test_an_abort_waits_for_every_workers_gate_to_close_before_the_engines_abort() -> None:
    """A request an engine aborts before its worker's gate is closed is continued at once, into
    the paused engine, where it stays until the resume: the pause would never drain (it waited
    its whole timeout in bench/async_rl.py). ``closed`` is what the abort waits for first."""
    policy = Policy()
    policy.watch_begins("w1", 1, None, 3)  # watching, its gate open, 3 requests out
    policy.pause("abort")
    assert not await policy.closed(0)
    policy.watch_begins("w1", 2, policy.pauses, 3)  # closed now, whatever is still out
    assert await policy.closed(0)
    assert not await policy.drained(0)
