"""The simulated policy server: in process through ASGI, and as a real process.

Token ids are checked against the simulator's own tokenizer, built here as a client would build it
(``build_tokenizer()``, or saved with ``python -m buffer.simulator.tokenizer DIR`` and loaded)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
from fastapi import FastAPI
from openai import AsyncOpenAI

from buffer.processes import stop
from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.arithmetic import solve
from buffer.simulator.cli import parse_config
from buffer.simulator.tokenizer import build_tokenizer
from buffer.toolkit.llm import ChatClient, LLMError, RetryPolicy
from tests.support.engine_records import covered, sampled
from tests.support.paths import REPO

pytestmark = pytest.mark.anyio

REPO_ROOT = REPO
BOXED = re.compile(r"\\boxed\{([^}]*)\}")
CALCULATOR: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


TOKENIZER = build_tokenizer()
EOS_ID = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


def encode(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False))


def render(messages: list[Any], tools: list[Any] | None = None, **kwargs: Any) -> list[int]:
    """The prompt ids a client computes with the same tokenizer."""
    ids = TOKENIZER.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=True, **kwargs
    )
    assert isinstance(ids, list)
    return [int(token) for token in ids]


def sim_app(**overrides: Any) -> FastAPI:
    options: dict[str, Any] = {"latency_mean_s": 0.0, "seed": 0, **overrides}
    return create_sim_app(SimConfig(**options))


@contextlib.asynccontextmanager
async def client_for(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
        yield client


def openai_for(app: FastAPI) -> AsyncOpenAI:
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
    # openai 3 annotates http_client as httpx2's client, and takes httpx's as well.
    return AsyncOpenAI(base_url="http://sim/v1", api_key="x", max_retries=0, http_client=http_client)  # type: ignore[arg-type]


async def chat(app: FastAPI, content: str | None = None, **body: Any) -> dict[str, Any]:
    """POST a chat completion (one user message, unless ``messages`` is given); the 200 body."""
    body.setdefault("messages", [{"role": "user", "content": content}])
    async with client_for(app) as client:
        response = await client.post("/v1/chat/completions", json={"model": "sim-model", **body})
    assert response.status_code == 200, response.text
    return dict(response.json())


def boxed(text: str | None) -> str | None:
    match = BOXED.search(text or "")
    return match.group(1) if match else None


# The arithmetic


def test_solve_shows_steps_innermost_first() -> None:
    solution = solve("3 * (4 + 5)")
    assert solution is not None
    assert solution.steps == ("4 + 5 = 9", "3 * 9 = 27")


@pytest.mark.parametrize(
    "expression", ["2 ** 10", "__import__('os').system('true')", "1 / 0", "2.5 + 1", "x + 1", "42", "-7"]
)
def test_solve_refuses_what_is_not_integer_arithmetic_with_an_operation(expression: str) -> None:
    assert solve(expression) is None


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is 17 + 25?", "42"),
        ("Compute 3 * (4 + 5).", "27"),
        ("Question 3: what is 100 - 58 * 2?", "-16"),
        ("What is 7 / 2?", "7/2"),
        ("What is 6 × 7?", "42"),
    ],
)
async def test_arithmetic_is_answered_right_with_accuracy_one(question: str, answer: str) -> None:
    reply = await chat(sim_app(accuracy=1.0), question)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert boxed(choice["message"]["content"]) == answer


async def test_arithmetic_is_answered_wrong_by_a_little_with_accuracy_zero() -> None:
    app = sim_app(accuracy=0.0)
    for seed in range(20):
        content = (await chat(app, "What is 17 + 25?", seed=seed))["choices"][0]["message"]["content"]
        answer = boxed(content)
        assert answer is not None
        assert answer != "42"
        assert 1 <= abs(int(answer) - 42) <= 3
        assert f"17 + 25 = {answer}" in content


async def test_the_question_is_read_from_the_last_user_message_and_text_parts() -> None:
    messages = [
        {"role": "system", "content": "You are a calculator. 1 + 1 is not the question."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "Now compute 9 * 9."}]},
    ]
    reply = await chat(sim_app(accuracy=1.0), messages=messages)
    assert boxed(reply["choices"][0]["message"]["content"]) == "81"


async def test_a_prompt_without_arithmetic_gets_a_generic_text() -> None:
    for question in ["What is the capital of France?", "What is 2 ** 100?"]:
        choice = (await chat(sim_app(accuracy=1.0), question))["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"]
        assert boxed(choice["message"]["content"]) is None


async def test_usage_counts_the_tokenizer_s_tokens_of_the_prompt_and_of_the_reply() -> None:
    reply = await chat(sim_app(accuracy=1.0), "What is 17 + 25?")
    content = reply["choices"][0]["message"]["content"]
    prompt_tokens = len(render([{"role": "user", "content": "What is 17 + 25?"}]))
    completion_tokens = len(encode(content)) + 1  # and the end-of-turn token
    assert reply["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    assert reply["object"] == "chat.completion"
    assert reply["model"] == "sim-model"
    assert reply["id"].startswith("chatcmpl-")
    assert isinstance(reply["created"], int)


# Cut replies: max_tokens, aborts, continuation


async def test_max_tokens_truncates_at_a_token_with_finish_reason_length() -> None:
    app = sim_app(accuracy=1.0)
    full = (await chat(app, "Compute 3 * (4 + 5).", seed=1))["choices"][0]["message"]["content"]
    for limit_field in ["max_tokens", "max_completion_tokens"]:
        reply = await chat(app, "Compute 3 * (4 + 5).", seed=1, return_token_ids=True, **{limit_field: 5})
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["token_ids"] == encode(full)[:5]
        assert choice["message"]["content"] == TOKENIZER.decode(encode(full)[:5])
        assert reply["usage"]["completion_tokens"] == 5


async def test_a_reply_within_max_tokens_is_not_cut() -> None:
    reply = await chat(sim_app(accuracy=1.0), "What is 17 + 25?", max_tokens=1000)
    assert reply["choices"][0]["finish_reason"] == "stop"


async def test_abort_rate_one_aborts_with_partial_content_and_usage() -> None:
    full = (await chat(sim_app(accuracy=1.0), "Compute 3 * (4 + 5).", seed=4))["choices"][0]["message"][
        "content"
    ]
    app = sim_app(accuracy=1.0, abort_rate=1.0)
    cuts = set()
    for _ in range(10):
        reply = await chat(app, "Compute 3 * (4 + 5).", seed=4, return_token_ids=True)
        choice = reply["choices"][0]
        partial, ids = choice["message"]["content"], choice["token_ids"]
        assert choice["finish_reason"] == "abort"
        assert partial
        assert ids == encode(full)[: len(ids)]  # a prefix of the reply, no end-of-turn token
        assert partial == TOKENIZER.decode(ids)
        assert len(partial) < len(full)
        assert reply["usage"]["completion_tokens"] == len(ids)
        cuts.add(len(ids))
    assert len(cuts) > 1  # at a random token
    assert (await stats_of(app))["by_finish_reason"] == {"abort": 10}


async def test_continue_final_message_returns_only_the_continuation() -> None:
    app = sim_app(accuracy=1.0)
    question = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    full = (await chat(app, messages=question))["choices"][0]["message"]["content"]
    prefix = TOKENIZER.decode(encode(full)[:6])
    messages = [*question, {"role": "assistant", "content": prefix}]
    reply = await chat(app, messages=messages, continue_final_message=True, return_token_ids=True)
    continuation = reply["choices"][0]["message"]["content"]
    assert prefix + continuation == full
    assert reply["choices"][0]["token_ids"] == [*encode(full)[6:], EOS_ID]
    assert reply["usage"]["completion_tokens"] == len(encode(full)) + 1 - 6

    # Without the flag the final assistant message is history and the reply starts afresh.
    fresh = (await chat(app, messages=messages))["choices"][0]["message"]["content"]
    assert fresh == full


async def test_an_aborted_reply_is_completed_by_continue_final_message_through_extra_body() -> None:
    """The partial-rollout path: abort around a weight update, then continue where it stopped."""
    question: list[Any] = [{"role": "user", "content": "What is 12 * (3 + 4) - 5?"}]
    full = (await chat(sim_app(accuracy=1.0), messages=question))["choices"][0]["message"]["content"]
    aborted = (await chat(sim_app(accuracy=1.0, abort_rate=1.0), messages=question))["choices"][0]
    assert aborted["finish_reason"] == "abort"
    async with openai_for(sim_app(accuracy=1.0)) as client:
        reply = await client.chat.completions.create(
            model="sim-model",
            messages=[*question, {"role": "assistant", "content": aborted["message"]["content"]}],
            extra_body={"continue_final_message": True},
        )
    assert reply.choices[0].finish_reason == "stop"
    assert aborted["message"]["content"] + reply.choices[0].message.content == full


# Faults


async def test_error_rate_one_answers_5xx_with_an_openai_error_body() -> None:
    app = sim_app(error_rate=1.0)
    async with client_for(app) as client:
        for _ in range(10):
            response = await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert response.status_code in (500, 503)
            assert response.json()["error"]["type"] == "server_error"
    async with openai_for(app) as client:
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


async def test_rate_limit_rate_one_answers_429_with_retry_after() -> None:
    async with client_for(sim_app(rate_limit_rate=1.0, retry_after_s=1.5)) as client:
        response = await client.post(
            "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["type"] == "rate_limit_error"


async def test_malformed_requests_answer_400_saying_why_in_each_engine_s_error_shape() -> None:
    for engine in ["sglang", "vllm"]:
        async with client_for(sim_app(engine=engine)) as client:
            empty = await client.post("/v1/chat/completions", json={"model": "sim-model", "messages": []})
        assert empty.status_code == 400
        body = empty.json()
        error = body if engine == "sglang" else body["error"]  # SGLang's is flat
        assert error["code"] == 400
        assert "messages" in error["message"]
        if engine == "sglang":
            assert body["object"] == "error"


async def test_messages_the_chat_template_cannot_render_answer_400() -> None:
    broken_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
    messages = [{"role": "user", "content": "What is 1 + 1?"}, broken_call]
    async with client_for(sim_app(engine="vllm")) as client:
        response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert "chat template cannot render" in response.json()["error"]["message"]


async def test_an_outage_answers_every_chat_completion_with_503_until_it_ends() -> None:
    app = sim_app(accuracy=1.0)
    question = {"model": "m", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
    async with client_for(app) as client:
        assert (await client.get("/outage")).json() == {"active": False, "mode": None, "remaining_s": 0.0}
        started = (await client.post("/outage", json={"seconds": 30, "mode": "503"})).json()
        assert (started["active"], started["mode"]) == (True, "503")
        assert 29 < started["remaining_s"] <= 30
        for _ in range(3):
            down = await client.post("/v1/chat/completions", json=question)
            assert down.status_code == 503
            assert down.json()["error"]["type"] == "server_error"
        assert (await client.get("/health")).status_code == 200  # the process is up, the model is not
        ended = (await client.post("/outage", json={"seconds": 0})).json()
        assert ended["active"] is False
        assert (await client.post("/v1/chat/completions", json=question)).status_code == 200

        await client.post("/outage", json={"seconds": 0.1})  # "503" is the default mode
        assert (await client.post("/v1/chat/completions", json=question)).status_code == 503
        await asyncio.sleep(0.15)
        assert (await client.post("/v1/chat/completions", json=question)).status_code == 200
        stats = (await client.get("/stats")).json()
    assert stats["requests"] == 6
    assert stats["by_status"] == {"200": 2, "503": 4}


async def test_a_request_waiting_out_its_latency_when_an_outage_starts_fails_too() -> None:
    app = sim_app(latency_mean_s=0.3)
    async with client_for(app) as client:
        waiting = asyncio.create_task(
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        )
        await asyncio.sleep(0.05)
        await client.post("/outage", json={"seconds": 30})
        assert (await waiting).status_code == 503


async def test_a_bad_outage_request_is_refused_and_is_no_chat_request() -> None:
    app = sim_app()
    async with client_for(app) as client:
        for body in ({"seconds": -1}, {"seconds": 5, "mode": "crash"}, {"mode": "503"}):
            response = await client.post("/outage", json=body)
            assert response.status_code == 400
            assert response.json()["error"]["type"] == "invalid_request_error"
        assert (await client.get("/outage")).json()["active"] is False
        assert (await client.get("/stats")).json()["requests"] == 0


# Tools


async def test_tool_call_round_trip_with_the_openai_client() -> None:
    question: list[Any] = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    async with openai_for(sim_app(accuracy=0.0)) as client:
        first = await client.chat.completions.create(model="sim-model", messages=question, tools=[CALCULATOR])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.tool_calls is not None
        [call] = choice.message.tool_calls
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name == "calculator"
        expression = json.loads(call.function.arguments)["expression"]
        assert expression == "3 * (4 + 5)"

        result = solve(expression)
        assert result is not None
        messages = [
            *question,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": str(result.value)},
        ]
        second = await client.chat.completions.create(
            model="sim-model", messages=messages, tools=[CALCULATOR]
        )
    # The tool's result is taken as it is, whatever --accuracy says.
    assert second.choices[0].finish_reason == "stop"
    assert boxed(second.choices[0].message.content) == "27"


async def test_any_function_with_a_single_string_parameter_is_used_as_the_tool() -> None:
    not_usable = {"type": "function", "function": {"name": "search", "parameters": {"properties": {}}}}
    evaluator = {
        "type": "function",
        "function": {"name": "eval_math", "parameters": {"properties": {"expr": {"type": "string"}}}},
    }
    reply = await chat(sim_app(), "What is 6 * 7?", tools=[not_usable, evaluator])
    [call] = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "eval_math"
    assert json.loads(call["function"]["arguments"]) == {"expr": "6 * 7"}


async def test_no_tool_call_without_a_usable_tool_or_with_tool_choice_none() -> None:
    two_params = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"properties": {"a": {"type": "string"}, "b": {"type": "string"}}},
        },
    }
    extras: list[dict[str, Any]] = [{"tools": [two_params]}, {"tools": [CALCULATOR], "tool_choice": "none"}]
    for extra in extras:
        choice = (await chat(sim_app(accuracy=1.0), "What is 6 * 7?", **extra))["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert not choice["message"]["tool_calls"]  # SGLang's null
        assert boxed(choice["message"]["content"]) == "42"


# Seeds, logprobs, n


async def test_the_same_request_seed_gives_the_same_reply() -> None:
    def request(seed: int) -> dict[str, Any]:
        return {"content": "What is 123 + 456?", "seed": seed, "logprobs": True, "top_logprobs": 2, "n": 3}

    first_app, second_app = sim_app(accuracy=0.5), sim_app(accuracy=0.5)
    await chat(second_app, "What is 1 + 1?")  # moves the server's generator: must not matter
    first = await chat(first_app, **request(7))
    second = await chat(second_app, **request(7))
    assert first["choices"] == second["choices"]

    answers = {
        boxed((await chat(first_app, **request(seed)))["choices"][0]["message"]["content"])
        for seed in range(30)
    }
    assert "579" in answers
    assert len(answers) > 1  # with accuracy 0.5, other seeds give other replies


async def test_the_server_seed_makes_a_sequence_of_replies_reproducible() -> None:
    async def replies(seed: int) -> list[tuple[str, str]]:
        app = sim_app(seed=seed, accuracy=0.5, abort_rate=0.5)
        result = []
        for _ in range(10):
            choice = (await chat(app, "What is 40 + 2?"))["choices"][0]
            result.append((choice["message"]["content"], choice["finish_reason"]))
        return result

    first = await replies(seed=3)
    assert await replies(seed=3) == first
    assert await replies(seed=4) != first


async def test_logprobs_have_one_entry_per_completion_token() -> None:
    async with openai_for(sim_app(accuracy=1.0)) as client:
        reply = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "What is 17 + 25?"}],
            logprobs=True,
            top_logprobs=3,
            n=2,
        )
    assert reply.usage is not None
    total = 0
    for choice in reply.choices:
        assert choice.logprobs is not None
        entries = choice.logprobs.content or []
        # One entry per output id: the end-of-turn token has one too.
        assert "".join(entry.token for entry in entries) == f"{choice.message.content}<|im_end|>"
        assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 3 for entry in entries)
        assert all(entry.top_logprobs[0].token == entry.token for entry in entries)
        total += len(entries)
    assert reply.usage.completion_tokens == total


# Models, health, stats, flags


async def test_models_lists_the_configured_name_and_health_answers() -> None:
    app = sim_app(served_model_name="my-model")
    async with openai_for(app) as client:
        models = [model.id async for model in client.models.list()]
    assert models == ["my-model"]
    async with client_for(app) as client:
        assert (await client.get("/health")).status_code == 200


async def stats_of(app: FastAPI) -> dict[str, Any]:
    async with client_for(app) as client:
        return dict((await client.get("/stats")).json())


async def test_stats_count_requests_outcomes_and_concurrency() -> None:
    app = sim_app(latency_mean_s=0.05, accuracy=1.0)
    await asyncio.gather(*(chat(app, f"What is {i} + 1?") for i in range(50)))
    await chat(app, "What is 1 + 1?", max_tokens=2)
    async with client_for(app) as client:
        await client.post("/v1/chat/completions", json={"messages": []})
        stats = (await client.get("/stats")).json()
        assert stats["requests"] == 52
        assert stats["by_status"] == {"200": 51, "400": 1}
        assert stats["by_finish_reason"] == {"length": 1, "stop": 50}
        assert stats["in_flight"] == 0
        assert stats["max_in_flight"] == 50
        assert stats["completion_tokens"] > 0

        reset = (await client.post("/stats/reset")).json()
    assert reset["requests"] == reset["max_in_flight"] == reset["completion_tokens"] == 0
    assert reset["by_status"] == {}


def test_flags_are_parsed_into_the_config() -> None:
    config = parse_config(
        [
            *(
                "--latency",
                "lognormal",
                "--latency-mean-s",
                "0.2",
                "--latency-jitter-s",
                "0.1",
                "--seed",
                "7",
            ),
            *("--served-model-name", "m", "--abort-rate", "0.25", "--accuracy", "0.5", "--port", "1234"),
            *("--engine", "vllm", "--chat-template", "thinking", "--tokenizer-path", "/tok"),
            *("--weight-version", "v3"),
        ]
    )
    assert (config.engine, config.chat_template, config.tokenizer_path) == ("vllm", "thinking", "/tok")
    assert config.weight_version == "v3"
    assert (config.latency, config.latency_mean_s, config.latency_jitter_s) == ("lognormal", 0.2, 0.1)
    assert (config.seed, config.served_model_name, config.abort_rate, config.accuracy) == (7, "m", 0.25, 0.5)
    assert config.port == 1234


def test_a_rate_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="error_rate"):
        parse_config(["--error-rate", "1.5"])


@pytest.mark.parametrize("distribution", ["fixed", "uniform", "exponential", "lognormal"])
def test_latency_distributions_have_the_configured_mean(distribution: str) -> None:
    config = SimConfig(latency=distribution, latency_mean_s=0.2, latency_jitter_s=0.1)
    rng = random.Random(0)
    samples = [config.sample_latency_s(rng) for _ in range(20_000)]
    assert min(samples) >= 0
    assert statistics.fmean(samples) == pytest.approx(0.2, rel=0.05)
    if distribution == "uniform":
        assert min(samples) >= 0.1
        assert max(samples) <= 0.3
    if distribution == "lognormal":
        assert statistics.stdev(samples) == pytest.approx(0.1, rel=0.1)


# Token ids and logprobs, in each engine's shape

TOOL_CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call>'
)


def plausible(logprobs: list[float]) -> bool:
    return all(isinstance(value, float | int) and math.isfinite(value) and value <= 0 for value in logprobs)


async def test_sglang_chat_returns_prompt_ids_output_ids_meta_info_and_the_weight_version() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Compute 3 * (4 + 5)."},
    ]
    reply = await chat(
        sim_app(accuracy=1.0),
        messages=messages,
        tools=[CALCULATOR],
        logprobs=True,
        return_prompt_token_ids=True,
        return_token_ids=True,
        return_meta_info=True,
    )
    [choice] = reply["choices"]
    assert choice["prompt_token_ids"] == render(messages, [CALCULATOR])
    assert "prompt_token_ids" not in reply  # SGLang puts them in the choice
    assert choice["token_ids"] == [*encode(TOOL_CALL_TEXT), EOS_ID]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("tool_calls", EOS_ID)
    [call] = choice["message"]["tool_calls"]
    assert (call["index"], call["function"]["name"]) == (0, "calculator")
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(logprobs) == len(choice["token_ids"])
    assert plausible(logprobs)
    meta = choice["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert [entry[1] for entry in meta["output_token_logprobs"]] == choice["token_ids"]
    assert [entry[0] for entry in meta["output_token_logprobs"]] == logprobs
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (
        len(choice["prompt_token_ids"]),
        len(choice["token_ids"]),
    )
    assert meta["weight_version"] == reply["metadata"]["weight_version"] == "default"


async def test_vllm_chat_returns_prompt_ids_at_the_top_and_output_ids_in_the_choice() -> None:
    app = sim_app(engine="vllm", accuracy=1.0)
    question = [{"role": "user", "content": "What is 17 + 25?"}]
    reply = await chat(app, messages=question, logprobs=True, return_token_ids=True)
    assert reply["prompt_token_ids"] == render(question)
    [choice] = reply["choices"]
    content = choice["message"]["content"]
    assert boxed(content) == "42"
    assert choice["token_ids"] == [*encode(content), EOS_ID]
    assert plausible([entry["logprob"] for entry in choice["logprobs"]["content"]])
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert choice["message"]["reasoning"] is None
    assert "metadata" not in reply
    assert "prompt_token_ids" not in choice
    plain = await chat(app, messages=question)  # not asked for: not sent
    assert "prompt_token_ids" not in plain
    assert "token_ids" not in plain["choices"][0]


async def test_the_same_seed_gives_the_same_ids_and_logprobs_and_another_seed_other_logprobs() -> None:
    def request(seed: int) -> dict[str, Any]:
        return {"content": "What is 5 * 5?", "seed": seed, "logprobs": True, "return_token_ids": True}

    def logprobs(reply: dict[str, Any]) -> list[float]:
        return [entry["logprob"] for entry in reply["choices"][0]["logprobs"]["content"]]

    first, again = (
        await chat(sim_app(accuracy=1.0), **request(1)),
        await chat(sim_app(accuracy=1.0), **request(1)),
    )
    other = await chat(sim_app(accuracy=1.0), **request(2))
    assert (
        first["choices"][0]["token_ids"]
        == again["choices"][0]["token_ids"]
        == other["choices"][0]["token_ids"]
    )
    assert logprobs(first) == logprobs(again)
    assert logprobs(first) != logprobs(other)


# Token prompts: SGLang's /generate and vLLM's /v1/completions


async def token_generate(
    app: FastAPI, engine: str, prompt: list[int], **params: Any
) -> tuple[list[int], str, str]:
    """(output ids, finish reason, text) of a token-id prompt, through the engine's own endpoint."""
    async with client_for(app) as client:
        if engine == "sglang":
            sampling = {"max_new_tokens": 200, **params}
            body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
            answer = (await client.post("/generate", json=body)).json()
            meta = answer["meta_info"]
            assert [entry[1] for entry in meta["output_token_logprobs"]] == answer["output_ids"]
            return answer["output_ids"], meta["finish_reason"]["type"], answer["text"]
        body = {
            "model": "sim-model",
            "prompt": prompt,
            "max_tokens": 200,
            "logprobs": 0,
            "return_token_ids": True,
        }
        [choice] = (await client.post("/v1/completions", json={**body, **params})).json()["choices"]
        assert choice["prompt_token_ids"] == prompt
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
        return choice["token_ids"], choice["finish_reason"], choice["text"]


