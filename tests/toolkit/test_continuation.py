"""Aborted answers: continued from their ids wherever the engine takes ids, never spliced.

vLLM and SGLang are mocked with respx in their own shapes (chat, ``/v1/completions``, ``/generate``),
and the simulator serves a real Qwen3 chat template, which writes an empty think block where vLLM
re-renders a reply continued as text: what made 17 of 17 continued trajectories wrong on a real vLLM.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import respx

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.model import SimModel
from buffer.simulator.tokenizer import build_tokenizer
from buffer.toolkit.llm import ChatClient, ContinuePolicy, RetryPolicy
from buffer.toolkit.types import TokenCapture
from tests.support.paths import REPO

pytestmark = pytest.mark.anyio

ENGINE = "http://engine.test"
CHAT = f"{ENGINE}/v1/chat/completions"
COMPLETIONS = f"{ENGINE}/v1/completions"
GENERATE = f"{ENGINE}/generate"
PROMPT = [{"role": "user", "content": "What is 1 + 1?"}]
FAST = RetryPolicy(max_attempts=3, backoff_s=0.001, max_backoff_s=0.01)
QWEN3 = (REPO / "tests" / "support" / "templates" / "qwen3-hybrid.jinja").read_text()


def client(**kwargs: Any) -> ChatClient:
    kwargs.setdefault("continuation", ContinuePolicy(delay_s=0))
    kwargs.setdefault("retry", FAST)
    return ChatClient(ENGINE, transport=httpx.AsyncHTTPTransport(), **kwargs)


def body_of(route: respx.Route, call: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(route.calls[call].request.content)
    return body


def logprobs_of(output: list[int]) -> list[float]:
    return [-0.01 * token for token in output]


def entries(output: list[int]) -> list[list[Any]]:
    """SGLang's ``output_token_logprobs``: ``[logprob, id, text]`` per sampled id."""
    return [[-0.01 * token, token, None] for token in output]


def vllm_chat(prompt: list[int], output: list[int], finish: str, **message: Any) -> httpx.Response:
    """vLLM's chat answer: the prompt's ids at the top level, the sampled ids in the choice."""
    content = [{"token": f"t{t}", "logprob": -0.01 * t, "top_logprobs": []} for t in output]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": None, "reasoning": None, **message},
        "logprobs": {"content": content},
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": output,
    }
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(output), "total_tokens": 0}
    return httpx.Response(200, json={"prompt_token_ids": prompt, "choices": [choice], "usage": usage})


def sglang_chat(prompt: list[int], output: list[int], finish: str, **message: Any) -> httpx.Response:
    """SGLang's chat answer: both ids in the choice, with meta_info and metadata.weight_version."""
    choice = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": None,
            "reasoning_content": None,
            "tool_calls": None,
            **message,
        },
        "logprobs": None,
        "finish_reason": finish,
        "prompt_token_ids": prompt,
        "token_ids": output,
        "meta_info": {
            "finish_reason": {"type": finish},
            "output_token_logprobs": entries(output),
        },
    }
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(output), "total_tokens": 0}
    return httpx.Response(
        200, json={"choices": [choice], "usage": usage, "metadata": {"weight_version": "7"}}
    )


