"""The simulator's fast path for the generation routes (``buffer.simulator.front``): the same
answers as FastAPI's routes, errors included, without going through FastAPI's stack."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.front import SimApp

pytestmark = pytest.mark.anyio

QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]
VOLATILE = {"id", "created", "e2e_latency"}  # a fresh uuid, the clock

JSON = {"content-type": "application/json"}
# (path, raw body, headers): valid requests, and every way one can be refused.
CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "What is 17 + 25?"}]}', JSON),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "What is 2 * 3?"}],'
        b' "logprobs": true, "top_logprobs": 2, "return_token_ids": true,'
        b' "return_prompt_token_ids": true, "seed": 3, "n": 2}',
        {"content-type": "application/json; charset=utf-8"},
    ),
    ("/v1/chat/completions", b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}', JSON),
    ("/v1/chat/completions", b'{"messages": []}', JSON),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "hi"}], "n": 0}', JSON),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}', JSON),  # not JSON
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": NaN}]}', JSON),  # Python's JSON
    ("/v1/chat/completions", b"[1, 2]", JSON),
    ("/v1/chat/completions", b"", JSON),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}', {}),  # no content type
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}]}',
        {"content-type": "text/plain"},
    ),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]}', JSON),
    # Python's reading and pydantic's JSON mode agree: lax numbers and booleans, duplicate keys.
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "n": 2.0, "max_tokens": "9",'
        b' "logprobs": 1, "seed": 7, "seed": 8, "return_token_ids": "true"}',
        JSON,
    ),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\u00e9?"}]}', JSON),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 1.5}', JSON),
    ("/v1/completions", b'{"model": "sim-model", "prompt": [1, 2, 3], "max_tokens": 8, "logprobs": 0}', JSON),
    ("/v1/completions", b'{"prompt": [1, 2, 3], "max_tokens": 0}', JSON),
    ("/v1/completions", b'{"prompt": [-1]}', JSON),
    ("/v1/completions", b'{"max_tokens": 8}', JSON),
    (
        "/generate",
        b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}, "return_logprob": true}',
        JSON,
    ),
    ("/generate", b'{"input_ids": "abc"}', JSON),
    ("/generate", b'{"input_ids": []}', JSON),
    ("/generate", b'{"input_ids": [1, 2], "sampling_params": 3}', {"content-type": "application/vnd.x+json"}),
    ("/generate/", b'{"input_ids": [1, 2, 3]}', JSON),  # FastAPI's redirect
]


def strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: strip(item) for key, item in value.items() if key not in VOLATILE}
    if isinstance(value, list):
        return [strip(item) for item in value]
    return value


async def answers(app: SimApp) -> list[tuple[int, str, Any]]:
    results = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        for path, body, headers in CASES:
            response = await client.post(path, content=body, headers=headers)
            try:
                content: Any = strip(response.json())
            except ValueError:
                content = response.text
            results.append((response.status_code, response.headers.get("content-type", ""), content))
        results.append((0, "", (await client.get("/stats")).json()))
    return results


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_front_answers_as_fastapi_s_routes_do_errors_included(engine: str) -> None:
    config = SimConfig(latency_mean_s=0.0, seed=0, engine=engine)
    fast = create_sim_app(config)
    slow = create_sim_app(config)
    slow.fast_routes.clear()  # every request through FastAPI, as before the front
    expected = await answers(slow)
    assert [status for status, _, _ in expected][:3] == [200, 200, 404 if engine == "vllm" else 200]
    assert await answers(fast) == expected


class Counting:
    """An ASGI middleware that notes the paths FastAPI's stack sees."""

    def __init__(self, app: ASGIApp, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append(scope["path"])
        await self.app(scope, receive, send)


async def test_a_valid_generation_request_skips_fastapi_s_stack_and_an_invalid_one_goes_through_it() -> None:
    app = create_sim_app(SimConfig(latency_mean_s=0.0, seed=0))
    seen: list[str] = []
    app.add_middleware(Counting, seen=seen)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
        assert (await client.post("/v1/chat/completions", json={"messages": QUESTION})).status_code == 200
        assert (await client.post("/generate", json={"input_ids": [1, 2, 3]})).status_code == 200
        assert (await client.post("/v1/completions", json={"prompt": [1, 2, 3]})).status_code == 200
        assert seen == []
        assert (await client.post("/v1/chat/completions", json={"messages": []})).status_code == 400
        assert (await client.get("/health")).status_code == 200
    assert seen == ["/v1/chat/completions", "/health"]
