"""The policy-server client: retries, aborted answers, the answer's parts. LLM mocked with respx."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import httpx
import pydantic
import pytest
import respx

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.engines import DIALECTS as SIMULATED
from buffer.simulator.tokenizer import build_tokenizer
from buffer.toolkit.engines import DIALECTS, ENGINES
from buffer.toolkit.llm import ChatClient, ContinuePolicy, LLMError, LLMStats, RetryPolicy, engine_base_url
from buffer.toolkit.runner import RolloutSettings
from buffer.toolkit.types import TokenCapture

pytestmark = pytest.mark.anyio

URL = "http://engine.test/v1/chat/completions"
PROMPT = [{"role": "user", "content": "What is 1 + 1?"}]
FAST = RetryPolicy(max_attempts=4, backoff_s=0.001, max_backoff_s=0.01)


def answer(
    content: str | None = "\\boxed{2}",
    finish: str = "stop",
    tokens: int = 3,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning_content: str | None = None,
    **choice: Any,
) -> httpx.Response:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning_content is not None:
        message["reasoning_content"] = reasoning_content
    body = {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
        "usage": {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens},
    }
    return httpx.Response(200, json=body)


def sent(route: respx.Route, call: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(route.calls[call].request.content)
    return body


def client(**kwargs: Any) -> ChatClient:
    """A client on httpx's own transport, which respx intercepts."""
    kwargs.setdefault("continuation", ContinuePolicy(delay_s=0))
    kwargs.setdefault("retry", FAST)
    return ChatClient("http://engine.test", transport=httpx.AsyncHTTPTransport(), **kwargs)


def test_the_engine_url_gets_v1_unless_it_has_it() -> None:
    assert engine_base_url("http://10.0.0.1:30000") == "http://10.0.0.1:30000/v1"
    assert engine_base_url("http://10.0.0.1:30000/v1/") == "http://10.0.0.1:30000/v1"


@respx.mock
async def test_a_completion_carries_text_finish_reason_usage_and_the_request_fields() -> None:
    route = respx.post(URL).mock(return_value=answer())
    async with client(model="policy") as llm:
        completion = await llm.complete(PROMPT, seed=42, max_tokens=64, temperature=0.7)
    assert (completion.text, completion.finish_reason, completion.attempts) == ("\\boxed{2}", "stop", 1)
    assert completion.usage == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    body = sent(route)
    assert body["model"] == "policy"
    assert (body["seed"], body["max_tokens"], body["temperature"], body["stream"]) == (42, 64, 0.7, False)
    assert body["messages"] == PROMPT


@respx.mock
@pytest.mark.parametrize(
    "failure",
    [
        httpx.Response(503, text="overloaded"),
        httpx.Response(500),
        httpx.Response(429, headers={"retry-after": "0"}),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
    ],
)
async def test_transient_failures_are_retried(failure: Any) -> None:
    route = respx.post(URL).mock(side_effect=[failure, failure, answer()])
    async with client() as llm:
        completion = await llm.complete(PROMPT)
    assert completion.text == "\\boxed{2}"
    assert completion.attempts == 3
    assert route.call_count == 3


@respx.mock
async def test_retries_give_up_with_a_clear_error() -> None:
    route = respx.post(URL).mock(return_value=httpx.Response(503, text="overloaded"))
    async with client() as llm:
        with pytest.raises(LLMError, match=r"failed 4 times over [0-9.]+ s; last: .*503"):
            await llm.complete(PROMPT)
    assert route.call_count == 4


def test_by_default_a_request_is_retried_for_two_minutes_however_many_attempts_that_takes() -> None:
    policy = RetryPolicy()
    assert (policy.max_retry_s, policy.max_attempts) == (120.0, None)
    assert policy.max_backoff_s <= 5.0  # a request notices the server is back within 5 s