async def test_generate_takes_input_ids_and_answers_text_output_ids_and_meta_info() -> None:
    app = sim_app(accuracy=1.0)
    prompt = render([{"role": "user", "content": "What is 6 * 7?"}])
    async with client_for(app) as client:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 200}, "return_logprob": True}
        answer = (await client.post("/generate", json=body)).json()
        cut = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "skip_special_tokens": False}}
        short = (await client.post("/generate", json=cut)).json()
        await client.post("/update_weight_version", json={"new_version": "7"})
        later = (await client.post("/generate", json=body)).json()
        sglang_chat = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
    assert boxed(answer["text"]) == "42"
    assert answer["output_ids"] == [*encode(answer["text"]), EOS_ID]
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), len(answer["output_ids"]))
    assert plausible([entry[0] for entry in meta["output_token_logprobs"]])
    assert meta["weight_version"] == "default"
    assert short["output_ids"] == answer["output_ids"][:4]
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert "output_token_logprobs" not in short["meta_info"]  # return_logprob not asked
    assert later["meta_info"]["weight_version"] == "7"
    assert sglang_chat.json()["metadata"] == {"weight_version": "7"}


async def test_generate_replies_the_same_to_the_same_sampling_seed_whatever_the_request_id() -> None:
    prompt = render([{"role": "user", "content": "What is 12 * 12?"}])

    def request(seed: int, rid: str, stream: bool = False) -> dict[str, Any]:
        sampling = {"max_new_tokens": 100, "sampling_seed": seed}
        return {
            "input_ids": prompt,
            "sampling_params": sampling,
            "return_logprob": True,
            "rid": rid,
            "stream": stream,
        }

    app = sim_app(accuracy=0.5)
    async with client_for(app) as client:
        answers = [(await client.post("/generate", json=request(5, rid))).json() for rid in ("a", "b")]
        other = (await client.post("/generate", json=request(6, "c"))).json()
    streamed = (await sse_chunks(app, "/generate", request(5, "d", stream=True)))[-1]
    first, second = answers
    assert first["output_ids"] == second["output_ids"] == streamed["output_ids"]
    logprobs = first["meta_info"]["output_token_logprobs"]
    assert (
        logprobs
        == second["meta_info"]["output_token_logprobs"]
        == streamed["meta_info"]["output_token_logprobs"]
    )
    assert other["meta_info"]["output_token_logprobs"] != logprobs


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_token_prompt_s_conversation_and_tools_are_read_from_its_text(engine: str) -> None:
    app = sim_app(engine=engine, accuracy=0.0)
    question = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    ids, finish_reason, text = await token_generate(app, engine, render(question, [CALCULATOR]))
    assert ids == [*encode(TOOL_CALL_TEXT), EOS_ID]
    assert (finish_reason, text) == ("stop", TOOL_CALL_TEXT)  # /generate parses no tool call
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    history = [*question, {"role": "assistant", "content": None, "tool_calls": [call]}]
    result = [*history, {"role": "tool", "tool_call_id": "call_1", "content": "27"}]
    _, _, text = await token_generate(app, engine, render(result, [CALCULATOR]))
    assert boxed(text) == "27"  # the tool's result, whatever --accuracy says


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_an_aborted_reply_continued_from_its_token_ids_ends_as_the_uninterrupted_one(
    engine: str,
) -> None:
    prompt = render([{"role": "user", "content": "What is 12 * (3 + 4) - 5?"}])
    whole, _, _ = await token_generate(sim_app(engine=engine, accuracy=1.0), engine, prompt)
    aborted_app = sim_app(engine=engine, accuracy=1.0, abort_rate=1.0)
    for _ in range(5):
        partial, finish_reason, _ = await token_generate(aborted_app, engine, prompt)
        assert finish_reason == "abort"
        assert 0 < len(partial) < len(whole) - 1
        rest, finish_reason, _ = await token_generate(sim_app(engine=engine), engine, prompt + partial)
        assert finish_reason == "stop"
        assert partial + rest == whole


