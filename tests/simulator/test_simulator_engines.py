"""Each engine's shape: token ids and logprobs in chat answers, token prompts on SGLang's
/generate and vLLM's /v1/completions, streaming, and the toolkit's token mode against both."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.model import SimModel
from buffer.simulator.tokenizer import build_tokenizer
from tests.simulator.helpers import (
    CALCULATOR,
    EOS_ID,
    REPO_ROOT,
    TOKENIZER,
    boxed,
    chat,
    client_for,
    encode,
    openai_for,
    render,
    sim_app,
    token_generate,
)
from tests.support.engine_records import covered, sampled

pytestmark = pytest.mark.anyio


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


@pytest.mark.parametrize(
    ("engine", "after_the_generation_prompt"),
    [
        ("vllm", "<think>\n\n</think>\n\n<think>\nLet me"),  # through the template: its empty think block
        ("sglang", "<think>\nLet me"),  # the reply's text after the generation prompt
    ],
)
async def test_a_reply_continued_as_text_is_rendered_as_each_engine_renders_it(
    engine: str, after_the_generation_prompt: str
) -> None:
    """vLLM continues a final assistant message through the chat template (transformers'
    ``continue_final_message``), which with Qwen3's writes an empty think block before the reply so far
    and refuses a reply it cannot find again; SGLang renders the conversation before it with the
    generation prompt and appends the reply's text (``_handle_last_assistant_message``)."""
    tokenizer = build_tokenizer(thinking=True)
    tokenizer.chat_template = (
        REPO_ROOT / "tests" / "support" / "templates" / "qwen3-hybrid.jinja"
    ).read_text()
    app = create_sim_app(SimConfig(engine=engine, latency_mean_s=0.0, seed=0), model=SimModel(tokenizer))
    question = [{"role": "user", "content": "What is 3 * (4 + 5)?"}]
    head = str(tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False))
    body = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    partial = [*question, {"role": "assistant", "content": "<think>\nLet me"}]
    answer = await chat(app, messages=partial, return_prompt_token_ids=True, **body)
    [choice] = answer["choices"]
    prompt_ids = answer.get("prompt_token_ids") or choice["prompt_token_ids"]
    assert tokenizer.decode(prompt_ids) == head + after_the_generation_prompt
    broken = [*question, {"role": "assistant", "content": "a</think>b"}]  # the template rewrites it
    async with client_for(app) as client:
        refused = await client.post("/v1/chat/completions", json={"messages": broken, **body})
    if engine == "vllm":
        assert refused.status_code == 400
        assert "does not appear in the chat" in refused.json()["error"]["message"]
    else:
        assert refused.status_code == 200


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