@respx.mock
async def test_an_outage_shorter_than_max_retry_s_is_ridden_out_whatever_the_attempts() -> None:
    back_at = time.monotonic() + 0.3

    def outage(request: httpx.Request) -> httpx.Response:
        if time.monotonic() < back_at:
            raise httpx.ConnectError("connection refused")
        return answer()

    route = respx.post(URL).mock(side_effect=outage)
    retry = RetryPolicy(max_retry_s=5.0, backoff_s=0.001, max_backoff_s=0.01)
    async with client(retry=retry) as llm:
        completion = await llm.complete(PROMPT)
    assert completion.text == "\\boxed{2}"
    assert completion.attempts == route.call_count > 6  # more than any fixed count of old
    assert llm.stats.requests == route.call_count
    assert llm.stats.failures == route.call_count - 1


@respx.mock
async def test_retries_stop_when_max_retry_s_is_spent() -> None:
    route = respx.post(URL).mock(return_value=httpx.Response(503, text="down"))
    retry = RetryPolicy(max_retry_s=0.3, backoff_s=0.001, max_backoff_s=0.02)
    started = time.monotonic()
    async with client(retry=retry) as llm:
        with pytest.raises(LLMError, match=r"failed [0-9]+ times over [0-9.]+ s; last: .*503"):
            await llm.complete(PROMPT)
    # Stopped at the budget, not at a count; the slack above it is a busy machine's.
    assert 0.25 <= time.monotonic() - started < 10
    assert route.call_count > 4


@respx.mock
async def test_max_retry_s_zero_makes_one_attempt() -> None:
    route = respx.post(URL).mock(return_value=httpx.Response(503, text="down"))
    async with client(retry=RetryPolicy(max_retry_s=0)) as llm:
        with pytest.raises(LLMError, match=r"failed once over [0-9.]+ s; last: .*503"):
            await llm.complete(PROMPT)
    assert route.call_count == 1


@respx.mock
async def test_stats_count_every_request_and_every_failure_by_kind_as_they_happen() -> None:
    respx.post(URL).mock(
        side_effect=[
            httpx.Response(503),
            httpx.ConnectError("refused"),
            httpx.ReadError("connection reset"),
            answer(),
            httpx.Response(400, text="bad"),
            httpx.Response(200, text="not json"),
        ]
    )
    async with client() as llm:
        assert (await llm.complete(PROMPT)).attempts == 4
        for _ in range(2):
            with pytest.raises(LLMError):
                await llm.complete(PROMPT)
    assert llm.stats == LLMStats(
        requests=6,
        failures=5,
        failures_by_kind=Counter(
            {"HTTP 503": 1, "ConnectError": 1, "ReadError": 1, "HTTP 400": 1, "invalid JSON": 1}
        ),
    )


@respx.mock
async def test_a_client_error_is_not_retried() -> None:
    route = respx.post(URL).mock(return_value=httpx.Response(400, text="bad request: messages"))
    async with client() as llm:
        with pytest.raises(LLMError, match=r"HTTP 400 .*bad request"):
            await llm.complete(PROMPT)
    assert route.call_count == 1


@respx.mock
async def test_retry_after_sets_the_least_wait() -> None:
    import time

    respx.post(URL).mock(side_effect=[httpx.Response(429, headers={"retry-after": "0.3"}), answer()])
    started = time.monotonic()
    async with client() as llm:
        await llm.complete(PROMPT)
    assert time.monotonic() - started >= 0.3


def engine_error(status: int, message: str) -> httpx.Response:
    """vLLM's error body."""
    return httpx.Response(
        status,
        json={"error": {"message": message, "type": "InternalServerError", "param": None, "code": status}},
    )


@respx.mock
async def test_a_500_the_engine_gives_the_same_way_every_time_fails_at_the_third_with_its_message() -> None:
    said = "1 validation error for SamplingParams: top_k must be -1 (disable), or at least 1, got 0."
    route = respx.post(URL).mock(return_value=engine_error(500, said))
    quick = RetryPolicy(max_attempts=10, backoff_s=0.001, max_backoff_s=0.01)  # 2 minutes: not the limit
    async with client(retry=quick) as llm:
        with pytest.raises(LLMError) as caught:
            await llm.complete(PROMPT, top_k=0)
    assert route.call_count == 3
    assert (caught.value.status, caught.value.engine_message) == (500, said)
    assert said in str(caught.value)
    assert llm.stats.failures_by_kind == Counter({"HTTP 500": 3})


