"""The policy-server client: retries, aborted answers, the answer's parts. LLM mocked with respx."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import respx

from buffer.toolkit.llm import ChatClient, ContinuePolicy, LLMError, LLMStats, RetryPolicy, engine_base_url

pytestmark = pytest.mark.anyio

URL = "http://engine.test/v1/chat/completions"
PROMPT = [{"role": "user", "content": "What is 1 + 1?"}]
FAST = RetryPolicy(max_attempts=4, backoff_s=0.001, max_backoff_s=0.01)


def answer(
    content: str | None = "\\boxed{2}",
    finish: str = "stop",
    tokens: int = 3,
    tool_calls: list[dict[str, Any]] | None = None,
    **choice: Any,
) -> httpx.Response:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
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
    assert 0.25 <= time.monotonic() - started < 2.0  # stopped near the budget, not at a count
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
async def test_tool_calls_token_ids_and_logprobs_are_kept() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
    }
    logprobs = {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.25}]}
    respx.post(URL).mock(
        return_value=answer(None, "tool_calls", tool_calls=[call], token_ids=[5, 6], logprobs=logprobs)
    )
    async with client() as llm:
        completion = await llm.complete(
            PROMPT, tools=[{"type": "function", "function": {"name": "calculator"}}]
        )
    assert completion.tool_calls == [call]
    assert completion.message() == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert completion.token_ids == [5, 6]
    assert completion.logprobs == [-0.5, -0.25]


@respx.mock
async def test_an_answer_without_choices_is_an_error() -> None:
    respx.post(URL).mock(return_value=httpx.Response(200, json={"error": "nope"}))
    async with client() as llm:
        with pytest.raises(LLMError, match="no choices"):
            await llm.complete(PROMPT)