def completions(
    output: list[int], finish: str, text: str, echoed: list[int] | None = None
) -> Callable[..., Any]:
    """vLLM's /v1/completions with a token prompt: it echoes the prompt's ids (``echoed`` overrides)."""

    def answer(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        choice = {
            "index": 0,
            "text": text,
            "logprobs": {"token_logprobs": logprobs_of(output), "tokens": [], "top_logprobs": None},
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": prompt if echoed is None else echoed,
            "token_ids": output,
        }
        return httpx.Response(200, json={"choices": [choice], "usage": {"completion_tokens": len(output)}})

    return answer


def generate(output: list[int], finish: str, text: str) -> httpx.Response:
    """SGLang's /generate: the sampled ids and meta_info; the prompt's ids are not echoed."""
    meta = {
        "finish_reason": {"type": finish},
        "weight_version": "8",
        "output_token_logprobs": entries(output),
    }
    return httpx.Response(200, json={"text": text, "output_ids": output, "meta_info": meta})


# Continued from the ids, on each engine's token route


@respx.mock
async def test_vllm_an_aborted_chat_answer_is_continued_from_its_ids_on_v1_completions() -> None:
    chat = respx.post(CHAT).mock(
        return_value=vllm_chat([1, 2, 3], [10, 11, 12], "abort", content="<think>\nOne and")
    )
    rest = respx.post(COMPLETIONS).mock(
        side_effect=completions([13, 14, 15, 16], "stop", " one.\n</think>\n\nThe answer is \\boxed{2}.")
    )
    async with client(engine="vllm") as llm:
        completion = await llm.complete(PROMPT, max_tokens=100, temperature=0.7, seed=5, tools=None)
    assert chat.call_count == 1  # the continuation is no chat request: no re-rendered reply
    sent = body_of(rest)
    assert sent["prompt"] == [1, 2, 3, 10, 11, 12]  # the first prompt and the ids sampled so far
    assert (sent["max_tokens"], sent["seed"], sent["temperature"], sent["logprobs"]) == (97, 5, 0.7, 0)
    assert (sent["return_token_ids"], sent["skip_special_tokens"], sent["include_stop_str_in_output"]) == (
        True,
        True,
        False,
    )
    assert not {"messages", "continue_final_message", "tools", "chat_template_kwargs"} & set(sent)
    output = [10, 11, 12, 13, 14, 15, 16]
    assert completion.tokens == TokenCapture([1, 2, 3], output, logprobs_of(output), None, engine="vllm")
    # The text as vLLM (no reasoning parser: its default) would have answered it uninterrupted.
    assert completion.text == "<think>\nOne and one.\n</think>\n\nThe answer is \\boxed{2}."
    assert (completion.finish_reason, completion.continuations, completion.attempts) == ("stop", 1, 2)
    assert (completion.mode, completion.text_continuations, completion.mismatched_continuations) == (
        "chat",
        0,
        0,
    )
    assert completion.usage["completion_tokens"] == 7


@respx.mock
async def test_sglang_an_answer_aborted_in_its_reasoning_is_continued_on_generate_read_as_chat() -> None:
    respx.post(CHAT).mock(
        return_value=sglang_chat([4, 5], [20, 21, 22], "abort", reasoning_content="One and")
    )
    rest = respx.post(GENERATE).mock(
        return_value=generate(
            [23, 24, 25],
            "stop",
            ' one.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>',
        )
    )
    async with client(engine="sglang") as llm:
        completion = await llm.complete(PROMPT, max_tokens=50, seed=9, top_p=0.9)
    sent = body_of(rest)
    assert sent["input_ids"] == [4, 5, 20, 21, 22]
    assert sent["sampling_params"] == {
        "top_p": 0.9,
        "max_new_tokens": 47,
        "sampling_seed": 9,
        "skip_special_tokens": True,
        "no_stop_trim": False,
    }
    assert completion.reasoning_content == "One and one."
    assert completion.tool_calls is not None
    [call] = completion.tool_calls
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 1}'}
    assert (completion.text, completion.finish_reason) == ("", "tool_calls")
    assert completion.tokens is not None
    assert (completion.tokens.prompt_ids, completion.tokens.output_ids) == ([4, 5], [20, 21, 22, 23, 24, 25])
    assert completion.tokens.weight_version == "8"


@respx.mock
@pytest.mark.parametrize(
    ("first", "route"),
    [
        (vllm_chat([1, 2], [10], "abort", content="Two"), COMPLETIONS),
        (sglang_chat([1, 2], [10], "abort", content="Two"), GENERATE),
    ],
    ids=["vllm-shaped", "sglang-shaped"],
)
async def test_engine_auto_continues_on_the_token_route_of_the_engine_its_answer_shows(
    first: httpx.Response, route: str
) -> None:
    respx.post(CHAT).mock(return_value=first)
    if route == COMPLETIONS:
        rest = respx.post(route).mock(side_effect=completions([11], "stop", "."))
    else:
        rest = respx.post(route).mock(return_value=generate([11], "stop", "."))
    async with client() as llm:
        completion = await llm.complete(PROMPT)
    assert rest.call_count == 1
    assert completion.text == "Two."
    assert completion.tokens is not None
    assert (completion.tokens.prompt_ids, completion.tokens.output_ids) == ([1, 2], [10, 11])


# Where the engine cannot take ids: recorded as what it was, never spliced; a refusal loses nothing