@respx.mock
@pytest.mark.parametrize(
    "failures",
    [
        [engine_error(503, "the engine is overloaded")] * 5,
        [httpx.Response(429, headers={"retry-after": "0"}, json={"error": {"message": "slow down"}})] * 5,
        [httpx.ConnectError("refused")] * 5,
        [engine_error(500, f"EngineCore failed: step {n}") for n in range(5)],  # not the same answer
        [*[engine_error(500, "flaky")] * 2, engine_error(503, "x"), *[engine_error(500, "flaky")] * 2],
    ],
    ids=["503", "429", "refused", "500s that differ", "500s not 3 in a row"],
)
async def test_transient_errors_keep_their_retries_however_alike(failures: list[Any]) -> None:
    route = respx.post(URL).mock(side_effect=[*failures, answer()])
    async with client(retry=RetryPolicy(max_attempts=10, backoff_s=0.001, max_backoff_s=0.01)) as llm:
        completion = await llm.complete(PROMPT)
    assert (completion.text, route.call_count, completion.attempts) == ("\\boxed{2}", 6, 6)


@respx.mock
async def test_an_aborted_answer_is_continued_within_the_token_budget() -> None:
    route = respx.post(URL).mock(
        side_effect=[
            answer("Let me think", "abort", tokens=3),
            answer(" step by step. \\boxed{2}", "stop", tokens=6),
        ]
    )
    async with client() as llm:
        completion = await llm.complete(PROMPT, max_tokens=100, seed=1)
    assert completion.text == "Let me think step by step. \\boxed{2}"
    assert (completion.finish_reason, completion.continuations, completion.attempts) == ("stop", 1, 2)
    assert completion.usage["completion_tokens"] == 9
    follow_up = sent(route, 1)
    assert follow_up["messages"] == [*PROMPT, {"role": "assistant", "content": "Let me think"}]
    assert follow_up["continue_final_message"] is True
    assert follow_up["max_tokens"] == 97  # what the first part left of the budget
    assert follow_up["seed"] == 1


@respx.mock
async def test_an_abort_that_spent_the_budget_is_truncation() -> None:
    route = respx.post(URL).mock(return_value=answer("a b c d", "abort", tokens=4))
    async with client() as llm:
        completion = await llm.complete(PROMPT, max_tokens=4)
    assert completion.finish_reason == "length"
    assert route.call_count == 1


@respx.mock
async def test_continuations_stop_at_their_cap() -> None:
    route = respx.post(URL).mock(return_value=answer("x", "abort", tokens=1))
    async with client(continuation=ContinuePolicy(max_continuations=2, delay_s=0)) as llm:
        completion = await llm.complete(PROMPT)
    assert (completion.finish_reason, completion.text, route.call_count) == ("abort", "xxx", 3)


@respx.mock
async def test_tool_calls_and_reasoning_are_kept_and_the_message_is_marked_generated() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
    }
    respx.post(URL).mock(
        return_value=answer(None, "tool_calls", tool_calls=[call], reasoning_content="add them")
    )
    async with client() as llm:
        completion = await llm.complete(
            PROMPT, tools=[{"type": "function", "function": {"name": "calculator"}}]
        )
    assert completion.message() == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "add them",
        "tool_calls": [call],
        "generated": True,
    }
    assert completion.tokens is None  # the server sent no ids: no token record, text only


def vllm_answer(
    content: str, finish: str, prompt: list[int], output: list[int], **message: Any
) -> httpx.Response:
    """vLLM's shape: prompt_token_ids at the top level, token_ids in the choice."""
    logprobs = {
        "content": [{"token": f"t{i}", "logprob": -0.1 * (i + 1), "top_logprobs": []} for i in output]
    }
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "policy",
        "prompt_token_ids": prompt,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **message},
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": output,
            }
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output), "total_tokens": 0},
    }
    return httpx.Response(200, json=body)