async def test_a_continued_wrong_answer_stays_the_answer_its_steps_began() -> None:
    prompt = render([{"role": "user", "content": "What is 12 * (3 + 4) - 5?"}])
    for seed in range(8):
        aborted_app = sim_app(accuracy=0.0, abort_rate=1.0, seed=seed)
        partial, _, _ = await token_generate(aborted_app, "sglang", prompt)
        rest, _, _ = await token_generate(sim_app(accuracy=0.0, seed=100 + seed), "sglang", prompt + partial)
        text = TOKENIZER.decode(partial + rest, skip_special_tokens=True)
        last_step = text.split("\n")[-2]  # "84 - 5 = <answer>"
        assert last_step.startswith("84 - 5 = ")
        assert boxed(text) == last_step.rpartition(" = ")[2]
        assert rest[-1] == EOS_ID


async def test_a_tool_call_aborted_in_a_chat_completion_is_read_whole_once_continued() -> None:
    question: list[Any] = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    aborted_app = sim_app(accuracy=1.0, abort_rate=1.0)
    [aborted] = (await chat(aborted_app, messages=question, tools=[CALCULATOR], return_token_ids=True))[
        "choices"
    ]
    assert aborted["finish_reason"] == "abort"
    assert TOOL_CALL_TEXT.startswith(aborted["message"]["content"])  # unparsed, as vLLM leaves it
    messages = [*question, {"role": "assistant", "content": aborted["message"]["content"]}]
    [choice] = (
        await chat(
            sim_app(accuracy=1.0),
            messages=messages,
            tools=[CALCULATOR],
            continue_final_message=True,
            return_token_ids=True,
        )
    )["choices"]
    assert aborted["token_ids"] + choice["token_ids"] == [*encode(TOOL_CALL_TEXT), EOS_ID]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"expression": "3 * (4 + 5)"}


