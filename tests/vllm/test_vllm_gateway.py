"""The recording gateway in front of a real vLLM: an unmodified OpenAI-SDK agent, streamed and
not, is trained on exactly what vLLM received and sampled, with vLLM's own logprobs."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from buffer.toolkit import calculate
from tests.support.engine_records import assert_sampled
from tests.support.sdk import streamed_message
from tests.support.vllm_engine import MODEL_NAME
from tests.vllm.conftest import Engine
from tests.vllm.test_vllm_generators import TOOL_CALL, assert_logprobs_are_the_models, engine_answers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def agent(client: openai.OpenAI, *, stream: bool) -> None:
    """An ordinary SDK tool loop: the first call is made to call the tool (vLLM's structured
    outputs, as ``extra_body``), the second answers freely."""
    messages: list[Any] = [{"role": "user", "content": "What is 3 * (4 + 5)?"}]
    for forced in (True, False):
        extra = {"structured_outputs": {"regex": TOOL_CALL}} if forced else {}
        if stream:
            message, tool_calls = streamed_message(
                client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=messages,
                    tools=TOOLS,
                    stream=True,
                    max_tokens=64,
                    extra_body=extra,
                )
            )
            messages.append(message)
        else:
            reply = (
                client.chat.completions.create(
                    model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=64, extra_body=extra
                )
                .choices[0]
                .message
            )
            messages.append(reply)
            tool_calls = [call.model_dump() for call in reply.tool_calls or ()]
        assert bool(tool_calls) == forced, tool_calls
        for call in tool_calls:
            expression = json.loads(call["function"]["arguments"])["expression"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(expression)})


@pytest.mark.parametrize("stream", [False, True])
def test_an_sdk_agent_through_the_gateway_is_trained_on_what_vllm_sampled(
    vllm: Engine, make_client: Any, stream: bool
) -> None:
    client: TestClient = make_client(group_size=2)
    opened = client.post(
        "/sessions", json={"task_type": "agent", "instance_id": "q1", "remote_engine_url": vllm.url}
    )
    assert opened.status_code == 200, opened.text
    session = opened.json()["data"]
    sdk = openai.OpenAI(
        base_url=session["base_url"], api_key=session["api_key"], http_client=client, max_retries=0
    )
    agent(sdk, stream=stream)
    ended = client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    assert ended.json()["data"]["written"] is True
    companion = {"instance_id": "q1", "task_type": "agent", "reward": 0.0}
    companion["messages"] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert client.post("/buffer/write", json=companion).status_code == 200
    items = client.post("/get_rollout_data", json={"task_type": "agent"}).json()["data"]["data"]
    (trajectory,) = [item for item in items if str(item["uid"]).startswith("session-")]

    assert len(trajectory["turns"]) == 2
    to_score = assert_sampled(engine_answers(vllm), trajectory).turns
    # The first turn was sampled under a grammar: its logprobs are the masked distribution's (a
    # forced token has logprob 0 there), marked so and never handed over; the free second turn's
    # are the model's.
    assert trajectory["turns"][0]["logprobs"] == "constrained"
    assert_logprobs_are_the_models(vllm, to_score[1:])
