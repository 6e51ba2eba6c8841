"""Token capture through run_rollouts, aborted trajectories, and failing fast on a refusing engine.

The policy server is mocked with respx in vLLM's and SGLang's shapes (see the README's token capture
table); trajectories are collected and checked against the buffer's own schema.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

import default_func
from buffer.toolkit.agent import Tool, run_tools
from buffer.toolkit.failfast import FailFast, MisconfiguredEngine
from buffer.toolkit.llm import ChatClient, ContinuePolicy, LLMError, RetryPolicy
from buffer.toolkit.records import turn_records
from buffer.toolkit.runner import run_rollouts
from buffer.toolkit.types import Completion, Episode, Sample, TokenCapture
from tests.support.factories import Collected
from tests.support.paths import REPO

pytestmark = pytest.mark.anyio

ENGINE = "http://engine.test"
URL = f"{ENGINE}/v1/chat/completions"
REPO = REPO


def chat_client(**kwargs: Any) -> ChatClient:
    kwargs.setdefault("retry", RetryPolicy(max_attempts=2, backoff_s=0.001, max_backoff_s=0.01))
    return ChatClient(ENGINE, transport=httpx.AsyncHTTPTransport(), **kwargs)


@pytest.fixture
async def llm() -> AsyncIterator[ChatClient]:
    async with chat_client(continuation=ContinuePolicy(max_continuations=1, delay_s=0)) as client:
        yield client


def payload(tmp_path: Path, n: int = 3, **overrides: Any) -> dict[str, Any]:
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(n))
    )
    return {
        "task_type": "math",
        "input_file": str(path),
        "remote_engine_url": ENGINE,
        "num_repeat_per_sample": 2,
        "num_process": 2,
        "sampling_params": {"max_tokens": 32},
        **overrides,
    }


def exact(sample: Sample, episode: Episode) -> float:
    return 1.0 if episode.response == f"\\boxed{{{sample.label}}}" else 0.0


def vllm(request: httpx.Request) -> httpx.Response:
    """A vLLM-shaped answer: "\\boxed{n+1}" with made-up ids; prompt ids = one per message word."""
    body = json.loads(request.content)
    words = " ".join(str(m.get("content") or "") for m in body["messages"]).split()
    prompt = [len(w) for w in words]
    last = body["messages"][-1]
    if last["role"] == "user" and "calculator" in body.get("tools", [{}])[0].get("function", {}).get(
        "name", ""
    ):
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
        }
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        output, finish = [101, 102], "tool_calls"
    else:
        number = int(body["messages"][-1]["content"].split()[2]) if last["role"] == "user" else 1
        message = {"role": "assistant", "content": f"\\boxed{{{number + 1}}}", "reasoning_content": "think"}
        output, finish = [201, 202, 203], "stop"
    logprobs = {"content": [{"token": "x", "logprob": -0.25, "top_logprobs": []} for _ in output]}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
        "token_ids": output,
    }
    return httpx.Response(
        200,
        json={"prompt_token_ids": prompt, "choices": [choice], "usage": {"completion_tokens": len(output)}},
    )


@respx.mock
async def test_each_generated_message_gets_a_turn_with_its_ids_logprobs_and_sampling(
    tmp_path: Path, llm: ChatClient
) -> None:
    route = respx.post(URL).mock(side_effect=vllm)
    sink = Collected()
    await run_rollouts(payload(tmp_path), reward=exact, sink=sink, llm=llm)
    assert json.loads(route.calls[0].request.content)["return_token_ids"] is True
    for trajectory in sink.trajectories:
        (turn,) = trajectory["turns"]
        assert turn["prompt_offset"] == 0
        assert turn["output_ids"] == [201, 202, 203]
        assert turn["output_logprobs"] == [-0.25] * 3
        assert (turn["finish_reason"], turn["message_index"], turn["weight_version"]) == ("stop", 1, None)
        assert turn["sampling"] == {"max_tokens": 32, "seed": trajectory["extra_info"]["seed"]}
        assert trajectory["messages"][1]["generated"] is True
        assert trajectory["messages"][1]["reasoning_content"] == "think"
        assert "tools" not in trajectory


@respx.mock
async def test_a_tool_loop_records_the_tools_and_later_prompts_as_offsets(
    tmp_path: Path, llm: ChatClient
) -> None:
    route = respx.post(URL).mock(side_effect=vllm)
    calculator = Tool("calculator", "Evaluate.", {"type": "object"}, lambda expression: "2")
    sink = Collected()
    rollout = functools.partial(run_tools, tools=[calculator], max_turns=3)
    await run_rollouts(payload(tmp_path, n=1), reward=lambda s, e: 1.0, rollout=rollout, sink=sink, llm=llm)
    trajectory = sink.trajectories[0]
    assert trajectory["tools"] == [calculator.schema]
    first, second = trajectory["turns"]
    assert [m["role"] for m in trajectory["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert (first["message_index"], second["message_index"]) == (1, 3)
    assert first["finish_reason"] == "tool_calls"
    # the second prompt shares its first words with the first one: only the rest is stored
    assert 0 < second["prompt_offset"] <= len(first["prompt_ids"]) + len(first["output_ids"])
    # the engine gets the conversation without the toolkit's mark, the reasoning kept
    sent = [json.loads(call.request.content)["messages"] for call in route.calls]
    follow_ups = [messages[1] for messages in sent if len(messages) > 1]
    assert follow_ups
    assert all("generated" not in message for message in follow_ups)


def test_turn_offsets_rebuild_every_full_prompt() -> None:
    def completion(prompt: list[int], output: list[int]) -> Completion:
        return Completion("", "stop", tokens=TokenCapture(prompt, output, None))

    messages = [{"role": "user"}, {"role": "assistant", "generated": True}, {"role": "user"}]
    messages += [
        {"role": "assistant", "generated": True},
        {"role": "user"},
        {"role": "assistant", "generated": True},
    ]
    prompts = [[1, 2], [1, 2, 5, 6, 7], [1, 2, 9]]  # the second extends the first; the third rewrote history
    outputs = [[5, 6], [8], [4]]
    turns = turn_records(messages, [completion(p, o) for p, o in zip(prompts, outputs, strict=True)])
    assert turns is not None
    assert [(t["prompt_offset"], t["prompt_ids"]) for t in turns] == [(0, [1, 2]), (4, [7]), (2, [9])]
    before: list[int] = []
    for turn, prompt, output in zip(turns, prompts, outputs, strict=True):
        assert before[: turn["prompt_offset"]] + turn["prompt_ids"] == prompt
        before = prompt + output
    # a completion without ids: no record at all rather than a partial one
    partial = [completion([1], [2]), Completion("", "stop")]
    assert turn_records(messages[:4], partial) is None


@respx.mock
async def test_a_trajectory_still_aborted_is_written_as_abort_counted_and_filtered(
    tmp_path: Path, llm: ChatClient
) -> None:
    aborted = {"choices": [{"message": {"role": "assistant", "content": "\\box"}, "finish_reason": "abort"}]}
    respx.post(URL).mock(return_value=httpx.Response(200, json=aborted))
    sink = Collected()
    progress = await run_rollouts(payload(tmp_path, n=1), reward=lambda s, e: 0.5, sink=sink, llm=llm)
    assert progress.aborted == 2
    assert progress.failed == 0
    for trajectory in sink.trajectories:
        assert trajectory["extra_info"]["finish_reason"] == "abort"
        assert trajectory["extra_info"]["continuations"] == 1
        assert not default_func.filter_item(trajectory, "math")


@respx.mock
async def test_a_wrong_model_name_fails_the_run_at_once_with_the_engine_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    said = "The model `gpt-4` does not exist."
    route = respx.post(URL).mock(
        return_value=httpx.Response(
            404, json={"error": {"message": said, "type": "NotFoundError", "code": 404}}
        )
    )
    sink = Collected()
    async with chat_client(model="gpt-4") as llm:
        with pytest.raises(MisconfiguredEngine, match=r"HTTP 404: The model `gpt-4` does not exist\."):
            await run_rollouts(payload(tmp_path, n=50), reward=exact, sink=sink, llm=llm)
    assert sink.trajectories == []  # no failed trajectory for a misconfiguration
    assert route.call_count <= 2  # the requests already in flight, no more
    assert said in caplog.text


@respx.mock
async def test_the_same_client_error_on_every_request_fails_the_run(tmp_path: Path) -> None:
    respx.post(URL).mock(return_value=httpx.Response(400, json={"object": "error", "message": "bad field"}))
    sink = Collected()
    async with chat_client() as llm:
        with pytest.raises(MisconfiguredEngine, match=r"HTTP 400 \(5 requests in a row\): bad field"):
            await run_rollouts(payload(tmp_path, n=50, fail_fast_after=5), reward=exact, sink=sink, llm=llm)
    assert len(sink.trajectories) <= 5


@respx.mock
async def test_a_500_the_engine_gives_every_request_the_same_way_fails_the_run_fast(tmp_path: Path) -> None:
    said = "Internal error: the sampler rejected the request"
    route = respx.post(URL).mock(
        return_value=httpx.Response(500, json={"error": {"message": said, "type": "InternalServerError"}})
    )
    sink = Collected()
    quick = RetryPolicy(max_attempts=50, backoff_s=0.001, max_backoff_s=0.01)
    async with ChatClient(ENGINE, transport=httpx.AsyncHTTPTransport(), retry=quick) as llm:
        with pytest.raises(MisconfiguredEngine, match=rf"HTTP 500 \(4 requests in a row\): {said}"):
            await run_rollouts(payload(tmp_path, n=50, fail_fast_after=4), reward=exact, sink=sink, llm=llm)
    assert route.call_count <= 3 * 5  # three attempts a trajectory, not fifty
    assert len(sink.trajectories) <= 4


@respx.mock
async def test_a_client_error_among_successes_fails_that_trajectory_only(tmp_path: Path) -> None:
    def sometimes(request: httpx.Request) -> httpx.Response:
        if "What is 1 +" in request.content.decode():
            return httpx.Response(400, json={"object": "error", "message": "prompt too long"})
        return vllm(request)

    respx.post(URL).mock(side_effect=sometimes)
    sink = Collected()
    async with chat_client() as llm:
        progress = await run_rollouts(
            payload(tmp_path, n=3, fail_fast_after=2, shuffle=False), reward=exact, sink=sink, llm=llm
        )
    assert progress.failed == 2
    assert len(sink.trajectories) == 6


def test_fail_fast_counts_the_same_refusal_in_a_row_until_the_engine_has_worked() -> None:
    guard = FailFast(after=3)
    refusal = LLMError("x", status=400, engine_message="bad")
    assert guard.failed(refusal) is None
    assert guard.failed(refusal) is None
    assert guard.failed(LLMError("outage")) is None  # no status: an outage, which resets the count
    assert guard.failed(refusal) is None
    assert guard.failed(LLMError("y", status=422, engine_message="other")) is None
    assert guard.failed(refusal) is None
    assert guard.failed(refusal) is None
    assert guard.failed(refusal) is not None  # three 400s in a row, nothing ever answered
    worked = FailFast(after=2)
    worked.succeeded()
    assert [worked.failed(refusal) for _ in range(5)] == [None] * 5
    assert worked.failed(LLMError("z", status=401, engine_message="no key")) is not None


def test_shipped_generators_import_only_the_toolkit() -> None:
    for path in (REPO / "generator").glob("*_generator.py"):
        tree = ast.parse(path.read_text())
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        modules |= {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        project = {m for m in modules if m.split(".")[0] in ("buffer", "default_func", "generator")}
        assert project <= {"buffer.toolkit"}, (path.name, project)


def test_the_calculator_tool_is_exact_and_refuses_what_is_not_arithmetic() -> None:
    from generator.calculator_generator import calculate

    assert calculate("3 * (4 + 5)") == "27"
    assert calculate("7 / 2") == "7/2"
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculate("__import__('os')")
    logging.getLogger(__name__).debug("calculator ok")