async def test_vllm_completions_refuse_an_unknown_model_and_sglang_serves_any_name() -> None:
    question: list[Any] = [{"role": "user", "content": "What is 1 + 1?"}]
    app = sim_app(engine="vllm")
    async with client_for(app) as client:
        wrong = await client.post("/v1/chat/completions", json={"model": "nope", "messages": question})
        completion = await client.post("/v1/completions", json={"model": "nope", "prompt": render(question)})
        unnamed = await client.post("/v1/chat/completions", json={"messages": question})
        stats = (await client.get("/stats")).json()
    expected = {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert (wrong.status_code, wrong.json()) == (404, {"error": expected})
    assert (completion.status_code, completion.json()) == (404, {"error": expected})
    assert unnamed.status_code == 200
    assert stats["by_status"] == {"200": 1, "404": 2}
    async with openai_for(app) as client:
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(model="nope", messages=question)
    assert (await chat(sim_app(engine="sglang"), "What is 1 + 1?", model="anything"))["model"] == "sim-model"


async def test_vllm_refuses_continue_final_message_with_add_generation_prompt() -> None:
    messages = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "Let"}]
    async with client_for(sim_app(engine="vllm")) as client:
        both = await client.post(
            "/v1/chat/completions", json={"messages": messages, "continue_final_message": True}
        )
        right = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
        )
    assert both.status_code == 400
    assert "add_generation_prompt" in both.json()["error"]["message"]
    assert right.status_code == 200


