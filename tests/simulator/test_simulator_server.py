"""The simulated server around the model: faults and outages, models, stats and flags, its
tokenizer, and the real process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pydantic
import pytest
from openai import AsyncOpenAI

from buffer.processes import stop
from buffer.simulator import SimConfig
from buffer.simulator.cli import parse_config
from buffer.simulator.control import Control
from buffer.simulator.engines import DIALECTS
from buffer.simulator.outage import Outage
from buffer.simulator.tokenizer import build_tokenizer
from buffer.toolkit.llm import ChatClient, LLMError, RetryPolicy
from tests.simulator.helpers import (
    CALCULATOR,
    REPO_ROOT,
    THINKER,
    TOKENIZER,
    boxed,
    chat,
    client_for,
    encode,
    openai_for,
    render,
    sim_app,
)
from tests.support.factories import FakeClock

pytestmark = pytest.mark.anyio


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


async def test_an_outage_answers_every_chat_completion_with_503_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()  # the outage ends when the test says, not when a busy machine gets to it
    monkeypatch.setattr("buffer.simulator.server.Outage", lambda: Outage(clock))
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
        clock.advance(0.15)
        assert (await client.post("/v1/chat/completions", json=question)).status_code == 200
        stats = (await client.get("/stats")).json()
    assert stats["requests"] == 6
    assert stats["by_status"] == {"200": 2, "503": 4}


async def test_a_request_waiting_out_its_latency_when_an_outage_starts_fails_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asleep, latency_over = asyncio.Event(), asyncio.Event()

    async def latency(control: Control, seconds: float) -> bool:
        """The latency lasts until the test ends it, whatever a busy machine does to the clock."""
        asleep.set()
        await latency_over.wait()
        return False

    monkeypatch.setattr(Control, "sleep", latency)
    app = sim_app(latency_mean_s=0.3)
    async with client_for(app) as client:
        waiting = asyncio.create_task(
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        )
        await asyncio.wait_for(asleep.wait(), 30)
        await client.post("/outage", json={"seconds": 30})
        latency_over.set()
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


# Models, health, stats, flags


async def test_models_lists_the_configured_name_and_health_answers() -> None:
    app = sim_app(served_model_name="my-model")
    async with openai_for(app) as client:
        models = [model.id async for model in client.models.list()]
    assert models == ["my-model"]
    async with client_for(app) as client:
        assert (await client.get("/health")).status_code == 200


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


def test_engine_takes_the_names_of_the_engine_table_and_no_other() -> None:
    assert list(DIALECTS) == ["vllm", "sglang"]
    for name, dialect in DIALECTS.items():
        assert dialect.name == name
        assert parse_config(["--engine", name]).engine == name
    assert SimConfig.model_json_schema()["properties"]["engine"]["enum"] == list(DIALECTS)
    with pytest.raises(pydantic.ValidationError, match="engine"):
        parse_config(["--engine", "tgi"])


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


# The real process


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until_healthy(base_url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the simulator exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    pytest.fail(f"the simulator was not healthy within 60 s:\n{log_path.read_text()}")


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
    async with httpx.AsyncClient(base_url=simulator_url, timeout=60) as http:
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
    async with (
        httpx.AsyncClient(base_url=simulator_url, timeout=60) as http,
        AsyncOpenAI(base_url=f"{simulator_url}/v1", api_key="x", max_retries=0, timeout=120) as client,
    ):
        # Paused, the simulator holds every request it gets: all of them are in at once, however
        # long a busy machine takes to send them.
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        asking = asyncio.gather(
            *(
                client.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": f"What is {i} + {i + 1}?"}]
                )
                for i in range(count)
            )
        )
        for _ in range(600):  # up to a minute
            if (await http.get("/stats")).json()["in_flight"] == count or asking.done():
                break
            await asyncio.sleep(0.1)
        resumed_at = time.monotonic()
        assert (await http.post("/continue_generation")).status_code == 200
        replies = await asking
        elapsed_s = time.monotonic() - resumed_at
        stats = (await http.get("/stats")).json()
    assert [boxed(reply.choices[0].message.content) for reply in replies] == [
        str(2 * i + 1) for i in range(count)
    ]
    assert stats["requests"] == count
    assert stats["by_status"] == {"200": count}
    assert stats["in_flight"] == 0
    assert stats["max_in_flight"] == count, stats
    # Resumed together, they waited out their latency together: a fraction of the 200 s they take
    # one after another (the slack is a busy machine's, and openai's with 1,000 connections).
    assert elapsed_s < count * latency_s / 2, f"{count} requests took {elapsed_s:.1f} s"


@pytest.mark.e2e
async def test_the_real_process_streams_vllm_chunks_with_token_ids_and_refuses_an_unknown_model(
    thinking_vllm_url: str,
) -> None:
    question = [{"role": "user", "content": "What is 6 * 7?"}]
    body = {"model": "sim-model", "messages": question, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=thinking_vllm_url, timeout=60) as http:
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
