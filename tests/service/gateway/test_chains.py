"""A session's conversations, its pinned sampling, an SDK's retries and a cancelled call.

The engine is the stand-in of ``tests.support.loopback_engine`` in-process, behind a transport
that keeps every body the gateway sent it (and can hold its answers)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from buffer.service.gateway.calls import Call
from buffer.service.gateway.proxy import EngineProxy
from buffer.service.gateway.service import GatewayConfig
from buffer.service.gateway.tree import chains
from buffer.service.routes.sessions import AgentGone, unless_disconnected
from buffer.simulator.tokenizer import build_tokenizer
from buffer.trainer.samples.turns import samples_from_turns
from tests.support.calls import wait_for
from tests.support.gateway import (
    TOOLS,
    HeldEngine,
    calculator_agent,
    open_session,
    proxied_to,
    sdk,
    session_trajectories,
)
from tests.support.loopback_engine import create_engine_app

pytestmark = pytest.mark.timeout(60)
ENGINE = "http://engine.test"
QUESTION = {"role": "user", "content": "Compute 6 * 7."}


@pytest.fixture
def engine() -> HeldEngine:
    return HeldEngine(create_engine_app())


@pytest.fixture
def client(make_client: Any, engine: HeldEngine) -> TestClient:
    return proxied_to(make_client(group_size=2), "vllm", engine)


def solve(agent: openai.OpenAI, **extra: Any) -> None:
    first = agent.chat.completions.create(model="policy", messages=[QUESTION], tools=TOOLS, **extra)
    reply = first.choices[0].message
    history = [
        QUESTION,
        reply.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "42"},
    ]
    agent.chat.completions.create(model="policy", messages=history, tools=TOOLS, **extra)


def test_a_planner_and_a_solver_are_two_trajectories_each_in_its_role_s_group(client: TestClient) -> None:
    session = open_session(client, ENGINE)
    agent = sdk(client, session)
    plan = [{"role": "system", "content": "Plan only."}, QUESTION]
    agent.chat.completions.create(model="policy", messages=plan, extra_headers={"x-rollout-role": "planner"})
    summary = [{"role": "system", "content": "Summarise."}, QUESTION]
    agent.chat.completions.create(model="policy", messages=summary, metadata={"role": "summariser"})
    solve(agent)
    ended = client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()["data"]
    main, planner = f"session-{session['session_id']}", f"session-{session['session_id']}-planner"
    summariser = f"session-{session['session_id']}-summariser"
    assert ended["uids"] == [main, planner, summariser]
    again = client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()["data"]
    assert again["uids"] == ended["uids"]
    assert again["duplicate"]

    read = session_trajectories(client, "q1", "q1#planner", "q1#summariser")
    trajectories = {trajectory["uid"]: trajectory for trajectory in read}
    assert sorted(trajectories) == sorted(ended["uids"])  # each written once
    solver, planned = trajectories[main], trajectories[planner]
    assert (solver["instance_id"], solver["extra_info"]["role"]) == ("q1", "main")
    assert (planned["instance_id"], planned["extra_info"]["role"]) == ("q1#planner", "planner")
    assert [len(t["turns"]) for t in (solver, planned)] == [2, 1]
    assert planned["messages"][0]["content"] == "Plan only."
    assert trajectories[summariser]["extra_info"]["role"] == "summariser"
    assert solver["extra_info"]["gateway"]["chains"] == [[2, 3], [0], [1]]


def test_a_retried_call_is_no_chain_and_each_choice_of_a_request_is_one() -> None:
    def call(messages: list[dict[str, Any]], parent: int | None, choice: int = 0) -> Call:
        reply = {"role": "assistant", "content": "x"}
        return Call(messages, None, {}, reply, "stop", None, parent, 0.0, choice=choice)

    other = {"role": "user", "content": "Summarise."}
    calls = [
        call([QUESTION], None),  # retried by the next: abandoned
        call([QUESTION], None),
        call([other], None),  # n = 2: each choice a chain of its own
        call([other], None, choice=1),
        call([{"role": "tool", "content": "1"}], 1),
    ]
    assert chains(calls, 4) == [[1, 4], [2], [3]]
    assert chains(calls, 0) == [[0], [2], [3], [1, 4]]  # the end named: the rest stays


def test_the_session_s_sampling_is_what_the_engine_gets_whatever_the_agent_asks(
    client: TestClient, engine: HeldEngine
) -> None:
    pins = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 64}
    session = open_session(client, ENGINE, sampling=pins)
    solve(sdk(client, session), temperature=0.7, top_p=0.9, max_tokens=1000)
    assert [(b["temperature"], b["top_p"], b["top_k"], b["max_tokens"]) for b in engine.bodies] == [
        (1.0, 1.0, -1, 64)
    ] * 2
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    (trajectory,) = session_trajectories(client, "q1")
    turn = trajectory["turns"][0]
    assert turn["sampling"]["temperature"] == 1.0
    assert turn["sampling_asked"] == {"temperature": 0.7, "top_p": 0.9, "top_k": None, "max_tokens": 1000}
    assert trajectory["extra_info"]["sampling_pinned"] == pins


def test_a_call_forced_by_tool_choice_alone_is_marked_sampled_under_a_grammar(client: TestClient) -> None:
    """A named tool or "required" constrains decoding: the turn's logprobs are the grammar's,
    never handed to a trainer as the policy's; a free call's are the policy's."""
    session = open_session(client, ENGINE)
    forced = {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}}
    solve(sdk(client, session), tool_choice=forced)
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    (trajectory,) = session_trajectories(client, "q1")
    assert [turn["logprobs"] for turn in trajectory["turns"]] == ["constrained", "constrained"]


