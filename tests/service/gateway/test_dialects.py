"""The gateway's other dialects: unmodified agents written with Anthropic's SDK (Messages) and
OpenAI's SDK (Responses) run through a session, each trained on exactly what the engine received
and sampled. Against the loopback engine (its log is what it sampled) and the simulator (a real
tokenizer, with the thinking template: reasoning sent back as thinking blocks and items)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from buffer.toolkit import calculate
from tests.support.gateway import (
    TOOLS,
    assert_token_faithful,
    engine_log,
    open_session,
    serving,
    session_trajectories,
)

pytestmark = pytest.mark.timeout(90)

ANTHROPIC_TOOLS: list[Any] = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
]
RESPONSES_TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        "strict": False,
    }
]


@pytest.fixture(scope="module")
def thinking_simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The simulator with the thinking (Qwen3-style) template: it reasons in <think> first."""
    args = ["-m", "buffer.simulator", "--chat-template", "thinking", "--served-model-name", "policy"]
    args += ["--accuracy", "1.0", "--latency-mean-s", "0.01", "--seed", "0", "--log-level", "warning"]
    with serving(tmp_path_factory, "sim", *args) as url:
        yield url


# -- the agents: nothing in them knows about the gateway ---------------------------------------


def claude_agent(client: anthropic.Anthropic, question: str, *, stream: bool) -> tuple[str, list[Any]]:
    """An ordinary Anthropic-SDK tool-use loop with thinking; its final text and its messages."""
    messages: list[Any] = [{"role": "user", "content": question}]
    request: dict[str, Any] = {
        "model": "policy",
        "max_tokens": 1024,
        "system": "Use the calculator.",
        "tools": ANTHROPIC_TOOLS,
        "thinking": {"type": "enabled", "budget_tokens": 512},
    }
    for _ in range(4):
        if stream:
            with client.messages.stream(messages=messages, **request) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(messages=messages, **request)
        messages.append({"role": "assistant", "content": message.content})
        uses = [block for block in message.content if block.type == "tool_use"]
        if message.stop_reason != "tool_use":
            return "".join(block.text for block in message.content if block.type == "text"), messages
        results = [
            {"type": "tool_result", "tool_use_id": use.id, "content": calculate(use.input["expression"])}
            for use in uses
        ]
        messages.append({"role": "user", "content": results})
    raise AssertionError("the agent did not finish")


def responses_agent(client: openai.OpenAI, question: str, *, stream: bool) -> tuple[str, list[Any]]:
    """An ordinary OpenAI-SDK Responses loop, chained by ``previous_response_id``; its final text
    and every response."""
    items: list[Any] = [{"role": "user", "content": question}]
    previous: str | None = None
    made: list[Any] = []
    for _ in range(4):
        request: dict[str, Any] = {
            "model": "policy",
            "instructions": "Use the calculator.",
            "input": items,
            "tools": RESPONSES_TOOLS,
            "max_output_tokens": 1024,
        }
        if previous is not None:
            request["previous_response_id"] = previous
        if stream:
            with client.responses.stream(**request) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(**request)
        made.append(response)
        previous = response.id
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text, made
        items = [
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": calculate(json.loads(call.arguments)["expression"]),
            }
            for call in calls
        ]
    raise AssertionError("the agent did not finish")


def claude(client: TestClient, session: dict[str, Any]) -> anthropic.Anthropic:
    """Anthropic's SDK adds ``/v1/messages`` to its base URL: the session's root without ``/v1``."""
    return anthropic.Anthropic(
        base_url=session["base_url"].removesuffix("/v1"),
        api_key=session["api_key"],
        http_client=client,
        max_retries=0,
    )


def codex(client: TestClient, session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=session["base_url"], api_key=session["api_key"], http_client=client, max_retries=0
    )


def turns_as_calls(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"prompt_ids": t["prompt_ids"], "output_ids": t["output_ids"], "logprobs": t["output_logprobs"]}
        for t in trajectory["turns"]
    ]