# Stop strings, reasoning


async def test_a_stop_string_ends_the_reply_with_the_token_that_completed_it() -> None:
    first_line = "Let me work this out step by step."
    for engine, field in [("sglang", "matched_stop"), ("vllm", "stop_reason")]:
        reply = await chat(
            sim_app(engine=engine, accuracy=1.0), "What is 6 * 7?", stop=["\n"], return_token_ids=True
        )
        [choice] = reply["choices"]
        assert (choice["message"]["content"], choice["finish_reason"], choice[field]) == (
            first_line,
            "stop",
            "\n",
        )
        assert TOKENIZER.decode(choice["token_ids"]) == first_line + "\n"
    prompt = render([{"role": "user", "content": "What is 6 * 7?"}])
    _, finish_reason, text = await token_generate(
        sim_app(accuracy=1.0), "sglang", prompt, stop=["\n"], no_stop_trim=True
    )
    assert (finish_reason, text) == ("stop", first_line + "\n")
    _, _, trimmed = await token_generate(sim_app(engine="vllm", accuracy=1.0), "vllm", prompt, stop=["\n"])
    assert trimmed == first_line


THINKER = build_tokenizer(thinking=True)
THINK_ID = THINKER.convert_tokens_to_ids("<think>")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_thinking_template_puts_the_reasoning_before_the_answer(engine: str) -> None:
    app = sim_app(engine=engine, chat_template="thinking", accuracy=1.0)
    [choice] = (await chat(app, "What is 6 * 7?", return_token_ids=True))["choices"]
    message = choice["message"]
    assert "6 * 7 = 42" in message["reasoning_content"]
    assert boxed(message["content"]) == "42"
    assert "<think>" not in message["content"]
    if engine == "vllm":
        assert message["reasoning"] == message["reasoning_content"]
    assert choice["token_ids"][0] == THINK_ID
    raw = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    assert THINKER.decode(choice["token_ids"], skip_special_tokens=True) == raw

    off = await chat(
        app, "What is 6 * 7?", return_token_ids=True, chat_template_kwargs={"enable_thinking": False}
    )
    [choice] = off["choices"]
    assert choice["message"]["reasoning_content"] is None
    assert boxed(choice["message"]["content"]) == "42"
    assert THINK_ID not in choice["token_ids"]