def test_a_task_pins_the_sampling_of_its_sessions_and_a_bad_pin_is_refused(
    client: TestClient, engine: HeldEngine
) -> None:
    buffer = client.app.state.services.buffer
    buffer.job_started("agent", "agent_generator", {"session_sampling": '{"temperature": 0.6}'})
    session = open_session(client, ENGINE)
    sdk(client, session).chat.completions.create(model="policy", messages=[QUESTION], temperature=1.3)
    assert engine.bodies[-1]["temperature"] == 0.6
    buffer.job_started("agent", "agent_generator", {"session_sampling": '{"temprature": 0.6}'})
    refused = client.post(
        "/sessions", json={"task_type": "agent", "instance_id": "q", "remote_engine_url": ENGINE}
    )
    assert refused.status_code == 422
    assert "session_sampling.temprature" in refused.text
    bad = client.post(
        "/sessions",
        json={
            "task_type": "agent",
            "instance_id": "q",
            "remote_engine_url": ENGINE,
            "sampling": {"top_p": 0},
        },
    )
    assert bad.status_code == 422
    assert "sampling.top_p" in bad.text


def test_an_sdk_retry_of_a_recorded_call_is_answered_from_the_record(
    client: TestClient, engine: HeldEngine
) -> None:
    session = open_session(client, ENGINE)
    url = f"/sessions/{session['session_id']}/v1/chat/completions"
    body = {"model": "policy", "messages": [QUESTION], "tools": TOOLS}
    first = client.post(url, json=body, headers={"x-stainless-retry-count": "0"}).json()
    retried = client.post(url, json=body, headers={"x-stainless-retry-count": "1"}).json()
    assert retried["choices"][0]["message"] == first["choices"][0]["message"]
    assert len(engine.bodies) == 1
    assert client.get(f"/sessions/{session['session_id']}").json()["data"]["calls"] == 1


def test_an_sdk_retry_of_a_call_in_flight_waits_for_it_and_it_is_recorded_once(
    client: TestClient, engine: HeldEngine
) -> None:
    session = open_session(client, ENGINE)
    url = f"/sessions/{session['session_id']}/v1/chat/completions"
    body = {"model": "policy", "messages": [QUESTION], "tools": TOOLS}
    answers: list[dict[str, Any]] = []

    def post(retry: int) -> None:
        answers.append(client.post(url, json=body, headers={"x-stainless-retry-count": str(retry)}).json())

    engine.held = True
    threads = [threading.Thread(target=post, args=(retry,)) for retry in (0, 1)]
    try:
        threads[0].start()
        wait_for(lambda: len(engine.bodies) == 1, 30, "the first request at the engine")
        threads[1].start()
        flights = client.app.state.gateway._flights
        wait_for(lambda: [f.waiters for f in flights.values()] == [2], 30, "the retry waiting on the first")
    finally:
        client.portal.call(engine.release)
        for thread in threads:
            if thread.is_alive():
                thread.join(30)
    assert len(answers) == 2
    assert answers[0]["choices"] == answers[1]["choices"]
    assert len(engine.bodies) == 1
    assert client.get(f"/sessions/{session['session_id']}").json()["data"]["calls"] == 1


def test_a_call_its_agent_left_is_cancelled_at_the_engine(client: TestClient, engine: HeldEngine) -> None:
    gateway = client.app.state.gateway
    gateway.config = GatewayConfig(retry_grace_s=0.0)
    session = gateway.session(open_session(client, ENGINE)["session_id"])
    engine.held = True

    async def start() -> asyncio.Task[dict[str, Any]]:
        return asyncio.ensure_future(gateway.complete(session, {"model": "policy", "messages": [QUESTION]}))

    call = client.portal.call(start)
    try:
        wait_for(lambda: len(engine.bodies) == 1, 30, "the request at the engine")
        client.portal.call(call.cancel)  # what the route does when the agent disconnects
        wait_for(lambda: engine.cancelled == 1, 30, "the engine's request cancelled")
    finally:
        client.portal.call(engine.release)
    assert not session.calls


