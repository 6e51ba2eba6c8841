"""The engine clients' default transport, aiohttp called directly, against a loopback server:
the retry budget, Retry-After, refusals and failure kinds behave as through httpx (test_llm)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from buffer.toolkit.llm import ChatClient, LLMError, RetryPolicy

pytestmark = pytest.mark.anyio

PROMPT = [{"role": "user", "content": "What is 1 + 1?"}]
FAST = RetryPolicy(max_attempts=4, backoff_s=0.001, max_backoff_s=0.01)
OK = {"choices": [{"message": {"role": "assistant", "content": "2"}, "finish_reason": "stop"}]}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[list[Handler]], Awaitable[str]]]:
    """Serves the given handlers in turn for the chat route (the last one from then on)."""
    runners: list[web.AppRunner] = []

    async def start(handlers: list[Handler]) -> str:
        calls = iter(handlers)
        last: list[Handler] = []

        async def chat(request: web.Request) -> web.StreamResponse:
            handler = next(calls, None)
            if handler is None:
                handler = last[0]
            last[:] = [handler]
            return await handler(request)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


def status(code: int, body: str = "", **headers: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=code, text=body, headers=headers)

    return handler


async def ok(request: web.Request) -> web.StreamResponse:
    return web.json_response(OK)


async def test_retry_after_is_honoured_through_aiohttp(serve: Callable[..., Awaitable[str]]) -> None:
    url = await serve([status(429, "slow down", **{"Retry-After": "0.3"}), ok])
    started = time.monotonic()
    async with ChatClient(url, retry=FAST) as llm:
        completion = await llm.complete(PROMPT)
    assert time.monotonic() - started >= 0.3
    assert (completion.text, completion.attempts) == ("2", 2)
    assert llm.stats.failures_by_kind == Counter({"HTTP 429": 1})


async def test_a_refusal_carries_the_engines_status_and_words(serve: Callable[..., Awaitable[str]]) -> None:
    body = '{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}'
    url = await serve([status(404, body)])
    async with ChatClient(url, retry=FAST) as llm:
        with pytest.raises(LLMError) as raised:
            await llm.complete(PROMPT)
    assert raised.value.status == 404
    assert raised.value.engine_message == "The model `x` does not exist."
    assert llm.stats.requests == 1


async def test_failure_kinds_keep_httpx_names(serve: Callable[..., Awaitable[str]]) -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(2)
        return web.json_response(OK)

    url = await serve([status(503), status(200, "not json"), slow, ok])
    async with ChatClient(url, retry=FAST, timeout_s=0.2) as llm:
        with pytest.raises(LLMError, match="invalid JSON"):
            await llm.complete(PROMPT)  # 503 retried, then an answer that is no JSON
        assert (await llm.complete(PROMPT)).attempts == 2  # timed out, then answered
    assert llm.stats.failures_by_kind == Counter({"HTTP 503": 1, "invalid JSON": 1, "ReadTimeout": 1})


async def test_a_refused_connection_is_a_connect_error_retried_within_the_budget() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    retry = RetryPolicy(max_retry_s=0.3, backoff_s=0.001, max_backoff_s=0.02)
    async with ChatClient(f"http://127.0.0.1:{port}", retry=retry) as llm:
        with pytest.raises(LLMError, match=r"failed [0-9]+ times over [0-9.]+ s; last: ConnectError"):
            await llm.complete(PROMPT)
    assert set(llm.stats.failures_by_kind) == {"ConnectError"}
    assert llm.stats.requests > 3