def sglang_answer(
    content: str, finish: str, prompt: list[int], output: list[int], *, ids: bool = True
) -> httpx.Response:
    """SGLang's shape: prompt_token_ids and token_ids in the choice, meta_info with
    output_token_logprobs as [logprob, id, text], metadata.weight_version at the top."""
    entries = [[-0.5 * (n + 1), token, None] for n, token in enumerate(output)]
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": None},
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": None,
        "prompt_token_ids": prompt,
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": finish},
            "weight_version": "7",
            "output_token_logprobs": entries,
        },
    }
    if ids:
        choice["token_ids"] = output
    body = {
        "id": "r",
        "object": "chat.completion",
        "model": "policy",
        "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output), "total_tokens": 0},
        "metadata": {"weight_version": "7"},
    }
    return httpx.Response(200, json=body)


@respx.mock
async def test_vllm_token_ids_and_logprobs_are_asked_for_and_captured() -> None:
    route = respx.post(URL).mock(
        return_value=vllm_answer(
            "2", "stop", [1, 2, 3], [7, 8], reasoning="one and one", reasoning_content=None
        )
    )
    async with client(engine="vllm") as llm:
        completion = await llm.complete(PROMPT, max_tokens=16, temperature=0.5, seed=3)
    body = sent(route)
    assert (body["logprobs"], body["return_token_ids"]) == (True, True)
    assert "return_prompt_token_ids" not in body  # SGLang's spelling is not sent to vLLM
    assert completion.tokens == TokenCapture([1, 2, 3], [7, 8], [-0.1 * 8, -0.1 * 9], None, engine="vllm")
    assert completion.reasoning_content == "one and one"  # vLLM >= 0.11 says "reasoning"
    assert completion.sampling == {"max_tokens": 16, "temperature": 0.5, "seed": 3}


@respx.mock
@pytest.mark.parametrize("ids", [True, False], ids=["token_ids", "meta_info only"])
async def test_sglang_token_ids_logprobs_and_weight_version_are_captured(ids: bool) -> None:
    route = respx.post(URL).mock(return_value=sglang_answer("2", "stop", [4, 5], [9, 10, 11], ids=ids))
    async with client(engine="sglang") as llm:
        completion = await llm.complete(PROMPT)
    body = sent(route)
    assert body["logprobs"] is True
    assert body["return_prompt_token_ids"] is body["return_token_ids"] is body["return_meta_info"] is True
    expected = TokenCapture([4, 5], [9, 10, 11], [-0.5, -1.0, -1.5], "7", engine="sglang")
    expected.weight_versions = [[7, 3]]  # each output id's version, as runs
    assert completion.tokens == expected


@respx.mock
async def test_capture_off_asks_for_nothing() -> None:
    route = respx.post(URL).mock(return_value=vllm_answer("2", "stop", [1], [2]))
    async with client(capture=False) as llm:
        completion = await llm.complete(PROMPT)
    assert not {"logprobs", "return_token_ids", "return_prompt_token_ids"} & set(sent(route))
    assert completion.tokens is None


@respx.mock
async def test_ids_and_logprobs_that_disagree_in_length_are_an_error_not_a_record() -> None:
    bad = vllm_answer("2", "stop", [1], [2, 3])
    body = json.loads(bad.content)
    body["choices"][0]["logprobs"]["content"].pop()
    respx.post(URL).mock(return_value=httpx.Response(200, json=body))
    async with client() as llm:
        with pytest.raises(LLMError, match="1 logprobs for 2 output ids"):
            await llm.complete(PROMPT)


@respx.mock
async def test_an_abort_with_new_tokens_is_continued_at_once() -> None:
    respx.post(URL).mock(side_effect=[answer("a", "abort", tokens=1)] * 5 + [answer("b")])
    started = time.monotonic()
    async with client(continuation=ContinuePolicy(delay_s=60.0)) as llm:
        completion = await llm.complete(PROMPT)
    assert completion.continuations == 5
    assert time.monotonic() - started < 30  # no pause per abort: one would be a minute


@respx.mock
async def test_only_an_abort_that_brought_nothing_waits_and_the_wait_doubles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []
    backoff_s = ContinuePolicy.backoff_s

    def spy(policy: ContinuePolicy, empty_in_a_row: int) -> float:
        waits.append(backoff_s(policy, empty_in_a_row))
        return waits[-1]

    monkeypatch.setattr(ContinuePolicy, "backoff_s", spy)
    respx.post(URL).mock(side_effect=[answer("", "abort", tokens=0)] * 2 + [answer("b")])
    started = time.monotonic()
    async with client(continuation=ContinuePolicy(delay_s=0.1)) as llm:
        completion = await llm.complete(PROMPT)
    assert completion.text == "b"
    assert waits == [0.1, 0.2]
    assert time.monotonic() - started >= 0.3  # and they were waited
    assert ContinuePolicy(delay_s=1.0, max_delay_s=3.0).backoff_s(5) == 3.0


