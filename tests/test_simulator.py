"""The simulated OpenAI-compatible LLM server: in process through ASGI, and once as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import json
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

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.arithmetic import solve
from buffer.simulator.cli import parse_config
from buffer.toolkit.llm import ChatClient, LLMError, RetryPolicy

pytestmark = pytest.mark.anyio

REPO_ROOT = Path(__file__).resolve().parent.parent
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


async def test_usage_counts_words_and_a_per_message_overhead() -> None:
    reply = await chat(sim_app(accuracy=1.0), "What is 17 + 25?")
    content = reply["choices"][0]["message"]["content"]
    assert reply["usage"] == {
        "prompt_tokens": 5 + 3,
        "completion_tokens": len(content.split()),
        "total_tokens": 8 + len(content.split()),
    }
    assert reply["object"] == "chat.completion"
    assert reply["model"] == "sim-model"
    assert reply["id"].startswith("chatcmpl-")
    assert isinstance(reply["created"], int)


# Cut replies: max_tokens, aborts, continuation


async def test_max_tokens_truncates_with_finish_reason_length() -> None:
    app = sim_app(accuracy=1.0)
    full = (await chat(app, "Compute 3 * (4 + 5).", seed=1))["choices"][0]["message"]["content"]
    for limit_field in ["max_tokens", "max_completion_tokens"]:
        reply = await chat(app, "Compute 3 * (4 + 5).", seed=1, **{limit_field: 5})
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"].split() == full.split()[:5]
        assert reply["usage"]["completion_tokens"] == 5


async def test_a_reply_within_max_tokens_is_not_cut() -> None:
    reply = await chat(sim_app(accuracy=1.0), "What is 17 + 25?", max_tokens=1000)
    assert reply["choices"][0]["finish_reason"] == "stop"


async def test_abort_rate_one_aborts_with_partial_content_and_usage() -> None:
    full = (await chat(sim_app(accuracy=1.0), "Compute 3 * (4 + 5).", seed=4))["choices"][0]["message"][
        "content"
    ]
    app = sim_app(accuracy=1.0, abort_rate=1.0)
    for _ in range(10):
        reply = await chat(app, "Compute 3 * (4 + 5).", seed=4)
        choice = reply["choices"][0]
        partial = choice["message"]["content"]
        assert choice["finish_reason"] == "abort"
        assert partial
        assert full.startswith(partial)
        assert len(partial) < len(full)
        assert reply["usage"]["completion_tokens"] == len(partial.split())
    assert (await stats_of(app))["by_finish_reason"] == {"abort": 10}


async def test_continue_final_message_returns_only_the_continuation() -> None:
    app = sim_app(accuracy=1.0)
    question = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    full = (await chat(app, messages=question))["choices"][0]["message"]["content"]
    prefix = "".join(re.findall(r"\s*\S+", full)[:6])
    messages = [*question, {"role": "assistant", "content": prefix}]
    reply = await chat(app, messages=messages, continue_final_message=True)
    continuation = reply["choices"][0]["message"]["content"]
    assert prefix + continuation == full
    assert reply["usage"]["completion_tokens"] == len(full.split()) - 6

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


async def test_stream_and_malformed_requests_answer_400_saying_why() -> None:
    async with client_for(sim_app()) as client:
        stream = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        empty = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert stream.status_code == 400
    assert stream.json()["error"]["param"] == "stream"
    assert empty.status_code == 400
    assert empty.json()["error"]["type"] == "invalid_request_error"
    assert "messages" in empty.json()["error"]["message"]


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
        assert "tool_calls" not in choice["message"]
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
        assert "".join(entry.token for entry in entries) == choice.message.content
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
        ]
    )
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


@pytest.fixture
def simulator_url(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    log_path = tmp_path / "simulator.log"
    command = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--latency-mean-s", "0.2", "--accuracy", "1", "--log-level", "warning"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(base_url, process, log_path)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
