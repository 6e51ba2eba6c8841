"""The recording gateway in front of a real vLLM: unmodified agents (OpenAI chat, streamed and not;
Anthropic Messages; OpenAI Responses; a session in token mode) are trained on exactly what vLLM
received and sampled, with vLLM's own logprobs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from buffer.toolkit import calculate
from buffer.trainer.samples.turns import samples_from_turns
from tests.support.engine_records import assert_sampled
from tests.support.sdk import streamed_message
from tests.support.vllm_engine import MODEL_NAME
from tests.vllm.conftest import Engine
from tests.vllm.test_vllm_generators import (
    TOOL_CALL,
    _tokenizer,
    assert_logprobs_are_the_models,
    engine_answers,
)

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


def trajectory_of(
    client: TestClient, vllm: Engine, run: Callable[[dict[str, Any]], None], **fields: Any
) -> dict[str, Any]:
    """``run`` (an agent given the session) through a session of ``client``'s service on ``vllm``;
    the trajectory the session wrote (a companion completes its group of 2)."""
    body = {"task_type": "agent", "instance_id": "q1", "remote_engine_url": vllm.url, **fields}
    opened = client.post("/sessions", json=body)
    assert opened.status_code == 200, opened.text
    session = opened.json()["data"]
    run(session)
    ended = client.post(f"/sessions/{session['session_id']}/end", json={"reward": 1.0})
    assert ended.json()["data"]["written"] is True, ended.text
    companion = {"instance_id": "q1", "task_type": "agent", "reward": 0.0}
    companion["messages"] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert client.post("/buffer/write", json=companion).status_code == 200
    items = client.post("/get_rollout_data", json={"task_type": "agent"}).json()["data"]["data"]
    (trajectory,) = [item for item in items if str(item["uid"]).startswith("session-")]
    return dict(trajectory)


def assert_trained_on_what_vllm_sampled(vllm: Engine, trajectory: dict[str, Any]) -> None:
    """Both turns are what vLLM received and sampled. The first was sampled under a grammar (the
    forced tool call): its logprobs are the masked distribution's (a forced token has logprob 0
    there), marked so and never handed over; the free second turn's are the model's."""
    assert len(trajectory["turns"]) == 2
    to_score = assert_sampled(engine_answers(vllm), trajectory).turns
    assert trajectory["turns"][0]["logprobs"] == "constrained"  # tool_choice or structured_outputs
    assert_logprobs_are_the_models(vllm, to_score[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_an_sdk_agent_through_the_gateway_is_trained_on_what_vllm_sampled(
    vllm: Engine, make_client: Any, stream: bool
) -> None:
    client: TestClient = make_client(group_size=2)

    def run(session: dict[str, Any]) -> None:
        sdk = openai.OpenAI(
            base_url=session["base_url"], api_key=session["api_key"], http_client=client, max_retries=0
        )
        agent(sdk, stream=stream)

    assert_trained_on_what_vllm_sampled(vllm, trajectory_of(client, vllm, run))


#: The dialects cannot carry vLLM's ``structured_outputs``: their first call names the tool
#: (``tool_choice``), which vLLM forces with a JSON schema of its parameters; the enum keeps the
#: arguments short whatever the random model would write.
EXPRESSION: dict[str, Any] = {"type": "object", "required": ["expression"], "additionalProperties": False}
EXPRESSION["properties"] = {"expression": {"type": "string", "enum": ["3 * 9"]}}


def claude_agent(client: anthropic.Anthropic) -> None:
    """An ordinary Anthropic-SDK tool-use loop, streamed: the tool forced, then a free answer."""
    tools: Any = [{"name": "calculator", "description": "Evaluate arithmetic.", "input_schema": EXPRESSION}]
    messages: list[Any] = [{"role": "user", "content": "What is 3 * 9?"}]
    for forced in (True, False):
        choice: Any = {"type": "tool", "name": "calculator"} if forced else {"type": "auto"}
        with client.messages.stream(
            model=MODEL_NAME, max_tokens=128, tools=tools, tool_choice=choice, messages=messages
        ) as stream:
            message = stream.get_final_message()
        messages.append({"role": "assistant", "content": message.content})
        uses = [block for block in message.content if block.type == "tool_use"]
        assert (message.stop_reason == "tool_use") == forced, message
        results = [
            {"type": "tool_result", "tool_use_id": use.id, "content": calculate("3 * 9")} for use in uses
        ]
        messages.append({"role": "user", "content": results})


def test_an_anthropic_sdk_agent_through_the_gateway_is_trained_on_what_vllm_sampled(
    vllm: Engine, make_client: Any
) -> None:
    client: TestClient = make_client(group_size=2)

    def run(session: dict[str, Any]) -> None:
        root = session["base_url"].removesuffix("/v1")
        claude_agent(
            anthropic.Anthropic(base_url=root, api_key=session["api_key"], http_client=client, max_retries=0)
        )

    trajectory = trajectory_of(client, vllm, run)
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_trained_on_what_vllm_sampled(vllm, trajectory)


def responses_agent(client: openai.OpenAI) -> None:
    """An ordinary OpenAI-SDK Responses loop chained by ``previous_response_id``: the tool
    forced, then a free answer."""
    tool: Any = {"type": "function", "name": "calculator", "parameters": EXPRESSION, "strict": False}
    items: Any = "What is 3 * 9?"
    previous: Any = openai.NOT_GIVEN
    for forced in (True, False):
        choice: Any = {"type": "function", "name": "calculator"} if forced else "auto"
        response = client.responses.create(
            model=MODEL_NAME,
            input=items,
            tools=[tool],
            tool_choice=choice,
            max_output_tokens=128,
            previous_response_id=previous,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert bool(calls) == forced, response.output
        previous = response.id
        items = [
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": calculate("3 * 9"),
            }
            for call in calls
        ]


def test_an_openai_responses_agent_through_the_gateway_is_trained_on_what_vllm_sampled(
    vllm: Engine, make_client: Any
) -> None:
    client: TestClient = make_client(group_size=2)

    def run(session: dict[str, Any]) -> None:
        responses_agent(
            openai.OpenAI(
                base_url=session["base_url"], api_key=session["api_key"], http_client=client, max_retries=0
            )
        )

    trajectory = trajectory_of(client, vllm, run)
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    assert_trained_on_what_vllm_sampled(vllm, trajectory)


def test_a_token_mode_session_on_vllm_is_one_sample_of_what_vllm_sampled(
    vllm: Engine, make_client: Any
) -> None:
    """The gateway owns the tokens (vLLM's ``/v1/completions``): the second prompt is the first
    and the ids vLLM sampled, then the follow-up's tokens; one sample, the model's logprobs."""
    client: TestClient = make_client(group_size=2)

    def run(session: dict[str, Any]) -> None:
        sdk = openai.OpenAI(
            base_url=session["base_url"], api_key=session["api_key"], http_client=client, max_retries=0
        )
        messages: list[Any] = [{"role": "user", "content": "What is 3 * 9?"}]
        reply = sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": "Sure?"}]
        sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32)

    trajectory = trajectory_of(client, vllm, run, token_mode=True, tokenizer_path=str(vllm.model))
    assert trajectory["extra_info"]["token_mode"] is True
    assert [e.path for e in vllm.proxy.exchanges if e.status == 200] == ["/v1/completions"] * 2
    first, second = trajectory["turns"]
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(first["output_ids"])] == (
        first["prompt_ids"] + first["output_ids"]
    )
    assert len(samples_from_turns(trajectory, 1.0, 1.0)) == 1
    assert_logprobs_are_the_models(vllm, assert_sampled(engine_answers(vllm), trajectory).turns)


def completions_agent(client: openai.OpenAI, tokenizer: Any | None) -> None:
    """An ordinary legacy-completions loop (``client.completions.create``): the first answer held
    to digits by vLLM's structured outputs and cut at ``max_tokens`` (no end-of-text token), then
    the follow-up, streamed: appended to the text (the gateway in token mode holds the ids), or,
    with the agent's own ``tokenizer``, to the ids vLLM returned (chat mode: vLLM tokenises a
    string itself, so only ids are sure to extend what it sampled)."""
    prompt = "Question: What is 3 * 9?\nAnswer: "
    first = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=4,
        extra_body={"structured_outputs": {"regex": "[1-9][0-9]{15}"}, "return_token_ids": True},
    )
    more = "\nQuestion: Are you sure?\nAnswer:"
    follow_up: Any = prompt + first.choices[0].text + more
    if tokenizer is not None:
        held = first.choices[0].model_extra or {}
        follow_up = [*held["prompt_token_ids"], *held["token_ids"], *tokenizer.encode(more)]
    text = "".join(
        choice.text
        for chunk in client.completions.create(model=MODEL_NAME, prompt=follow_up, max_tokens=16, stream=True)
        for choice in chunk.choices
    )
    assert text


@pytest.mark.parametrize("token_mode", [False, True])
def test_a_completions_agent_through_the_gateway_is_trained_on_what_vllm_sampled(
    vllm: Engine, make_client: Any, token_mode: bool
) -> None:
    """vLLM's own ``/v1/completions`` with its ids asked for (token mode: the ids the gateway
    holds, the follow-up's text encoded past them): one chain, each turn what vLLM sampled."""
    client: TestClient = make_client(group_size=2)
    tokenizer = None if token_mode else _tokenizer(vllm.model)

    def run(session: dict[str, Any]) -> None:
        completions_agent(
            openai.OpenAI(
                base_url=session["base_url"], api_key=session["api_key"], http_client=client, max_retries=0
            ),
            tokenizer,
        )

    fields: dict[str, Any] = {"token_mode": True, "tokenizer_path": str(vllm.model)} if token_mode else {}
    before = len(vllm.proxy.exchanges)
    trajectory = trajectory_of(client, vllm, run, **fields)
    sent = [e for e in vllm.proxy.exchanges[before:] if e.status == 200 and e.path == "/v1/completions"]
    assert [isinstance(e.request["prompt"], list) for e in sent] == [token_mode, True]
    assert trajectory["extra_info"]["gateway"]["parents"] == [None, 0]
    first, second = trajectory["turns"]
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(first["output_ids"])] == (
        first["prompt_ids"] + first["output_ids"]
    )
    assert len(samples_from_turns(trajectory, 1.0, 1.0)) == 1
    assert_trained_on_what_vllm_sampled(vllm, trajectory)  # the first constrained, the second the model's