@respx.mock
@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            {
                "error": {
                    "message": "The model `gpt` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            },
            "The model `gpt` does not exist.",
        ),
        (
            {
                "object": "error",
                "message": "The model `gpt` does not exist.",
                "type": "NotFoundError",
                "code": 404,
            },
            "The model `gpt` does not exist.",
        ),
    ],
    ids=["vllm", "flat"],
)
async def test_a_refusal_carries_its_status_and_the_engine_message(body: dict[str, Any], said: str) -> None:
    respx.post(URL).mock(return_value=httpx.Response(404, json=body))
    async with client(model="gpt") as llm:
        with pytest.raises(LLMError) as caught:
            await llm.complete(PROMPT)
    assert (caught.value.status, caught.value.engine_message) == (404, said)
    assert said in str(caught.value)


@respx.mock
async def test_an_answer_without_choices_is_an_error() -> None:
    respx.post(URL).mock(return_value=httpx.Response(200, json={"error": "nope"}))
    async with client() as llm:
        with pytest.raises(LLMError, match="no choices"):
            await llm.complete(PROMPT)


# The engine table: one entry per dialect, the names the API takes, the simulator speaking each


def test_the_engine_names_the_api_takes_are_those_of_the_dialect_table() -> None:
    assert ENGINES == tuple(DIALECTS) == ("auto", "vllm", "sglang")
    schema = RolloutSettings.model_json_schema()["properties"]["engine"]
    assert (schema["enum"], schema["default"]) == (list(DIALECTS), "auto")
    payload = {"input_file": "rows.jsonl", "remote_engine_url": "http://engine.test"}
    for name, dialect in DIALECTS.items():
        assert dialect.name == name
        assert RolloutSettings.model_validate({**payload, "engine": name}).engine == name
    with pytest.raises(pydantic.ValidationError, match="engine"):
        RolloutSettings.model_validate({**payload, "engine": "tgi"})


def test_a_client_for_an_engine_the_table_does_not_have_is_refused_saying_which_it_has() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi': one of auto, vllm, sglang"):
        ChatClient("http://engine.test", engine="tgi", transport=httpx.AsyncHTTPTransport())


def simulated_engines(dialect: str) -> list[str]:
    """The simulator's engines a toolkit dialect is tested against: its namesake; every one for auto."""
    return list(SIMULATED) if dialect == "auto" else [name for name in SIMULATED if name == dialect]


@pytest.mark.parametrize("dialect", list(DIALECTS))
async def test_each_dialect_captures_and_continues_on_the_simulated_engines_it_speaks(dialect: str) -> None:
    engines = simulated_engines(dialect)
    assert engines, f"the simulator imitates no engine for {dialect!r}: add one to buffer.simulator.engines"
    tokenizer = build_tokenizer()
    prompt_ids = tokenizer.apply_chat_template(
        PROMPT, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    for engine in engines:
        app = create_sim_app(SimConfig(engine=engine, latency_mean_s=0.0, abort_rate=0.5, seed=0))
        transport = httpx.ASGITransport(app=app)
        continuations = 0
        async with ChatClient(
            "http://sim", model="sim-model", engine=dialect, transport=transport, retry=FAST
        ) as llm:
            for seed in range(6):
                completion = await llm.complete(PROMPT, max_tokens=256, seed=seed)
                assert completion.finish_reason == "stop", (engine, completion)
                assert completion.tokens is not None, f"{dialect} got no ids from the simulated {engine}"
                assert completion.tokens.prompt_ids == prompt_ids
                assert len(completion.tokens.output_logprobs or ()) == len(completion.tokens.output_ids)
                continuations += completion.continuations
        assert continuations, "an aborted answer was continued in the dialect's fields"
