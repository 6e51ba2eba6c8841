"""buffer.policy: versions, pause/resume, the staleness bound, admission, mixed reads."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import respx
from fastapi.testclient import TestClient

from buffer.core.hooks import Hooks
from buffer.core.mixing import allocate
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.policy import Admission, Gate, Policy, PolicyError
from buffer.policy.gate import recording
from buffer.processes import free_port
from buffer.simulator.app import create_sim_app
from buffer.simulator.config import SimConfig
from buffer.toolkit.llm import ChatClient, RetryPolicy
from buffer.toolkit.remote_policy import RemotePolicy
from buffer.toolkit.retries import StopOpenTime
from buffer.toolkit.runner import run_rollouts
from tests.support.calls import until
from tests.support.factories import Collected, group, write_generator

pytestmark = pytest.mark.anyio


def versioned(instance_id: str, rewards: list[float], version: int | None) -> list[dict[str, Any]]:
    items = group(instance_id, rewards)
    if version is not None:
        for item in items:
            item["extra_info"] = {"policy_version_min": version, "policy_version_max": version}
    return items


def two_task_buffer(weights: dict[str, float | None], group_size: int = 2) -> RolloutBuffer:
    buffer = RolloutBuffer()
    for name, weight in weights.items():
        buffer.configure_task(name, TaskSettings(group_size=group_size, weight=weight), Hooks())
    return buffer


def fill(buffer: RolloutBuffer, task: str, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        buffer.write_many([{**item, "task_type": task} for item in versioned(f"{task}{i}", [0.0, 1.0], None)])


# -- mixing ------------------------------------------------------------------------------


def test_allocate_keeps_the_run_share_when_a_batch_does_not_divide() -> None:
    served: Counter[str] = Counter()
    for _ in range(100):
        served.update(allocate({"math": 3, "code": 1}, served, 5))
    assert served["math"] + served["code"] == 500
    assert abs(served["math"] / 500 - 0.75) <= 0.02


def test_mixed_reads_give_each_task_its_weight_and_never_a_group_twice() -> None:
    buffer = two_task_buffer({"math": 3, "code": 1})
    fill(buffer, "math", 400)
    fill(buffer, "code", 400)
    seen: set[str] = set()
    shares: Counter[str] = Counter()
    for _ in range(100):
        result = buffer.read(None, 4 * 2)  # no task named: the tasks' own weights
        assert len(result.groups) == 4
        for ready in result.groups:
            shares[ready.task_type] += 1
            assert (ready.task_type, ready.instance_id) not in seen
            seen.add((ready.task_type, ready.instance_id))
    assert abs(shares["math"] / 400 - 0.75) <= 0.02
    assert abs(shares["code"] / 400 - 0.25) <= 0.02


def test_a_starved_task_is_made_up_by_the_others_then_gets_its_share_back() -> None:
    buffer = two_task_buffer({"math": None, "code": None})
    fill(buffer, "math", 400)
    shares: Counter[str] = Counter()
    mix = {"math": 3.0, "code": 1.0}
    for read in range(100):
        if read == 20:
            fill(buffer, "code", 200)  # code was starved for 20 reads
        result = buffer.read(None, 4 * 2, mix=mix)
        assert len(result.groups) == 4  # full batches throughout
        if read < 20:
            mixed = result.meta_info["mix"]
            assert mixed["short"]["code"] == mixed["requested"]["code"] >= 1  # it asks for its arrears
            assert mixed["returned"] == {"math": 4, "code": 0}
            assert "code had 0 of" in mixed["message"]
        shares.update(ready.task_type for ready in result.groups)
    assert abs(shares["code"] / 400 - 0.25) <= 0.02  # made up after it came back


def test_without_weights_or_mix_a_read_stays_oldest_first() -> None:
    buffer = two_task_buffer({"math": None, "code": None})
    fill(buffer, "math", 3)
    fill(buffer, "code", 3)
    result = buffer.read(None, 4 * 2)
    assert [ready.task_type for ready in result.groups] == ["math", "math", "math", "code"]
    assert "mix" not in result.meta_info


# -- staleness at read time ------------------------------------------------------------------


def test_a_group_past_max_staleness_is_set_aside_and_counted_never_served() -> None:
    buffer = RolloutBuffer()
    buffer.configure_task("math", TaskSettings(group_size=2, max_staleness=1), Hooks())
    buffer.policy.set_version(0)
    buffer.write_many([{**item, "task_type": "math"} for item in versioned("old", [0.0, 1.0], 0)])
    buffer.write_many([{**item, "task_type": "math"} for item in versioned("new", [0.0, 1.0], 1)])
    buffer.policy.set_version(2)
    result = buffer.read("math", None)
    assert [ready.instance_id for ready in result.groups] == ["new"]
    assert result.meta_info["stale_groups"] == {"math": 1}
    assert result.meta_info["version_lag"] == {"min": 1, "max": 1}
    counters = buffer.stats()["tasks"]["math"]
    assert counters["discarded_groups"] == {"stale": 1}
    assert buffer.policy.stale["math"] == 1
    assert buffer.policy.lag == Counter({1: 1})
    assert buffer.consumed_groups("math") == 2


def test_turn_weight_versions_count_and_strings_are_read_as_numbers() -> None:
    buffer = RolloutBuffer()
    buffer.configure_task("math", TaskSettings(group_size=1, max_staleness=0), Hooks())
    item = versioned("q", [0.5], None)[0]
    item["turns"] = [{"prompt_ids": [1], "output_ids": [2], "message_index": 1, "weight_version": "3"}]
    buffer.write_many([{**item, "task_type": "math"}])
    buffer.policy.set_version(4)
    assert buffer.read("math", None).groups == []


def test_versions_only_go_up() -> None:
    policy = Policy()
    policy.set_version(3)
    policy.set_version(3)
    with pytest.raises(PolicyError):
        policy.set_version(2)
    assert policy.version == 3


# -- admission ------------------------------------------------------------------------------


async def test_admission_keeps_s_plus_one_batches_outstanding_and_filtered_groups_free_room() -> None:
    consumed = [0]
    admission = Admission(max_staleness=1, batch_groups=2, consumed=lambda: consumed[0])
    for _ in range(4):
        await asyncio.wait_for(admission.admit(), 30)
    blocked = asyncio.ensure_future(admission.admit())
    await asyncio.sleep(0.05)
    assert not blocked.done()
    consumed[0] += 1  # a group left the buffer: served, or dropped by the filter
    admission.notify()
    await asyncio.wait_for(blocked, 30)
    assert admission.admitted == 5
    admission.saw_read(3)  # the trainer reads bigger batches: more room
    assert admission.capacity == 6


async def test_without_a_bound_admission_never_waits() -> None:
    admission = Admission(max_staleness=None, batch_groups=1, consumed=lambda: 0)
    for _ in range(100):
        await asyncio.wait_for(admission.admit(), 30)


# -- the gate -----------------------------------------------------------------------------------


async def test_requests_wait_at_a_closed_gate_and_record_the_version_they_start_under() -> None:
    gate = Gate()
    gate.version = 4
    gate.pause()
    versions = recording()
    entered = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0.05)
    assert not entered.done()
    gate.resume(5)
    assert await asyncio.wait_for(entered, 30) == 5
    assert versions == [5]
    assert gate.in_flight == 1
    drained = asyncio.ensure_future(gate.drained(5))
    await asyncio.sleep(0.01)
    assert not drained.done()
    gate.leave()
    assert await asyncio.wait_for(drained, 30)


def test_paused_time_spends_no_retry_budget() -> None:
    now = [100.0]
    gate = Gate(clock=lambda: now[0])
    stop = StopOpenTime(RetryPolicy(max_retry_s=2.0), gate, clock=lambda: now[0])
    state: Any = SimpleNamespace(upcoming_sleep=0.0)
    now[0] += 1.0
    gate.pause()
    now[0] += 30.0
    gate.resume()
    assert not stop(state)  # 31 s passed, 30 of them paused
    now[0] += 0.9
    assert not stop(state)
    state.upcoming_sleep = 0.2
    assert stop(state)  # 1.9 s open and a 0.2 s wait: past the budget
    state.upcoming_sleep = 0.0
    now[0] += 0.2
    assert stop(state)


@respx.mock
async def test_the_chat_client_sends_nothing_while_paused() -> None:
    route = respx.post("http://engine.test/v1/chat/completions").mock(
        return_value=httpx.Response(
            200, json={"choices": [{"message": {"content": "4"}, "finish_reason": "stop"}], "usage": {}}
        )
    )
    async with ChatClient("http://engine.test", transport=httpx.AsyncHTTPTransport()) as client:
        client.gate = gate = Gate()
        gate.pause()
        answer = asyncio.ensure_future(client.complete([{"role": "user", "content": "2+2"}]))
        await asyncio.sleep(0.1)
        assert route.call_count == 0
        gate.resume(1)
        completion = await asyncio.wait_for(answer, 5)
    assert completion.text == "4"
    assert route.call_count == 1


# -- the HTTP API -------------------------------------------------------------------------------


def test_policy_routes(client: TestClient) -> None:
    assert client.get("/policy").json()["data"]["version"] is None
    assert client.post("/policy", json={"version": 2}).json()["data"]["version"] == 2
    refused = client.post("/policy", json={"version": 1})
    assert refused.status_code == 409
    assert "lower" in refused.json()["message"]
    paused = client.post("/policy/pause", json={"mode": "drain", "timeout_s": 30}).json()["data"]
    assert paused["paused"]
    assert paused["drained"]
    assert client.get("/policy").json()["data"]["paused"] is True
    assert client.post("/policy/resume", json={"version": 3}).json()["data"] == {
        "version": 3,
        "paused": False,
    }
    assert client.post("/policy", json={"version": 3, "weights": 1}).status_code == 422


def test_unknown_read_fields_are_refused_naming_them(client: TestClient) -> None:
    refused = client.post("/get_rollout_data", json={"batch_size": 4, "weights": {"math": 3}})
    assert refused.status_code == 422
    assert "weights" in refused.text
    assert client.post("/buffer/read", json={"batch_size": 4, "timeout": 0, "wait": False}).status_code == 200


def test_start_rollout_refuses_fields_a_generator_does_not_read(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    client = make_client(group_size=4, check_engines=False)  # no engine at 127.0.0.1:1
    body = "async def run_rollout(data):\n    return None\n"
    strict = "TASK_TYPE = 'strict'\nSTART_ROLLOUT_FIELDS = ('difficulty',)\n" + body
    write_generator(generator_dir, "strict_generator.py", strict)
    write_generator(generator_dir, "legacy_generator.py", "TASK_TYPE = 'legacy'\n" + body)
    (generator_dir / "data").mkdir()
    rows = generator_dir / "data" / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1?"}\n')
    slime = {
        "num_process": "100",
        "num_epoch": "3",
        "remote_engine_url": "http://127.0.0.1:1",
        "remote_buffer_url": "http://127.0.0.1:8889",
        "input_file": str(rows),
        "num_repeat_per_sample": "4",
        "max_tokens": "16",
        "sampling_params": {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0},
        "tokenizer_path": "/models/x",
        "skip_instance_ids": [],
    }
    accepted = client.post(
        "/start_rollout",
        json={"task_type": "strict", **slime, "difficulty": 2, "max_staleness": 1, "weight": 3},
    )
    assert accepted.status_code == 200, accepted.text
    refused = client.post("/start_rollout", json={"task_type": "strict", "restart": True, "weigths": 3})
    assert refused.status_code == 422
    assert "weigths" in refused.text
    # A generator that declares nothing reads no field of its own; "*" says it reads any.
    assert client.post("/start_rollout", json={"task_type": "legacy", "anything": 1}).status_code == 422
    write_generator(
        generator_dir, "open_generator.py", "TASK_TYPE = 'open'\nSTART_ROLLOUT_FIELDS = '*'\n" + body
    )
    assert client.post("/start_rollout", json={"task_type": "open", "anything": 1}).status_code == 200
    # The service's own job fields are fields of /start_rollout for every generator.
    workers = client.post(
        "/start_rollout",
        json={"task_type": "strict", "restart": True, "num_workers": 1, "lease_ttl_s": 10},
    )
    assert workers.status_code == 200, workers.text


# -- the simulator's controls ----------------------------------------------------------------------


async def test_the_simulator_aborts_in_flight_requests_on_pause_and_holds_new_ones() -> None:
    app = create_sim_app(SimConfig(latency_mean_s=2.0, seed=0))
    transport = httpx.ASGITransport(app=app)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
    stats = app.state.simulator.stats
    async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=30) as sim:
        in_flight = asyncio.ensure_future(sim.post("/v1/chat/completions", json=body))
        await until(lambda: stats.in_flight == 1, what="the request sleeping through its latency")
        assert (await sim.post("/pause_generation", json={"mode": "abort"})).json()["success"]
        aborted = (await asyncio.wait_for(in_flight, 30)).json()
        assert aborted["choices"][0]["finish_reason"] == "abort"
        held = asyncio.ensure_future(sim.post("/v1/chat/completions", json=body))
        await until(lambda: stats.in_flight == 1, what="the request held at the pause")
        await asyncio.sleep(0.1)
        assert not held.done()
        update = await sim.post("/update_weights_from_disk", json={"model_path": "/m", "weight_version": "7"})
        assert update.json()["success"]
        await sim.post("/continue_generation")
        app.state.simulator.config.latency_mean_s = 0.0
        answer = (await asyncio.wait_for(held, 30)).json()
    assert answer["metadata"]["weight_version"] == "7"
    assert app.state.simulator.control.snapshot()["aborted"] == 1


async def test_a_simulated_vllm_pauses_as_vllm_does_and_serves_no_sglang_route() -> None:
    app = create_sim_app(SimConfig(engine="vllm", dev_mode=True, latency_mean_s=2.0, seed=0))
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
    stats = app.state.simulator.stats
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=30) as sim:
        assert (await sim.post("/pause_generation", json={"mode": "abort"})).status_code == 404
        in_flight = asyncio.ensure_future(sim.post("/v1/chat/completions", json=body))
        await until(lambda: stats.in_flight == 1, what="the request sleeping through its latency")
        assert (await sim.post("/pause", params={"mode": "abort"})).json() == {"status": "paused"}
        aborted = (await asyncio.wait_for(in_flight, 30)).json()
        assert aborted["choices"][0]["finish_reason"] == "abort"
        assert (await sim.get("/is_paused")).json() == {"is_paused": True}
        held = asyncio.ensure_future(sim.post("/v1/chat/completions", json=body))
        await until(lambda: stats.in_flight == 1, what="the request held at the pause")
        await asyncio.sleep(0.1)
        assert not held.done()
        assert (await sim.post("/resume")).json() == {"status": "resumed"}
        app.state.simulator.config.latency_mean_s = 0.0
        assert (await asyncio.wait_for(held, 30)).json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("config", "missing"),
    [
        (SimConfig(engine="vllm"), ["/pause", "/resume", "/is_paused", "/pause_generation"]),  # no dev mode
        (SimConfig(engine="sglang", dev_mode=True), ["/pause", "/resume", "/is_paused"]),
    ],
)
async def test_each_simulated_engine_answers_404_for_pause_routes_it_does_not_serve(
    config: SimConfig, missing: list[str]
) -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_sim_app(config)), base_url="http://sim"
    ) as sim:
        for path in missing:
            answer = await (sim.get(path) if path == "/is_paused" else sim.post(path))
            assert answer.status_code == 404, path


def test_a_pause_reaches_a_vllm_engine_and_its_resume_too(client: TestClient, process: Any) -> None:
    engine = process("-m", "buffer.simulator", "--engine", "vllm", "--dev-mode", name="vllm")
    paused = client.post("/policy/pause", json={"mode": "abort", "engine_urls": [engine], "timeout_s": 30})
    assert paused.status_code == 200, paused.text
    assert paused.json()["data"]["drained"] is True
    assert paused.json()["data"]["engines"] == {engine: "vllm paused"}
    assert httpx.get(f"{engine}/is_paused", trust_env=False, timeout=30).json() == {"is_paused": True}
    assert client.get("/policy").json()["data"]["engine_kinds"] == {engine: "vllm"}
    assert client.post("/policy/resume").status_code == 200
    assert httpx.get(f"{engine}/is_paused", trust_env=False, timeout=30).json() == {"is_paused": False}


def test_a_pause_no_engine_takes_is_an_error_naming_each_engine(client: TestClient, process: Any) -> None:
    engine = process("-m", "buffer.simulator", "--engine", "vllm", name="vllm")  # without dev mode
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    refused = client.post("/policy/pause", json={"mode": "abort", "engine_urls": [engine], "timeout_s": 5})
    assert refused.status_code == 409
    answer = refused.json()
    assert answer["success"] is False
    assert answer["data"]["drained"] is False
    assert engine in answer["message"]
    assert "VLLM_SERVER_DEV_MODE=1" in answer["message"]
    assert client.get("/policy").json()["data"]["paused"] is True  # the gate holds until the resume
    declared = client.post(
        "/policy/pause", json={"mode": "abort", "engine_urls": [engine], "engine": "sglang", "timeout_s": 5}
    )
    assert declared.status_code == 409
    assert "sglang /pause_generation (HTTP 404)" in declared.json()["message"]
    unreachable = client.post("/policy/pause", json={"mode": "abort", "engine_urls": [gone], "timeout_s": 5})
    assert unreachable.status_code == 409
    assert f"{gone}: not reached" in unreachable.json()["message"]
    resumed = client.post("/policy/resume")
    assert resumed.status_code == 409  # the engine it could not reach is not said to go on either
    assert f"{gone}: not reached" in resumed.json()["message"]
    assert client.get("/policy").json()["data"]["paused"] is False


def test_metrics_and_dashboard_show_lag_stale_shares_and_pauses(client: TestClient) -> None:
    client.post("/start_rollout", json={"task_type": "nothing"})  # an unknown generator: no job
    buffer = client.app.state.services.buffer  # type: ignore[attr-defined]
    buffer.configure_task("math", TaskSettings(group_size=2, max_staleness=0), Hooks())
    buffer.policy.set_version(1)
    buffer.write_many([{**item, "task_type": "math"} for item in versioned("a", [0.0, 1.0], 1)])
    buffer.write_many([{**item, "task_type": "math"} for item in versioned("b", [0.0, 1.0], 0)])
    client.post("/policy/pause", json={"mode": "drain"})
    client.post("/policy/resume")
    assert client.post("/get_rollout_data", json={"task_type": "math"}).json()["success"]
    text = client.get("/metrics").text
    assert 'rollout_buffer_served_version_lag_bucket{le="0"} 1.0' in text
    assert 'rollout_buffer_groups_stale_total{task="math"} 1.0' in text
    assert 'rollout_buffer_task_share{task="math"} 1.0' in text
    assert "rollout_buffer_policy_paused_seconds_total" in text
    assert "rollout_buffer_policy_pauses_total 1.0" in text
    policy = client.get("/dashboard/data").json()["policy"]
    assert policy["stale_groups"] == {"math": 1}


def test_a_stale_group_stays_set_aside_after_a_restart(make_client: Any, tmp_path: Path) -> None:
    def writes(client: TestClient, instance_id: str, version: int) -> None:
        for item in versioned(instance_id, [0.0, 1.0], version):
            assert client.post("/buffer/write", json={**item, "task_type": "math"}).status_code == 200

    first = make_client(data_dir=tmp_path / "data", group_size=2)
    buffer = first.app.state.services.buffer
    buffer.configure_task("math", TaskSettings(group_size=2, max_staleness=0), Hooks())
    writes(first, "old", 0)
    writes(first, "new", 1)
    first.post("/policy", json={"version": 1})
    served = first.post("/get_rollout_data", json={"task_type": "math"}).json()["data"]
    assert {item["instance_id"] for item in served["data"]} == {"new"}
    assert served["meta_info"]["stale_groups"] == {"math": 1}
    writes(first, "later", 1)
    first.__exit__(None, None, None)

    second = make_client(data_dir=tmp_path / "data", group_size=2)
    served = second.post("/get_rollout_data", json={"task_type": "math"}).json()["data"]
    assert {item["instance_id"] for item in served["data"]} == {"later"}
    assert second.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]["math"]["discarded_groups"] == {
        "stale": 1
    }


def test_admission_over_http_waits_for_room(client: TestClient) -> None:
    consumed = [0]
    policy = client.app.state.services.buffer.policy  # type: ignore[attr-defined]
    policy.start_admission("math", 0, 1, lambda: consumed[0])
    assert client.post("/policy/admit", json={"task_type": "math", "wait_s": 0}).json()["data"] == {
        "admitted": True,
        "bounded": True,
        "groups": 1,
        "waited_s": 0.0,
        "policy": {"version": None, "paused": False, "pause": 0},  # to mirror before the group starts
    }
    refused = client.post("/policy/admit", json={"task_type": "math", "wait_s": 0.1}).json()["data"]
    assert refused["admitted"] is False
    consumed[0] += 1
    assert client.post("/policy/admit", json={"task_type": "math", "wait_s": 30}).json()["data"]["admitted"]
    free = client.post("/policy/admit", json={"task_type": "other", "wait_s": 0}).json()["data"]
    assert free == {"admitted": True, "bounded": False, "groups": 1}


async def test_a_generator_in_another_process_mirrors_the_pause_and_the_version(process: Any) -> None:
    url = process("buffer.py", "--log-level", "warning", name="buffer")
    remote = await RemotePolicy.connect(url, "math")
    assert remote is not None
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as buffer:
            await buffer.post("/policy", json={"version": 2})
            await buffer.post("/policy/pause", json={"mode": "drain"})
            await until(lambda: remote.gate.paused, what="the pause mirrored")
            assert remote.gate.version == 2
            entered = asyncio.ensure_future(remote.gate.enter())
            await asyncio.sleep(0.1)
            assert not entered.done()  # no engine request while the trainer holds the engines
            await buffer.post("/policy/resume", json={"version": 3})
            assert await asyncio.wait_for(entered, 30) == 3
        await remote.admission.admit()  # no bound on the task: asks once, then never again
        assert remote.admission.bounded is False
    finally:
        await remote.aclose()
    assert await RemotePolicy.connect("http://127.0.0.1:9", "math") is None


async def test_a_generator_writing_to_a_buffer_elsewhere_holds_its_requests_while_paused(
    process: Any, tmp_path: Path
) -> None:
    engine = process("-m", "buffer.simulator", "--latency-mean-s", "0.01", "--seed", "4", name="simulator")
    url = process("buffer.py", "--log-level", "warning", name="buffer")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"instance_id": "q{i}", "prompt": "What is {i} + 1?"}}\n' for i in range(2)))
    data = {
        "task_type": "elsewhere",
        "input_file": str(rows),
        "remote_engine_url": engine,
        "remote_buffer_url": url,
        "num_repeat_per_sample": 2,
    }
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as buffer:
        await buffer.post("/policy", json={"version": 1})
        await buffer.post("/policy/pause", json={"mode": "drain"})
        written = Collected()
        run = asyncio.ensure_future(run_rollouts(data, reward=lambda sample, episode: 1.0, sink=written))
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(trust_env=False, timeout=30) as sim:
            stats = (await sim.get(f"{engine}/stats")).json()
        assert stats["requests"] == 0  # nothing reached the engine while paused
        assert not run.done()
        await buffer.post("/policy/resume", json={"version": 2})
        progress = await asyncio.wait_for(run, 30)
        assert progress.completed == 4
    versions = {item["extra_info"]["policy_version_min"] for item in written.trajectories}
    assert versions == {2}
