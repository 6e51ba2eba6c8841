"""Token in, token out: prompts rendered once and extended, engines' token endpoints mocked with respx.

The tokenizers are the small ones of ``tests/support/chat_templates.py`` (a BPE trained in the test, real
chat templates), so the ids are real ids of a real template.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from buffer.service.models import TRAJECTORY
from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.tokenizer import build_tokenizer as build_sim_tokenizer
from buffer.toolkit.agent import Tool, run_tools, single_turn
from buffer.toolkit.engines import DIALECTS, AnswerShapeError, read_generate
from buffer.toolkit.llm import ContinuePolicy, RetryPolicy
from buffer.toolkit.runner import RolloutSettings, policy_client, run_rollouts
from buffer.toolkit.tito import (
    TemplateError,
    TokenClient,
    TokenizerMissing,
    TokenRenderer,
    hermes_tool_calls,
    load_tokenizer,
    split_reasoning,
)
from buffer.toolkit.types import Sample
from tests.support.chat_templates import (
    LLAMA31_TEMPLATE,
    LLAMA_SPECIAL,
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    QWEN_PLAIN,
    QWEN_SPECIAL,
    SYSTEM,
    TOOLS,
    make_tokenizer,
    train_bpe,
)

pytestmark = pytest.mark.anyio

ENGINE = "http://engine.test"
GENERATE = f"{ENGINE}/generate"
COMPLETIONS = f"{ENGINE}/v1/completions"
PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


def qwen25() -> Any:
    return make_tokenizer(train_bpe(), QWEN25_TEMPLATE, QWEN_SPECIAL, plain=QWEN_PLAIN, eos="<|im_end|>")


def qwen3() -> Any:
    return make_tokenizer(train_bpe(), QWEN3_TEMPLATE, QWEN_SPECIAL, plain=QWEN_PLAIN, eos="<|im_end|>")


def llama31() -> Any:
    return make_tokenizer(
        train_bpe(), LLAMA31_TEMPLATE, LLAMA_SPECIAL, eos="<|eot_id|>", bos="<|begin_of_text|>"
    )


def add(a: int, b: int) -> int:
    return a + b


ADD = Tool("add", "Add two integers.", TOOLS[0]["function"]["parameters"], add)


class Engine:
    """A token endpoint that answers scripted texts, recording what it received.

    Each script entry is ``(text, finish)``; the answer's ids are the text's ids and their
    logprobs ``-(position + 1) / 10``."""

    def __init__(self, tokenizer: Any, script: list[tuple[str, str]], *, shape: str = "sglang") -> None:
        self.tokenizer = tokenizer
        self.script = list(script)
        self.shape = shape
        self.requests: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        text, finish = self.script.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        logprobs = [-(n + 1) / 10 for n in range(len(ids))]
        if self.shape == "sglang":
            reason: dict[str, Any] = {"type": finish}
            if finish == "abort":
                reason.update(message="weights update", status_code=None, err_type=None)
            meta = {
                "id": "r",
                "finish_reason": reason,
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids),
                "weight_version": "3",
                "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids, strict=True)],
            }
            return httpx.Response(200, json={"text": text, "output_ids": ids, "meta_info": meta})
        choice = {
            "index": 0,
            "text": text,
            "logprobs": {"text_offset": [], "token_logprobs": logprobs, "tokens": [], "top_logprobs": []},
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": body["prompt"],
            "token_ids": ids,
        }
        return httpx.Response(200, json={"id": "cmpl", "object": "text_completion", "choices": [choice]})


def token_client(tokenizer: Any, engine: str = "sglang", **kwargs: Any) -> TokenClient:
    return TokenClient(
        ENGINE,
        TokenRenderer(tokenizer),
        engine=engine,  # type: ignore[arg-type]
        model="policy",
        retry=RetryPolicy(max_attempts=2, backoff_s=0.001, max_backoff_s=0.01),
        continuation=kwargs.pop("continuation", ContinuePolicy(delay_s=0.001)),
        transport=httpx.AsyncHTTPTransport(),
        **kwargs,
    )


def sample() -> Sample:
    return Sample(instance_id=0, row={}, messages=list(PROMPT), epoch=0, repeat=0, seed=11)


@respx.mock
@pytest.mark.parametrize("shape", ["sglang", "vllm"])
async def test_a_tool_loop_extends_the_prompt_with_the_sampled_ids_and_the_observation_only(
    shape: str,
) -> None:
    tokenizer = qwen25()
    engine = Engine(tokenizer, [(CALL, "stop"), ("The answer is 5.<|im_end|>", "stop")], shape=shape)
    respx.post(GENERATE if shape == "sglang" else COMPLETIONS).mock(side_effect=engine)
    async with token_client(tokenizer, shape) as llm:
        episode = await run_tools(llm, sample(), [ADD], max_tokens=64, temperature=0.5)
    first, second = episode.completions
    assert first.tokens is not None
    assert second.tokens is not None
    # the second prompt is the first prompt, the ids the engine sampled, and the observation after them
    sent_key = "input_ids" if shape == "sglang" else "prompt"
    assert engine.requests[0][sent_key] == first.tokens.prompt_ids
    assert engine.requests[1][sent_key] == second.tokens.prompt_ids
    before = first.tokens.prompt_ids + first.tokens.output_ids
    assert second.tokens.prompt_ids[: len(before)] == before
    observation = tokenizer.decode(second.tokens.prompt_ids[len(before) :])
    assert (
        observation
        == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # with this template the ids are exactly those of rendering the whole conversation once
    renderer = TokenRenderer(tokenizer)  # (it writes tool-call arguments as objects, as the model did)
    whole = renderer.encode(renderer.render(episode.messages[:-1], [ADD.schema], prompt=True))
    assert second.tokens.prompt_ids == whole
    # the tool call was parsed from the text, the logprobs line up with the ids
    assert first.finish_reason == "tool_calls"
    assert first.tool_calls is not None
    assert first.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert episode.messages[-1] == {"role": "assistant", "content": "The answer is 5.", "generated": True}
    assert second.tokens.output_logprobs == [-(n + 1) / 10 for n in range(len(second.tokens.output_ids))]
    assert second.tokens.weight_version == ("3" if shape == "sglang" else None)


@respx.mock
async def test_generate_requests_carry_sglang_names_and_the_remaining_budget() -> None:
    tokenizer = qwen25()
    engine = Engine(tokenizer, [("Let me", "abort"), (" see: 5.<|im_end|>", "stop")])
    respx.post(GENERATE).mock(side_effect=engine)
    async with token_client(tokenizer, continuation=ContinuePolicy(delay_s=5.0)) as llm:
        completion = await llm.complete(PROMPT, seed=4, max_tokens=40, temperature=0.7, top_p=0.9)
    first, second = engine.requests
    assert first["sampling_params"] == {
        "max_new_tokens": 40,
        "temperature": 0.7,
        "top_p": 0.9,
        "sampling_seed": 4,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    assert (first["return_logprob"], first["stream"]) == (True, False)
    assert completion.tokens is not None
    done = len(tokenizer.encode("Let me", add_special_tokens=False))
    # the abort is continued from its ids at once (no 5 s pause: it brought tokens), with what is left
    assert second["input_ids"] == first["input_ids"] + completion.tokens.output_ids[:done]
    assert second["sampling_params"]["max_new_tokens"] == 40 - done
    # one turn: the ids of both parts, as sampled (never re-tokenised as one text), logprobs concatenated
    parts = [tokenizer.encode(t, add_special_tokens=False) for t in ("Let me", " see: 5.<|im_end|>")]
    assert completion.tokens.output_ids == parts[0] + parts[1]
    assert completion.tokens.output_logprobs == [-(n + 1) / 10 for part in parts for n in range(len(part))]
    assert completion.tokens.output_logprobs is not None
    assert len(completion.tokens.output_logprobs) == len(completion.tokens.output_ids)
    assert (completion.finish_reason, completion.continuations, completion.text) == (
        "stop",
        1,
        "Let me see: 5.",
    )


@respx.mock
async def test_an_answer_still_aborted_after_its_continuations_says_abort() -> None:
    tokenizer = qwen25()
    respx.post(GENERATE).mock(side_effect=Engine(tokenizer, [("a", "abort")] * 3))
    async with token_client(tokenizer, continuation=ContinuePolicy(max_continuations=2, delay_s=0)) as llm:
        completion = await llm.complete(PROMPT, max_tokens=40)
    assert (completion.finish_reason, completion.continuations) == ("abort", 2)


@respx.mock
async def test_completions_requests_send_the_prompt_as_ids() -> None:
    tokenizer = qwen25()
    engine = Engine(tokenizer, [("5<|im_end|>", "stop")], shape="vllm")
    respx.post(COMPLETIONS).mock(side_effect=engine)
    async with token_client(tokenizer, "vllm") as llm:
        await llm.complete(PROMPT, seed=2, max_tokens=8)
    body = engine.requests[0]
    rendered = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert body["prompt"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert (body["model"], body["max_tokens"], body["seed"], body["logprobs"]) == ("policy", 8, 2, 0)
    assert body["return_token_ids"] is True


def test_observations_follow_the_template_end_of_turn_whatever_ended_the_reply() -> None:
    renderer = TokenRenderer(qwen25())
    tool = [{"role": "tool", "tool_call_id": "c", "content": "5"}]
    assistant = {"role": "assistant", "content": "ok"}
    by_eos = renderer.encode("ok<|im_end|>")
    by_stop_string = renderer.encode("ok</tool_call>")
    assert renderer.tokenizer.decode(renderer.observation(assistant, tool, None, by_eos)).startswith(
        "\n<|im_start|>"
    )
    # a reply ended by a stop string did not sample the end of turn: the observation holds it
    assert renderer.tokenizer.decode(renderer.observation(assistant, tool, None, by_stop_string)).startswith(
        "<|im_end|>\n<|im_start|>user"
    )


def test_llama_observations_and_qwen3_reasoning() -> None:
    llama = TokenRenderer(llama31())
    reply = llama.encode("Hi.<|eot_id|>")
    observation = llama.observation(
        {"role": "assistant", "content": "Hi."}, [{"role": "user", "content": "Again?"}], None, reply
    )
    assert llama.tokenizer.decode(observation) == (
        "<|start_header_id|>user<|end_header_id|>\n\nAgain?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    qwen = TokenRenderer(qwen3())
    assert split_reasoning("<think>\nadd them\n</think>\n\n5") == ("add them", "5")
    assistant = {"role": "assistant", "content": "5", "reasoning_content": "add them"}
    observation = qwen.observation(
        assistant, [{"role": "user", "content": "And 3 + 4?"}], None, qwen.encode("5<|im_end|>")
    )
    assert (
        qwen.tokenizer.decode(observation)
        == "\n<|im_start|>user\nAnd 3 + 4?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )  # the reasoning dropped from the history in a re-render is no concern: those ids are never re-made


def test_a_template_whose_turns_cannot_be_told_apart_is_refused() -> None:
    tokenizer = qwen25()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}{{ messages | length }}:{{ m.content }};{% endfor %}"
    )
    renderer = TokenRenderer(tokenizer)
    with pytest.raises(TemplateError, match="ends an assistant turn"):
        renderer.observation(
            {"role": "assistant", "content": "a"},
            [{"role": "user", "content": "b"}],
            None,
            renderer.encode("a"),
        )


def test_hermes_tool_calls_keep_text_that_is_not_a_call() -> None:
    content, calls = hermes_tool_calls(
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert content == "Sure."
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1}'}]
    assert hermes_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_without_transformers_token_mode_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(TokenizerMissing, match=r"pip install 'rollout-buffer\[train\]'"):
        load_tokenizer("/nowhere")


@respx.mock
async def test_run_rollouts_in_token_mode_writes_turns_with_offsets_and_the_tools(tmp_path: Path) -> None:
    tokenizer = qwen25()
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    engine = Engine(tokenizer, [(CALL, "stop"), ("The answer is 5.<|im_end|>", "stop")])
    respx.post(GENERATE).mock(side_effect=engine)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": PROMPT, "label": "5"}) + "\n")
    written: list[dict[str, Any]] = []

    class Sink:
        async def write(self, trajectory: dict[str, Any]) -> None:
            TRAJECTORY.validate_python(trajectory)
            written.append(trajectory)

        async def aclose(self) -> None:
            return None

    rollout: Callable[..., Any] = lambda llm, s, **kw: run_tools(llm, s, [ADD], **kw)  # noqa: E731
    payload = {
        "task_type": "calculator",
        "input_file": str(data),
        "remote_engine_url": ENGINE,
        "num_process": 1,
        "sampling_params": {"max_tokens": 64},
        "token_mode": True,
        "tokenizer_path": str(tokenizer_dir),
        "shuffle": False,
        "max_retry_s": 0,
    }
    settings = RolloutSettings.model_validate(payload)
    llm = policy_client(
        settings, tokenizer=load_tokenizer(str(tokenizer_dir)), transport=httpx.AsyncHTTPTransport()
    )
    assert isinstance(llm, TokenClient)
    async with llm:
        await run_rollouts(payload, reward=lambda s, e: 1.0, rollout=rollout, sink=Sink(), llm=llm)
    (trajectory,) = written
    assert "error" not in trajectory["extra_info"], trajectory["extra_info"]["error"]
    assert trajectory["tools"] == [ADD.schema]
    first, second = trajectory["turns"]
    assert first["prompt_offset"] == 0
    assert first["prompt_ids"] == engine.requests[0]["input_ids"]
    assert second["prompt_offset"] == len(first["prompt_ids"]) + len(first["output_ids"])
    assert first["prompt_ids"] + first["output_ids"] + second["prompt_ids"] == engine.requests[1]["input_ids"]
    assert [t["message_index"] for t in trajectory["turns"]] == [2, 4]
    assert [m.get("generated", False) for m in trajectory["messages"]] == [False, False, True, False, True]
    assert (first["finish_reason"], second["finish_reason"], second["weight_version"]) == (
        "tool_calls",
        "stop",
        "3",
    )
    assert second["sampling"] == {"max_tokens": 64, "seed": trajectory["extra_info"]["seed"] + 1}
    assert len(second["output_logprobs"]) == len(second["output_ids"])


@respx.mock
async def test_single_turn_in_token_mode_renders_the_prompt_once() -> None:
    tokenizer = qwen3()
    respx.post(GENERATE).mock(
        side_effect=Engine(tokenizer, [("add them\n</think>\n\nIt is 5.<|im_end|>", "stop")])
    )
    async with token_client(tokenizer) as llm:
        episode = await single_turn(llm, sample(), max_tokens=32)
    assert episode.messages[-1] == {
        "role": "assistant",
        "content": "It is 5.",
        "reasoning_content": "add them",
        "generated": True,
    }
    (completion,) = episode.completions
    assert completion.tokens is not None
    assert tokenizer.decode(completion.tokens.prompt_ids).endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize(
    ("answer", "ids", "logprobs", "finish"),
    [
        # recent SGLang: output_ids, finish_reason as {"type": ...}
        (
            {"text": "", "output_ids": [3, 4], "meta_info": {"finish_reason": {"type": "length", "length": 2},
             "output_token_logprobs": [[-0.5, 3, None], [-1, 4, None]], "weight_version": "w1"}},
            [3, 4], [-0.5, -1.0], "length",
        ),
        # older SGLang: no output_ids (slime reads them from output_token_logprobs), a plain finish string
        (
            {"text": "", "meta_info": {"finish_reason": "stop", "output_token_logprobs": [[-0.25, 9, "x"]]}},
            [9], [-0.25], "stop",
        ),
        # an abort that brought nothing
        (
            {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"},
             "output_token_logprobs": []}},
            [], [], "abort",
        ),
    ],
)  # fmt: skip
def test_generate_answers_of_each_sglang_vintage_are_read(
    answer: dict[str, Any], ids: list[int], logprobs: list[float], finish: str
) -> None:
    generated = read_generate(answer)
    assert (generated.output_ids, generated.output_logprobs, generated.finish_reason) == (
        ids,
        logprobs,
        finish,
    )


def test_a_malformed_generate_answer_is_refused() -> None:
    with pytest.raises(AnswerShapeError, match="output_ids"):
        read_generate({"text": "", "meta_info": {}})
    with pytest.raises(AnswerShapeError, match="not a list of integers"):
        read_generate({"output_ids": ["a"], "meta_info": {}})


def test_token_mode_without_a_tokenizer_path_says_so() -> None:
    settings = RolloutSettings.model_validate(
        {"input_file": "x", "remote_engine_url": ENGINE, "token_mode": True}
    )
    with pytest.raises(ValueError, match="token_mode needs tokenizer_path"):
        policy_client(settings)


# Each dialect's token route, on the simulator (the stand-in this table is tested against)

TOKEN_ROUTES = {"auto": "/generate", "sglang": "/generate", "vllm": "/v1/completions"}


@pytest.mark.parametrize("engine", list(DIALECTS))
async def test_each_dialect_s_token_route_is_served_and_read_back_faithfully(engine: str) -> None:
    assert set(TOKEN_ROUTES) == set(DIALECTS), "a new dialect: say here which route its token prompts take"
    sim = create_sim_app(SimConfig(latency_mean_s=0.0, abort_rate=0.5, accuracy=1.0, seed=0))
    paths: list[str] = []

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        paths.append(scope["path"])
        await sim(scope, receive, send)

    renderer = TokenRenderer(build_sim_tokenizer())
    client = TokenClient(
        "http://sim",
        renderer,
        engine=engine,
        model="sim-model",
        continuation=ContinuePolicy(delay_s=0),
        transport=httpx.ASGITransport(app=recorded),
    )
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    async with client:
        completions = [await client.complete(question, max_tokens=256, seed=seed) for seed in range(4)]
    assert set(paths) == {TOKEN_ROUTES[engine]}
    for completion in completions:
        assert completion.finish_reason == "stop"
        assert completion.tokens is not None
        assert completion.tokens.prompt_ids == renderer.first_prompt(question, None)
        assert len(completion.tokens.output_logprobs or ()) == len(completion.tokens.output_ids)
        assert "5" in completion.text
    assert sum(completion.continuations for completion in completions), "aborted answers were continued"


def test_a_token_client_for_an_engine_the_table_does_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi': one of auto, vllm, sglang"):
        TokenClient(ENGINE, TokenRenderer(qwen25()), engine="tgi", transport=httpx.AsyncHTTPTransport())
