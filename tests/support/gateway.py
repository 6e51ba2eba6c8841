"""What the gateway's tests share: the engines they run against (a process on a loopback port, or
in-process behind a transport that keeps what it was sent), a session opened and driven by an
unmodified OpenAI-SDK agent, and its trajectories read and checked as the trainer takes them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from buffer.processes import free_port, started, wait_ready
from buffer.service.gateway.proxy import EngineProxy
from buffer.toolkit import calculate
from buffer.trainer.samples.turns import samples_from_turns
from tests.support.sdk import streamed_message

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


# -- engines -------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Iterator[str]:
    """``python <args>`` on a free loopback port (``--host``/``--port`` added) once it answers
    ``/health``: its URL, until the block ends and stops it."""
    port = free_port()
    command = [sys.executable, *args, "--host", "127.0.0.1", "--port", str(port)]
    with started(command, name, tmp_path_factory.mktemp(name) / f"{name}.log") as running:
        wait_ready(f"http://127.0.0.1:{port}/health", running, 60, name)
        yield f"http://127.0.0.1:{port}"


def engine_log(engine: str) -> list[dict[str, Any]]:
    """What the loopback engine process sampled, every call since it started."""
    log: list[dict[str, Any]] = httpx.get(f"{engine}/log").json()
    return log


class HeldEngine(httpx.AsyncBaseTransport):
    """An engine's app in-process: every body it was sent, answers held while ``held``."""

    def __init__(self, app: Any) -> None:
        self.transport = httpx.ASGITransport(app)
        self.bodies: list[dict[str, Any]] = []
        self.held = False
        self.cancelled = 0
        self._release: asyncio.Event | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(httpx.Response(200, content=await request.aread()).json())
        if self.held:
            self._release = self._release or asyncio.Event()
            try:
                await self._release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await self.transport.handle_async_request(request)

    def release(self) -> None:  # in the app's loop
        self.held = False
        if self._release is not None:
            self._release.set()


def proxied_to(client: TestClient, engine: str, transport: httpx.AsyncBaseTransport) -> TestClient:
    """The service's gateway sending every call through ``transport``, as engine ``engine``."""
    client.app.state.gateway.proxy = EngineProxy(engine=engine, transport=transport)  # type: ignore[attr-defined]
    return client


# -- sessions --------------------------------------------------------------------------------------


def open_session(client: TestClient, engine: str, instance_id: str = "q1", **extra: Any) -> dict[str, Any]:
    body = {"task_type": "agent", "instance_id": instance_id, "remote_engine_url": engine, **extra}
    response = client.post("/sessions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()["data"]
    return data


def sdk(client: TestClient, session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=session["base_url"], api_key=session["api_key"], http_client=client, max_retries=0
    )


def calculator_agent(client: openai.OpenAI, question: str, *, stream: bool) -> str:
    """An ordinary OpenAI-SDK tool-calling loop; nothing in it knows about the gateway. Streamed,
    it streams from the gateway, which asks the engine without streaming: the stand-in refuses
    token ids with streaming, as SGLang does."""
    messages: list[Any] = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": question},
    ]
    for _ in range(4):
        if stream:
            message, tool_calls = streamed_message(
                client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, stream=True, temperature=0.7
                )
            )
            messages.append(message)
            content = message["content"] or ""
        else:
            reply = (
                client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, temperature=0.7
                )
                .choices[0]
                .message
            )
            messages.append(reply)  # the SDK's own message object, as agents do
            content = reply.content or ""
            tool_calls = [call.model_dump() for call in reply.tool_calls or ()]
        if not tool_calls:
            return content
        for call in tool_calls:
            expression = json.loads(call["function"]["arguments"])["expression"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(expression)})
    return content


# -- what the trainer reads ------------------------------------------------------------------------


def session_trajectories(buffer: httpx.Client | str, *instance_ids: str) -> list[dict[str, Any]]:
    """The sessions' trajectories as the trainer reads them (``q1``'s when none is named): each in
    a group of two, with a plain trajectory of reward 0 beside it (the default pipeline keeps
    groups whose rewards differ). ``buffer``: the service's test client, or its URL."""
    if isinstance(buffer, str):
        with httpx.Client(base_url=buffer) as client:
            return session_trajectories(client, *instance_ids)
    for instance_id in instance_ids or ("q1",):
        companion = {"instance_id": instance_id, "task_type": "agent", "reward": 0.0}
        companion["messages"] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        written = buffer.post("/buffer/write", json=companion)
        assert written.status_code == 200, written.text
    body = buffer.post("/get_rollout_data", json={"task_type": "agent"}).json()
    assert body["success"], body
    items: list[dict[str, Any]] = body["data"]["data"]
    return [item for item in items if str(item["uid"]).startswith("session-")]


def turns_as_calls(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """A trajectory's turns in the loopback engine's log's shape."""
    return [
        {"prompt_ids": t["prompt_ids"], "output_ids": t["output_ids"], "logprobs": t["output_logprobs"]}
        for t in trajectory["turns"]
    ]


def assert_token_faithful(trajectory: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """The trained sample is the engine's prompts and samples, masked and logprobbed exactly."""
    (sample,) = samples_from_turns(trajectory, 1.0, 1.0)
    prompt_length = len(calls[0]["prompt_ids"])
    assert sample.tokens[:prompt_length] == calls[0]["prompt_ids"]
    expected_mask: list[int] = []
    expected_logprobs: list[float] = []
    held = calls[0]["prompt_ids"]
    for call in calls:
        assert call["prompt_ids"][: len(held)] == held  # the stand-in's prompts extend
        new = call["prompt_ids"][len(held) :]
        expected_mask += [0] * len(new) + [1] * len(call["output_ids"])
        expected_logprobs += [0.0] * len(new) + call["logprobs"]
        held = call["prompt_ids"] + call["output_ids"]
    assert sample.tokens == held
    assert sample.loss_mask == expected_mask
    if all(turn.get("logprobs") == "sampling" for turn in trajectory["turns"]):
        assert sample.rollout_log_probs == expected_logprobs
    else:  # not known to be the sampling distribution's (the agent's temperature, fields it left unset)
        assert sample.rollout_log_probs is None
        assert sample.log_probs_withheld
    assert sample.response_length == len(expected_mask)