async def test_generate_reasons_after_a_thinking_prompt_and_not_after_an_empty_think_block() -> None:
    app = sim_app(chat_template="thinking", accuracy=1.0)
    question = [{"role": "user", "content": "What is 6 * 7?"}]
    for enable_thinking, starts_thinking in [(True, True), (False, False)]:
        prompt = THINKER.apply_chat_template(
            question,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        assert isinstance(prompt, list)
        ids, _, text = await token_generate(app, "sglang", prompt)
        assert (ids[0] == THINK_ID) is starts_thinking
        assert text.startswith("<think>\n") is starts_thinking
        assert boxed(text) == "42"


# Streaming


async def sse_chunks(app: FastAPI, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client_for(app) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [event for event in response.text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(event[len("data: ") :]) for event in events[:-1]]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("tools", [False, True])
async def test_a_streamed_chat_completion_joins_to_the_non_streamed_one(engine: str, tools: bool) -> None:
    app = sim_app(engine=engine, chat_template="thinking", accuracy=1.0)
    question = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    body: dict[str, Any] = {"model": "sim-model", "messages": question, "logprobs": True}
    if tools:
        body["tools"] = [CALCULATOR]
    ids_field = {"return_token_ids": True}
    whole = await chat(app, **body, **ids_field)
    [expected] = whole["choices"]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = await sse_chunks(
        app, "/v1/chat/completions", {**stream, **(ids_field if engine == "vllm" else {})}
    )
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    deltas = [choice["delta"] for choice in choices]
    message = expected["message"]
    assert "".join(delta.get("reasoning_content") or "" for delta in deltas) == message["reasoning_content"]
    assert "".join(delta.get("content") or "" for delta in deltas) == (message["content"] or "")
    calls = [call for delta in deltas for call in delta.get("tool_calls") or []]
    assert [call["function"] for call in calls] == [
        call["function"] for call in message.get("tool_calls") or []
    ]
    assert [choice["finish_reason"] for choice in choices if choice["finish_reason"]] == [
        expected["finish_reason"]
    ]
    entries = [entry for choice in choices if choice["logprobs"] for entry in choice["logprobs"]["content"]]
    assert len(entries) == len(expected["token_ids"])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    if engine == "vllm":
        assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        assert [token for choice in choices for token in choice.get("token_ids") or []] == expected[
            "token_ids"
        ]


async def test_sglang_refuses_token_ids_with_stream() -> None:
    async with client_for(sim_app()) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "return_token_ids": True},
        )
    assert response.status_code == 400
    assert "stream" in response.json()["message"]


