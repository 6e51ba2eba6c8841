"""What the simulator tests share: the simulator's tokenizer as a client builds it, an app in
process, and a chat completion through it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI
from openai import AsyncOpenAI

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.tokenizer import build_tokenizer
from tests.support.paths import REPO

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


THINKER = build_tokenizer(thinking=True)
THINK_ID = THINKER.convert_tokens_to_ids("<think>")


async def stats_of(app: FastAPI) -> dict[str, Any]:
    async with client_for(app) as client:
        return dict((await client.get("/stats")).json())


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
