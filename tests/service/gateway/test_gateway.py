"""The recording gateway: an unmodified OpenAI-SDK agent, run through a session against a
stand-in engine that returns token ids in vLLM's shape (``tests.support.loopback_engine``), trained on
exactly what the engine received and sampled."""

from __future__ import annotations

import base64
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from buffer.processes import free_port, started, wait_ready
from buffer.service.app import create_app
from buffer.service.gateway.service import GatewayConfig
from buffer.service.settings import Settings
from buffer.trainer.samples.turns import samples_from_turns
from tests.support.gateway import (
    TOOLS,
    assert_token_faithful,
    calculator_agent,
    engine_log,
    open_session,
    sdk,
    session_trajectories,
    turns_as_calls,
)

pytestmark = pytest.mark.timeout(60)

IMAGE_TOKEN = 300


@pytest.mark.parametrize("stream", [False, True])
def test_an_unmodified_sdk_agent_is_trained_on_exactly_what_the_engine_saw(
    make_client: Any, loopback: str, stream: bool
) -> None:
    client = make_client(group_size=2)
    before = len(engine_log(loopback))
    session = open_session(client, loopback)
    assert session["base_url"].endswith(f"/sessions/{session['session_id']}/v1")
    answer = calculator_agent(sdk(client, session), "Compute 3 * (4 + 5).", stream=stream)
    assert answer == "The answer is 27."
    ended = client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    assert ended.json()["data"]["written"] is True

    (trajectory,) = session_trajectories(client)
    calls = engine_log(loopback)[before:]
    assert len(calls) == 2
    assert len(trajectory["turns"]) == 2
    assert trajectory["tools"] == TOOLS
    assert [m["role"] for m in trajectory["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert [m.get("generated", False) for m in trajectory["messages"]] == [False, False, True, False, True]
    assert trajectory["turns"][0]["finish_reason"] == "tool_calls"
    assert trajectory["turns"][0]["sampling"]["temperature"] == 0.7
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_token_faithful(trajectory, calls)
    assert client.get(f"/sessions/{session['session_id']}").status_code == 404  # ended


def test_a_restart_mid_session_loses_no_acknowledged_call(
    tmp_path: Path, generator_dir: Path, loopback: str
) -> None:
    settings = Settings(generator_dir=generator_dir, port=8889, group_size=2, data_dir=tmp_path / "data")
    before = len(engine_log(loopback))
    with TestClient(create_app(settings)) as client:
        session = open_session(client, loopback)
        first = sdk(client, session).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Compute 2 + 3."}], tools=TOOLS
        )
        client.post(f"/sessions/{session['session_id']}/reward", json={"reward": 0.25})
        client.app.state.services.buffer.journal.compact()  # the session lives through a snapshot too
    with TestClient(create_app(settings)) as client:
        assert client.get(f"/sessions/{session['session_id']}").json()["data"]["calls"] == 1
        call = first.choices[0].message.tool_calls[0]
        history = [
            {"role": "user", "content": "Compute 2 + 3."},
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        sdk(client, session).chat.completions.create(model="policy", messages=history, tools=TOOLS)
        assert client.post(f"/sessions/{session['session_id']}/end").json()["data"]["written"]
        (trajectory,) = session_trajectories(client)
    assert trajectory["raw_reward"] == 0.25
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_token_faithful(trajectory, engine_log(loopback)[before:])


def test_a_retried_call_makes_a_tree_and_the_path_that_ended_is_trained(
    make_client: Any, loopback: str
) -> None:
    client = make_client(group_size=2)
    session = open_session(client, loopback)
    agent = sdk(client, session)
    question = [{"role": "user", "content": "Compute 6 * 7."}]
    agent.chat.completions.create(model="policy", messages=question, tools=TOOLS)  # abandoned
    retried = agent.chat.completions.create(model="policy", messages=question, tools=TOOLS)
    before = len(engine_log(loopback)) - 1
    call = retried.choices[0].message.tool_calls[0]
    history = [
        *question,
        retried.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    agent.chat.completions.create(model="policy", messages=history, tools=TOOLS)
    recorded = client.app.state.gateway.store.sessions[session["session_id"]].calls
    assert recorded[2].messages == history[2:]  # each message is kept once, not once per call
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    (trajectory,) = session_trajectories(client)
    gateway = trajectory["extra_info"]["gateway"]
    assert gateway["parents"] == [None, None, 1]
    assert gateway["path"] == [1, 2]
    assert_token_faithful(trajectory, engine_log(loopback)[before:])


def test_an_image_prompt_reaches_the_trainer_with_its_image(
    make_client: Any, tmp_path: Path, loopback: str
) -> None:
    client = make_client(group_size=2, data_dir=tmp_path / "data")
    small = "data:image/png;base64," + base64.b64encode(b"\x89PNG small").decode()
    large_bytes = b"\x89PNG" + bytes(range(256)) * 400  # past the inline limit: kept by reference
    large = "data:image/png;base64," + base64.b64encode(large_bytes).decode()
    session = open_session(client, loopback)
    content = [
        {"type": "text", "text": "What do you see?"},
        {"type": "image_url", "image_url": {"url": small}},
        {"type": "image_url", "image_url": {"url": large}},
    ]
    before = len(engine_log(loopback))
    answer = sdk(client, session).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": content}]
    )
    assert answer.choices[0].message.content == "I see 2 image(s)."
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    (trajectory,) = session_trajectories(client)
    (sample,) = samples_from_turns(trajectory, 1.0, 1.0)
    assert sample.multimodal_inputs is not None
    inline, reference = sample.multimodal_inputs["images"]
    assert inline == small
    assert reference.startswith("http://127.0.0.1:8889/images/")
    served = client.get("/images/" + reference.rsplit("/", 1)[1])
    assert served.content == large_bytes
    assert served.headers["content-type"] == "image/png"
    (call,) = engine_log(loopback)[before:]
    assert sample.tokens[: len(call["prompt_ids"])] == call["prompt_ids"]
    image_positions = [i for i, token in enumerate(sample.tokens) if token == IMAGE_TOKEN]
    assert len(image_positions) == 8  # both images reached the engine
    response_start = len(sample.tokens) - sample.response_length
    assert all(p < response_start or sample.loss_mask[p - response_start] == 0 for p in image_positions)


def test_a_paused_generation_answers_503_with_retry_after(make_client: Any, loopback: str) -> None:
    class Paused:
        def is_paused(self) -> bool:
            return True

        async def wait_resumed(self, timeout_s: float) -> bool:
            return False

    client = make_client(group_size=2)
    gateway = client.app.state.gateway
    gateway.pause_gate = Paused()
    gateway.config = GatewayConfig(pause_wait_s=0.0, retry_after_s=7)
    session = open_session(client, loopback)
    response = client.post(
        f"/sessions/{session['session_id']}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 503
    assert response.headers["retry-after"] == "7"
    assert client.get(f"/sessions/{session['session_id']}").json()["data"]["calls"] == 0


def test_the_trainer_s_pause_holds_the_agents_calls_until_it_resumes(make_client: Any, loopback: str) -> None:
    client = make_client(group_size=2)
    client.app.state.gateway.config = GatewayConfig(pause_wait_s=0.2, retry_after_s=3)
    session = open_session(client, loopback)
    call = f"/sessions/{session['session_id']}/v1/chat/completions"
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/policy/pause", json={"mode": "drain"}).status_code == 200
    held = client.post(call, json=body)
    assert held.status_code == 503
    assert held.headers["retry-after"] == "3"
    assert client.post("/policy/resume", json={"version": 1}).status_code == 200
    assert client.post(call, json=body).status_code == 200


def test_a_session_never_ended_times_out_as_its_task_says(make_client: Any, loopback: str) -> None:
    client = make_client(group_size=2)
    gateway = client.app.state.gateway
    kept = open_session(client, loopback, "kept", timeout_s=60, on_timeout="write")
    dropped = open_session(client, loopback, "dropped", timeout_s=60, on_timeout="discard")
    for session in (kept, dropped):
        sdk(client, session).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        client.post(f"/sessions/{session['session_id']}/reward", json={"reward": 0.5})
    clock = gateway._clock
    gateway._clock = lambda: clock() + 61
    assert [s["instance_id"] for s in client.get("/gateway/sessions").json()["data"]["open"]] == [
        "kept",
        "dropped",
    ]
    assert gateway.expire() == 2
    assert client.get("/gateway/sessions").json()["data"] == {
        "open": [],
        "closed": {"written": 1, "discarded": 1},
    }
    (trajectory,) = session_trajectories(client, "kept")
    assert trajectory["instance_id"] == "kept"
    assert gateway.store.closed == {"written": 1, "discarded": 1}


def test_the_engine_refusal_reaches_the_agent_with_its_status(make_client: Any, loopback: str) -> None:
    client = make_client(group_size=2)
    session = open_session(client, loopback)
    with pytest.raises(openai.NotFoundError, match="The model `missing` does not exist"):
        sdk(client, session).chat.completions.create(
            model="missing", messages=[{"role": "user", "content": "hi"}]
        )
    assert client.get(f"/sessions/{session['session_id']}").json()["data"]["calls"] == 0


def test_with_an_api_key_the_agent_needs_its_session_key(make_client: Any, loopback: str) -> None:
    client = make_client(group_size=2, api_key="service-key")
    service = {"authorization": "Bearer service-key"}
    body = {"task_type": "agent", "instance_id": "q", "remote_engine_url": loopback}
    assert client.post("/sessions", json=body).status_code == 401
    session = client.post("/sessions", json=body, headers=service).json()["data"]
    url = f"/sessions/{session['session_id']}/v1/chat/completions"
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    assert client.post(url, json=chat, headers=service).status_code == 401
    answer = client.post(url, json=chat, headers={"authorization": f"Bearer {session['api_key']}"})
    assert answer.status_code == 200
    assert (
        client.get(
            f"/sessions/{session['session_id']}", headers={"authorization": f"Bearer {session['api_key']}"}
        ).status_code
        == 401
    )


def test_a_session_names_an_engine_or_its_task_has_one(make_client: Any) -> None:
    client = make_client(group_size=2)
    refused = client.post("/sessions", json={"task_type": "agent", "instance_id": "q"})
    assert refused.status_code == 409
    bad = client.post(
        "/sessions", json={"task_type": "agent", "instance_id": "q", "remote_engine_url": "file:///x"}
    )
    assert bad.status_code == 422
    assert "remote_engine_urls.0" in bad.text


@pytest.mark.e2e
def test_the_example_generator_trains_an_unmodified_sdk_agent_through_the_gateway(
    process: Any, loopback: str
) -> None:
    buffer_url = process("buffer.py", "--log-level", "warning", name="buffer")
    with httpx.Client(base_url=buffer_url, timeout=30, trust_env=False) as client:
        job = client.post(
            "/start_rollout",
            json={"task_type": "openai_agent", "remote_engine_url": loopback, "num_repeat_per_sample": 2},
        ).json()
        deadline = time.monotonic() + 60
        while (done := client.get(f"/jobs/{job['job_id']}").json()["data"])["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        task = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]["openai_agent"]
    assert done["status"] == "succeeded", done
    assert task["total_written"] == 64  # 32 problems of generator/data/calculator.jsonl, twice


@pytest.mark.e2e
def test_the_example_generator_writes_to_the_rollout_name_it_runs_under(process: Any, loopback: str) -> None:
    """A job started with a ``rollout_name`` writes to that task (its group size, its reads), never
    to the generator's own TASK_TYPE, which nothing configured."""
    buffer_url = process("buffer.py", "--log-level", "warning", name="buffer")
    with httpx.Client(base_url=buffer_url, timeout=30, trust_env=False) as client:
        job = client.post(
            "/start_rollout",
            json={
                "task_type": "openai_agent",
                "rollout_name": "agent-eval",
                "remote_engine_url": loopback,
                "num_repeat_per_sample": 2,
            },
        ).json()
        assert job["task_type"] == "agent-eval", job
        deadline = time.monotonic() + 60
        while (done := client.get(f"/jobs/{job['job_id']}").json()["data"])["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tasks = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]
    assert done["status"] == "succeeded", done
    assert tasks["agent-eval"]["total_written"] == 64  # 32 problems, twice, in groups of 2
    assert tasks.get("openai_agent", {}).get("total_written", 0) == 0


def test_a_paused_generation_is_waited_out_when_it_resumes_in_time(make_client: Any, loopback: str) -> None:
    class Resuming:
        def __init__(self) -> None:
            self.waited: list[float] = []

        def is_paused(self) -> bool:
            return True

        async def wait_resumed(self, timeout_s: float) -> bool:
            self.waited.append(timeout_s)
            return True

    client = make_client(group_size=2)
    gate = Resuming()
    client.app.state.gateway.pause_gate = gate
    session = open_session(client, loopback)
    answer = sdk(client, session).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "Hello."
    assert gate.waited == [GatewayConfig().pause_wait_s]
    assert sdk(client, session).models.list().data[0].id == "loopback"


@pytest.mark.e2e
def test_a_killed_service_comes_back_with_every_answered_call(
    tmp_path: Path, generator_dir: Path, loopback: str
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "buffer.py",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    command += [
        "--data-dir",
        str(tmp_path / "data"),
        "--group-size",
        "2",
        "--generator-dir",
        str(generator_dir),
    ]
    before = len(engine_log(loopback))
    with contextlib.ExitStack() as stack:
        running = stack.enter_context(started(command, "buffer", tmp_path / "buffer.log"))
        wait_ready(f"{url}/health", running, 60, "the buffer")
        session = httpx.post(
            f"{url}/sessions", json={"task_type": "agent", "instance_id": "q1", "remote_engine_url": loopback}
        ).json()["data"]
        agent = stack.enter_context(
            openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        )
        question = {"role": "user", "content": "Compute 2 + 3."}
        first = agent.chat.completions.create(model="policy", messages=[question], tools=TOOLS)
        running.kill()  # no shutdown: only what was acknowledged is on disk
        running.wait()
        running = stack.enter_context(started(command, "buffer", tmp_path / "buffer-2.log"))
        wait_ready(f"{url}/health", running, 60, "the buffer")
        reply = first.choices[0].message
        history = [
            question,
            reply.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"},
        ]
        agent.chat.completions.create(model="policy", messages=history, tools=TOOLS)
        ended = httpx.post(f"{url}/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()
        assert ended["data"]["written"], ended
        companion = {"instance_id": "q1", "task_type": "agent", "reward": 0.0}
        companion["messages"] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        httpx.post(f"{url}/buffer/write", json=companion).raise_for_status()
        items = httpx.post(f"{url}/get_rollout_data", json={"task_type": "agent"}).json()["data"]["data"]
    (trajectory,) = [item for item in items if str(item["uid"]).startswith("session-")]
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_token_faithful(trajectory, engine_log(loopback)[before:])


def test_a_session_takes_its_engine_and_timeout_from_its_task(make_client: Any, loopback: str) -> None:
    client = make_client(group_size=2)
    gateway = client.app.state.gateway
    task = {"remote_engine_url": loopback, "session_timeout_s": "5", "session_on_timeout": "write"}
    client.app.state.services.buffer.job_started("agent", "agent_generator", task)  # as /start_rollout does
    session = client.post("/sessions", json={"task_type": "agent", "instance_id": "q1"}).json()["data"]
    sdk(client, session).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    client.post(f"/sessions/{session['session_id']}/reward", json={"reward": 1.0})
    clock = gateway._clock
    gateway._clock = lambda: clock() + 4
    assert gateway.expire() == 0
    gateway._clock = lambda: clock() + 6
    assert gateway.expire() == 1
    (trajectory,) = session_trajectories(client)
    assert trajectory["messages"][-1]["content"] == "Hello."


@pytest.mark.e2e
@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_an_sdk_agent_through_the_gateway_against_the_simulator(
    make_client: Any, process: Any, dialect: str
) -> None:
    """The simulated engine with a real tokenizer and ChatML template: the trained sample is its
    prompts and samples, one branch, masked and logprobbed exactly."""
    simulator = process(
        "-m",
        "buffer.simulator",
        "--engine",
        dialect,
        "--served-model-name",
        "policy",
        "--latency-mean-s",
        "0.01",
        name="sim",
    )
    client = make_client(group_size=2)
    session = open_session(client, simulator)
    answer = calculator_agent(sdk(client, session), "Compute 3 * (4 + 5).", stream=True)
    assert "27" in answer
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    (trajectory,) = session_trajectories(client)
    turns = trajectory["turns"]
    assert len(turns) == 2
    assert turns[0]["finish_reason"] == "tool_calls"
    # the second prompt extends the first prompt and reply
    assert_token_faithful(trajectory, turns_as_calls(trajectory))


def test_an_end_retried_once_the_session_ended_answers_what_the_first_end_did(
    tmp_path: Path, generator_dir: Path, loopback: str
) -> None:
    settings = Settings(generator_dir=generator_dir, port=8889, group_size=2, data_dir=tmp_path / "data")

    def end(client: TestClient, session: dict[str, Any], **body: Any) -> httpx.Response:
        return client.post(f"/sessions/{session['session_id']}/end", json=body)

    with TestClient(create_app(settings)) as client:
        written = open_session(client, loopback)
        sdk(client, written).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        first = end(client, written, reward=1.0).json()["data"]
        assert first["written"] is True
        again = end(client, written, reward=1.0)
        assert again.status_code == 200, again.text
        assert again.json()["data"] == {**first, "duplicate": True}
        discarded = open_session(client, loopback, "q2")
        assert end(client, discarded, discard=True).json()["data"] == {"written": False}
        assert end(client, discarded, discard=True).json()["data"] == {"written": False}
        refused = end(client, discarded, reward=1.0)
        assert refused.status_code == 409
        assert "discarded" in refused.json()["message"]
    with TestClient(create_app(settings)) as client:  # the end's answer lost, the service restarted
        again = end(client, written, reward=1.0)
        assert again.status_code == 200, again.text
        assert again.json()["data"]["uid"] == first["uid"]
        client.app.state.services.buffer.journal.compact()
    with TestClient(create_app(settings)) as client:  # remembered through a snapshot too
        assert end(client, written, reward=1.0).json()["data"]["uid"] == first["uid"]
        (trajectory,) = session_trajectories(client)  # written once
    assert trajectory["uid"] == first["uid"]
    never = {"session_id": "never-opened"}
    with TestClient(create_app(settings)) as client:
        assert end(client, never).status_code == 404