async def test_streamed_completions_and_generate_send_their_token_ids() -> None:
    prompt = render([{"role": "user", "content": "What is 6 * 7?"}])
    body = {
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": 100,
        "stream": True,
        "return_token_ids": True,
    }
    chunks = await sse_chunks(sim_app(engine="vllm", accuracy=1.0), "/v1/completions", body)
    choices = [chunk["choices"][0] for chunk in chunks]
    ids = [token for choice in choices for token in choice["token_ids"]]
    assert choices[0]["prompt_token_ids"] == prompt
    assert "".join(choice["text"] for choice in choices) == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert ids[-1] == EOS_ID
    assert [choice["finish_reason"] for choice in choices][-2:] == [None, "stop"]

    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 100},
        "stream": True,
        "return_logprob": True,
    }
    chunks = await sse_chunks(sim_app(accuracy=1.0), "/generate", body)
    assert len(chunks) == len(ids)
    assert [chunk["meta_info"]["finish_reason"] for chunk in chunks[:-1]] == [None] * (len(ids) - 1)
    last = chunks[-1]
    assert last["output_ids"] == ids
    assert boxed(last["text"]) == "42"
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert len(last["meta_info"]["output_token_logprobs"]) == len(ids)


# The tokenizer


def test_the_tokenizer_saved_by_its_command_is_the_one_the_simulator_builds(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    directory = tmp_path / "tokenizer"
    subprocess.run(
        [sys.executable, "-m", "buffer.simulator.tokenizer", str(directory)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    loaded = AutoTokenizer.from_pretrained(str(directory))
    assert loaded.get_vocab() == TOKENIZER.get_vocab()  # trained the same in another process
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1 + 2"}'},
    }
    messages = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "3"},
    ]
    ids = loaded.apply_chat_template(
        messages, tools=[CALCULATOR], tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert ids == render(messages, [CALCULATOR])
    text = loaded.decode(ids)
    assert '"arguments": {"expression": "1 + 2"}' in text  # the arguments as an object, as generated
    assert "<tool_response>\n3\n</tool_response>" in text


def test_the_thinking_template_keeps_reasoning_after_the_last_user_message_only() -> None:
    """Qwen3's rule: a template that rewrites history, so later prompts do not extend earlier ones."""
    messages = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "one and one"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    ]
    text = THINKER.apply_chat_template(messages, tokenize=False)
    assert "<think>\ntwo and two\n</think>\n\n4<|im_end|>" in text
    assert "one and one" not in text
    off = THINKER.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert str(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<think>" not in str(TOKENIZER.apply_chat_template(messages, tokenize=False))  # ChatML drops it


async def test_a_stop_token_id_ends_the_reply_after_that_token() -> None:
    full = encode("Let me work this out step by step.\n6 * 7 = 42\nSo the answer is \\boxed{42}.")
    stop_id = full[5]
    [choice] = (
        await chat(sim_app(accuracy=1.0), "What is 6 * 7?", stop_token_ids=[stop_id], return_token_ids=True)
    )["choices"]
    assert choice["token_ids"] == full[: full.index(stop_id) + 1]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop_id)


async def test_the_simulator_serves_the_tokenizer_of_tokenizer_path(tmp_path: Path) -> None:
    THINKER.save_pretrained(str(tmp_path))
    app = sim_app(tokenizer_path=str(tmp_path), accuracy=1.0)
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    [choice] = (await chat(app, messages=question, return_prompt_token_ids=True))["choices"]
    assert choice["prompt_token_ids"] == THINKER.apply_chat_template(
        question, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert "2 + 2 = 4" in choice["message"]["reasoning_content"]  # its template thinks


def test_without_the_sim_extra_the_simulator_says_which_extra_it_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from buffer.simulator.cli import main
    from buffer.simulator.tokenizer import MissingExtraError

    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it fails
    with pytest.raises(MissingExtraError, match=r"the 'sim' extra"):
        build_tokenizer()
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[sim\]'"):
        main(["--port", "30001", "--log-level", "critical"])


# The generator toolkit in token mode, against the simulator


class Recording(httpx.AsyncBaseTransport):
    """The simulator in process, keeping each token endpoint's request and answer."""

    def __init__(self, app: FastAPI) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        if request.url.path in ("/generate", "/v1/completions") and response.status_code == 200:
            self.exchanges.append((json.loads(request.content), json.loads(body)))
        return httpx.Response(response.status_code, headers=response.headers, content=body)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_calculator_in_token_mode_records_exactly_what_the_simulator_received_and_sampled(
    engine: str, tmp_path: Path
) -> None:
    from buffer.toolkit import RolloutSettings, Tool, calculate, policy_client, run_rollouts, run_tools

    tokenizer_dir = tmp_path / "tokenizer"
    TOKENIZER.save_pretrained(str(tokenizer_dir))
    questions = ["What is 12 * (3 + 4) - 5?", "Compute 3 * (4 + 5).", "What is 100 - 58 * 2?", "Say hello."]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "label": "0"}) + "\n" for q in questions))
    tool = Tool(
        "calculator", "Evaluate an arithmetic expression.", CALCULATOR["function"]["parameters"], calculate
    )
    transport = Recording(sim_app(engine=engine, accuracy=0.5, abort_rate=0.3))
    payload = {
        "task_type": "calculator",
        "input_file": str(data),
        "remote_engine_url": "http://sim",
        "num_repeat_per_sample": 3,
        "num_process": 4,
        "sampling_params": {"max_tokens": 200},
        "token_mode": True,
        "tokenizer_path": str(tokenizer_dir),
        "engine": engine,
        "model": "sim-model",
        "abort_retry_delay_s": 0,
        "max_continuations": 50,
    }
    written: list[dict[str, Any]] = []

    class Sink:
        async def write(self, trajectory: dict[str, Any]) -> None:
            written.append(trajectory)

        async def aclose(self) -> None:
            return None

    async def rollout(llm: Any, sample: Any, **sampling: Any) -> Any:
        return await run_tools(llm, sample, [tool], max_turns=4, **sampling)

    async with policy_client(RolloutSettings.model_validate(payload), transport=transport) as llm:
        await run_rollouts(payload, reward=lambda sample, episode: 1.0, rollout=rollout, sink=Sink(), llm=llm)
    answers: dict[Any, list[tuple[list[int], list[float]]]] = {}
    for request, answer in transport.exchanges:
        key, ids, logprobs = sampled(engine, request, answer)
        answers.setdefault(key, []).append((ids, logprobs))
    assert len(written) == 12
    turns = [turn for trajectory in written for turn in trajectory["turns"]]
    assert len(turns) > 12  # the calculator's questions took two turns
    assert any(turn["finish_reason"] == "tool_calls" for turn in turns)
    assert all("error" not in trajectory["extra_info"] for trajectory in written)
    assert sum(len(answers[key]) for key in answers) > len(turns)  # and some replies were continued
    for trajectory in written:
        held: list[int] = []
        for turn in trajectory["turns"]:
            prompt = held[: turn["prompt_offset"]] + turn["prompt_ids"]
            seed = turn["sampling"]["seed"]
            assert covered(answers, prompt, seed, turn["output_ids"], turn["output_logprobs"], 0), turn
            held = prompt + turn["output_ids"]