@respx.mock
async def test_without_a_token_route_a_text_continuation_sampled_after_another_prompt_is_its_own_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="buffer.toolkit.llm")
    rest = respx.post(COMPLETIONS).mock(return_value=httpx.Response(404, json={"detail": "Not Found"}))
    # The continuation's prompt as the engine rendered it: the reply so far re-tokenised (99, 98).
    chat = respx.post(CHAT).mock(
        side_effect=[
            vllm_chat([1, 2, 3], [10, 11], "abort", content="Let me"),
            vllm_chat([1, 2, 3, 99, 98], [12], "stop", content=" think."),
        ]
        * 2
    )
    async with client(engine="vllm") as llm:
        completions_ = [await llm.complete(PROMPT, max_tokens=10) for _ in range(2)]
    assert rest.call_count == 1  # found missing once, then not asked again
    follow_up = body_of(chat, 1)
    assert follow_up["messages"][-1] == {"role": "assistant", "content": "Let me"}
    assert (follow_up["continue_final_message"], follow_up["add_generation_prompt"]) == (True, False)
    for completion in completions_:
        assert completion.text == "Let me think."
        # Sampled after [1, 2, 3, 99, 98], not after [1, 2, 3, 10, 11]: recorded from that prompt.
        assert completion.tokens == TokenCapture(
            [1, 2, 3, 99, 98], [12], logprobs_of([12]), None, engine="vllm"
        )
        assert (completion.text_continuations, completion.mismatched_continuations) == (1, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # each kind said once, for both answers
    assert any("no /completions" in w for w in warnings)
    assert any("recorded from its own prompt, never spliced" in w for w in warnings)


@respx.mock
async def test_a_text_continuation_the_engine_reports_in_the_same_context_is_joined() -> None:
    respx.post(COMPLETIONS).mock(return_value=httpx.Response(404, json={"detail": "Not Found"}))
    respx.post(CHAT).mock(
        side_effect=[
            vllm_chat([1, 2, 3], [10, 11], "abort", content="Let me"),
            vllm_chat([1, 2, 3, 10, 11], [12], "stop", content=" think."),
        ]
    )
    async with client(engine="vllm") as llm:
        completion = await llm.complete(PROMPT, max_tokens=10)
    assert completion.tokens is not None
    assert (completion.tokens.prompt_ids, completion.tokens.output_ids) == ([1, 2, 3], [10, 11, 12])
    assert (completion.text_continuations, completion.mismatched_continuations) == (1, 0)


@respx.mock
async def test_vllm_s_400_on_a_text_continuation_keeps_the_answer_aborted_instead_of_losing_it() -> None:
    respx.post(COMPLETIONS).mock(return_value=httpx.Response(404, json={"detail": "Not Found"}))
    said = (
        "continue_final_message is set but the final message does not appear in the chat after applying "
        "the chat template!"
    )
    respx.post(CHAT).mock(
        side_effect=[
            vllm_chat([1, 2, 3], [10, 11], "abort", content="a</think>b"),
            httpx.Response(400, json={"error": {"message": said, "type": "BadRequestError", "code": 400}}),
        ]
    )
    async with client(engine="vllm") as llm:
        completion = await llm.complete(PROMPT, max_tokens=10)
    assert (completion.finish_reason, completion.text, completion.continuations) == ("abort", "a</think>b", 1)
    assert completion.tokens is not None
    assert (completion.tokens.prompt_ids, completion.tokens.output_ids) == ([1, 2, 3], [10, 11])


# Against the simulator, with Qwen3's real chat template


class Recorded:
    """ASGI middleware: every generation request (path, body) and its answer."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.exchanges: list[tuple[str, dict[str, Any], dict[str, Any]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request: list[bytes] = []
        answer: list[bytes] = []

        async def receive_body() -> Any:
            message = await receive()
            request.append(message.get("body", b""))
            return message

        async def send_answer(message: Any) -> None:
            if message["type"] == "http.response.body":
                answer.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive_body, send_answer)
        self.exchanges.append((scope["path"], json.loads(b"".join(request)), json.loads(b"".join(answer))))


def received_and_sampled(
    path: str, request: dict[str, Any], answer: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """(the prompt ids the engine received, the ids it sampled) of one exchange."""
    if path == "/generate":
        return request["input_ids"], answer["output_ids"]
    [choice] = answer["choices"]
    if path == "/v1/completions":
        return choice["prompt_token_ids"], choice["token_ids"]
    return answer.get("prompt_token_ids") or choice["prompt_token_ids"], choice["token_ids"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_with_qwen3_s_template_every_continued_answer_is_one_context_the_engine_sampled(
    engine: str,
) -> None:
    tokenizer = build_tokenizer(thinking=True)
    tokenizer.chat_template = QWEN3
    config = SimConfig(engine=engine, latency_mean_s=0.0, abort_rate=0.5, accuracy=1.0, seed=3)
    app = Recorded(create_sim_app(config, model=SimModel(tokenizer)))
    question = [{"role": "user", "content": "What is 3 * (4 + 5)?"}]
    first_prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=False)
    async with ChatClient(
        "http://sim", model="sim-model", engine=engine, transport=httpx.ASGITransport(app=app), retry=FAST
    ) as llm:
        continued = 0
        for seed in range(8):
            app.exchanges.clear()
            completion = await llm.complete(question, max_tokens=256, seed=seed)
            tokens = completion.tokens
            assert tokens is not None
            assert tokens.prompt_ids == first_prompt
            # Each request of the answer was sent the first prompt and the ids sampled before it.
            held: list[int] = []
            for path, request, answer in app.exchanges:
                prompt, output = received_and_sampled(path, request, answer)
                assert prompt == first_prompt + held, (
                    seed,
                    path,
                    tokenizer.decode(prompt[len(first_prompt) :]),
                )
                held += output
            assert held == tokens.output_ids
            text = tokenizer.decode(tokens.output_ids)
            assert text.count("<think>") == 1, text  # one reply, never a reply restarted inside another
            assert completion.reasoning_content is not None
            assert "27" in completion.reasoning_content
            assert completion.text == "So the answer is \\boxed{27}."
            assert (completion.mismatched_continuations, completion.text_continuations) == (0, 0)
            continued += completion.continuations
    assert continued, "some answers were aborted and continued"