# -- against the loopback engine: the turns are what it sampled --------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_sdk_agent_is_trained_on_exactly_what_the_engine_saw(
    make_client: Any, loopback: str, stream: bool
) -> None:
    client = make_client(group_size=2)
    before = len(engine_log(loopback))
    session = open_session(client, loopback)
    answer, _ = claude_agent(claude(client, session), "Compute 3 * (4 + 5).", stream=stream)
    assert answer == "The answer is 27."
    assert client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0}).json()["data"][
        "written"
    ]

    (trajectory,) = session_trajectories(client)
    calls = engine_log(loopback)[before:]
    assert len(calls) == 2
    assert trajectory["tools"] == TOOLS
    assert [m["role"] for m in trajectory["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory["turns"][0]["finish_reason"] == "tool_calls"
    assert trajectory["turns"][0]["sampling"]["max_tokens"] == 1024
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]  # one conversation, not two roots
    assert_token_faithful(trajectory, calls)


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_responses_agent_is_trained_on_exactly_what_the_engine_saw(
    make_client: Any, loopback: str, stream: bool
) -> None:
    client = make_client(group_size=2)
    before = len(engine_log(loopback))
    session = open_session(client, loopback)
    answer, made = responses_agent(codex(client, session), "Compute 3 * (4 + 5).", stream=stream)
    assert answer == "The answer is 27."
    assert made[0].status == "completed"
    assert made[0].output[0].type == "function_call"
    assert made[0].usage.input_tokens == len(engine_log(loopback)[before]["prompt_ids"])
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})

    (trajectory,) = session_trajectories(client)
    calls = engine_log(loopback)[before:]
    assert len(calls) == 2
    assert [m["role"] for m in trajectory["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_token_faithful(trajectory, calls)


# -- against the simulator: a real tokenizer, reasoning sent back -----------------------------


@pytest.mark.e2e
def test_an_anthropic_sdk_agent_with_thinking_streams_and_is_trained_token_exact(
    make_client: Any, thinking_simulator: str
) -> None:
    client = make_client(group_size=2)
    session = open_session(client, thinking_simulator)
    answer, messages = claude_agent(claude(client, session), "Compute 3 * (4 + 5).", stream=True)
    assert "27" in answer
    first = messages[1]["content"]
    assert [block.type for block in first] == ["thinking", "tool_use"]
    assert first[0].thinking
    assert first[0].signature
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})

    (trajectory,) = session_trajectories(client)
    assert len(trajectory["turns"]) == 2
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    reply = trajectory["messages"][2]
    assert reply["generated"]
    assert reply["tool_calls"]
    assert (reply.get("reasoning_content") or reply.get("reasoning")) == first[0].thinking
    assert_token_faithful(trajectory, turns_as_calls(trajectory))  # the second prompt extends the first


@pytest.mark.e2e
def test_an_openai_responses_agent_with_reasoning_is_trained_token_exact(
    make_client: Any, thinking_simulator: str
) -> None:
    client = make_client(group_size=2)
    session = open_session(client, thinking_simulator)
    answer, made = responses_agent(codex(client, session), "Compute 3 * (4 + 5).", stream=True)
    assert "27" in answer
    assert [item.type for item in made[0].output] == ["reasoning", "function_call"]
    client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})

    (trajectory,) = session_trajectories(client)
    assert len(trajectory["turns"]) == 2
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_token_faithful(trajectory, turns_as_calls(trajectory))


# -- errors, in each dialect's shape ----------------------------------------------------------


def test_errors_reach_an_anthropic_agent_in_anthropic_s_shape(make_client: Any, loopback: str) -> None:
    client = make_client(group_size=2, api_key="service-key")
    headers = {"Authorization": "Bearer service-key"}
    session = client.post(
        "/sessions",
        json={"task_type": "agent", "instance_id": "q1", "remote_engine_url": loopback},
        headers=headers,
    ).json()["data"]
    wrong = anthropic.Anthropic(
        base_url=session["base_url"].removesuffix("/v1"), api_key="nope", http_client=client, max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="policy", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
    agent = claude(client, session)  # the session's key, as x-api-key
    reply = agent.messages.create(model="policy", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert reply.content[0].text == "Hello."
    assert reply.stop_reason == "end_turn"
    with pytest.raises(anthropic.UnprocessableEntityError) as bad:
        agent.messages.create(
            model="policy",
            max_tokens=16,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.type" in bad.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        agent.messages.create(model="missing", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert "does not exist" in missing.value.message
    unknown = client.post(
        "/sessions/never-opened/v1/messages",
        json={"model": "policy", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"


def test_a_previous_response_of_another_session_is_refused_naming_the_field(
    make_client: Any, loopback: str
) -> None:
    client = make_client(group_size=2)
    first = open_session(client, loopback)
    second = open_session(client, loopback, "q2")
    response = codex(client, first).responses.create(model="policy", input="hi")
    assert response.output_text == "Hello."
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        codex(client, second).responses.create(model="policy", input="hi", previous_response_id=response.id)
    assert refused.value.body["param"] == "previous_response_id"
    unstored = codex(client, first).responses.create(model="policy", input="hi", store=False)
    with pytest.raises(openai.UnprocessableEntityError):
        codex(client, first).responses.create(model="policy", input="again", previous_response_id=unstored.id)