# The real process


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until_healthy(base_url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the simulator exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    pytest.fail(f"the simulator was not healthy within 30 s:\n{log_path.read_text()}")


@contextlib.contextmanager
def running_simulator(tmp_path: Path, *flags: str) -> Iterator[str]:
    """A simulator process on a free port, with ``flags``; its base URL once healthy."""
    port = _free_port()
    log_path = tmp_path / "simulator.log"
    command = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(port), *flags]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(base_url, process, log_path)
        yield base_url
    finally:
        stop(process)


@pytest.fixture
def simulator_url(tmp_path: Path) -> Iterator[str]:
    flags = ("--latency-mean-s", "0.2", "--accuracy", "1", "--log-level", "warning")
    with running_simulator(tmp_path, *flags) as base_url:
        yield base_url


@pytest.fixture
def thinking_vllm_url(tmp_path: Path) -> Iterator[str]:
    flags = ("--engine", "vllm", "--chat-template", "thinking", "--accuracy", "1", "--log-level", "warning")
    with running_simulator(tmp_path, *flags) as base_url:
        yield base_url


@pytest.mark.e2e
async def test_an_outage_in_reset_mode_drops_connections_and_the_chat_client_rides_it_out(
    simulator_url: str,
) -> None:
    """Through the real server and the client's real (aiohttp) transport."""
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    async with httpx.AsyncClient(base_url=simulator_url) as http:
        await http.post("/outage", json={"seconds": 30, "mode": "reset"})
        async with ChatClient(simulator_url, retry=RetryPolicy(max_retry_s=0)) as impatient:
            with pytest.raises(LLMError, match=r"failed once .*ReadError"):
                await impatient.complete(question)
        assert (await http.get("/stats")).json()["dropped"] == 1

        await http.post("/outage", json={"seconds": 1.0, "mode": "reset"})
        async with ChatClient(simulator_url) as patient:  # the default policy
            completion = await patient.complete(question)
        stats = (await http.get("/stats")).json()
    assert boxed(completion.text) == "5"
    assert completion.attempts > 1
    assert patient.stats.failures == completion.attempts - 1
    assert set(patient.stats.failures_by_kind) == {"ReadError"}
    assert stats["dropped"] == 1 + patient.stats.failures
    assert stats["by_status"] == {"200": 1}


@pytest.mark.e2e
async def test_the_real_process_serves_a_thousand_concurrent_requests(simulator_url: str) -> None:
    count, latency_s = 1000, 0.2
    async with AsyncOpenAI(base_url=f"{simulator_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        started = time.monotonic()
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": f"What is {i} + {i + 1}?"}]
                )
                for i in range(count)
            )
        )
        elapsed_s = time.monotonic() - started
    assert [boxed(reply.choices[0].message.content) for reply in replies] == [
        str(2 * i + 1) for i in range(count)
    ]
    async with httpx.AsyncClient(base_url=simulator_url) as http:
        stats = (await http.get("/stats")).json()
    assert stats["requests"] == count
    assert stats["by_status"] == {"200": count}
    assert stats["in_flight"] == 0
    # Most of the requests were waiting out their latency at the same time...
    assert stats["max_in_flight"] >= count // 2, stats
    # ...so together they took a fraction of the 200 s they take one after another. Most of
    # what they do take is the client's: openai's connection pool is slow with 1,000 connections.
    assert elapsed_s < count * latency_s / 4, f"{count} requests took {elapsed_s:.1f} s"


@pytest.mark.e2e
async def test_the_real_process_streams_vllm_chunks_with_token_ids_and_refuses_an_unknown_model(
    thinking_vllm_url: str,
) -> None:
    question = [{"role": "user", "content": "What is 6 * 7?"}]
    body = {"model": "sim-model", "messages": question, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=thinking_vllm_url) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        unknown = await http.post("/v1/chat/completions", json={**body, "model": "other"})
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[len("data: ") :]) for event in events[:-1]]
    thinker = build_tokenizer(thinking=True)
    prompt = thinker.apply_chat_template(
        question, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert chunks[0]["prompt_token_ids"] == prompt
    ids = [token for chunk in chunks for token in chunk["choices"][0].get("token_ids") or []]
    reasoning = "".join(chunk["choices"][0]["delta"].get("reasoning") or "" for chunk in chunks)
    content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert thinker.decode(ids, skip_special_tokens=True) == f"<think>\n{reasoning}\n</think>\n\n{content}"
    assert boxed(content) == "42"
    assert unknown.status_code == 404