@pytest.mark.anyio
async def test_the_route_cancels_the_call_when_the_agent_disconnects() -> None:
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def engine_call() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = asyncio.ensure_future(unless_disconnected(request, engine_call()))
    await started.wait()
    gone.set()
    with pytest.raises(AgentGone):
        await waiting
    await asyncio.wait_for(cancelled.wait(), 10)


@pytest.mark.e2e
@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_a_session_in_token_mode_is_one_sample_per_chain_its_prompts_extended(
    make_client: Any, process: Any, tmp_path: Path, dialect: str
) -> None:
    """The gateway renders a chain's first prompt once and extends it with the ids sampled and
    each observation's tokens: the engine never re-tokenises the model's text (``tito``)."""
    tokenizer = tmp_path / "tokenizer"
    build_tokenizer().save_pretrained(str(tokenizer))
    simulator = process(
        "-m",
        "buffer.simulator",
        "--engine",
        dialect,
        "--served-model-name",
        "policy",
        "--tokenizer-path",
        str(tokenizer),
        "--latency-mean-s",
        "0.01",
        name="sim",
    )
    client = make_client(group_size=2)
    body = {"task_type": "agent", "instance_id": "q1", "remote_engine_url": simulator}
    opened = client.post("/sessions", json={**body, "token_mode": True, "tokenizer_path": str(tokenizer)})
    assert opened.status_code == 200, opened.text
    session = opened.json()["data"]
    answer = calculator_agent(sdk(client, session), "Compute 3 * (4 + 5).", stream=False)
    assert "27" in answer
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    (trajectory,) = session_trajectories(client, "q1")
    first, second = trajectory["turns"]
    assert first["finish_reason"] == "tool_calls"
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(first["output_ids"])] == (
        first["prompt_ids"] + first["output_ids"]
    )
    assert len(samples_from_turns(trajectory, 1.0, 1.0)) == 1
    assert trajectory["extra_info"]["token_mode"] is True
    stats = httpx.get(f"{simulator}/stats").json()
    assert stats["requests"] == 2


def test_token_mode_needs_a_tokenizer_that_loads(client: TestClient, tmp_path: Path) -> None:
    body = {"task_type": "agent", "instance_id": "q1", "remote_engine_url": ENGINE, "token_mode": True}
    missing = client.post("/sessions", json=body)
    assert missing.status_code == 422
    assert "tokenizer_path" in missing.text
    broken = client.post("/sessions", json={**body, "tokenizer_path": str(tmp_path / "none")})
    assert broken.status_code == 422
    assert "does not load" in broken.text


def test_token_mode_sends_the_ids_sampled_even_where_they_re_encode_otherwise(
    make_client: Any, tmp_path: Path
) -> None:
    """The engine samples a non-canonical tokenisation (one id per character): the next prompt
    holds those very ids, where chat mode's re-rendering would re-tokenise them (a branch)."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    reply = "The answer is 42."
    sampled = [i for c in reply for i in tokenizer.encode(c, add_special_tokens=False)]
    sampled.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert sampled[:-1] != tokenizer.encode(reply, add_special_tokens=False)  # non-canonical
    prompts: list[list[int]] = []

    def generate(request: httpx.Request) -> httpx.Response:
        prompts.append(httpx.Response(200, content=request.content).json()["input_ids"])
        entries = [[-0.1, token, None] for token in sampled]
        meta = {"output_token_logprobs": entries, "finish_reason": {"type": "stop"}}
        return httpx.Response(200, json={"text": reply, "output_ids": sampled, "meta_info": meta})

    client = make_client(group_size=2)
    client.app.state.gateway.proxy = EngineProxy(engine="sglang", transport=httpx.MockTransport(generate))
    session = open_session(client, ENGINE, token_mode=True, tokenizer_path=str(tmp_path / "tokenizer"))
    agent = sdk(client, session)
    first = agent.chat.completions.create(model="policy", messages=[QUESTION])
    assert first.choices[0].message.content == reply
    history = [QUESTION, {"role": "assistant", "content": reply}, {"role": "user", "content": "Sure?"}]
    agent.chat.completions.create(model="policy", messages=history)
    assert prompts[1][: len(prompts[0]) + len(sampled)] == prompts[0] + sampled
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    (trajectory,) = session_trajectories(client, "q1")
    assert len(samples_from_turns(trajectory, 1.0, 1.0)) == 1  # one sample, no branch
