"""The multi-turn tool loop, with the LLM mocked at the HTTP layer."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from buffer.toolkit.agent import Tool, run_tools
from buffer.toolkit.llm import ChatClient
from buffer.toolkit.types import Sample

pytestmark = pytest.mark.anyio

URL = "http://engine.test/v1/chat/completions"


def reply(content: str | None, *calls: tuple[str, str]) -> httpx.Response:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"call-{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)
        ]
    finish = "tool_calls" if calls else "stop"
    return httpx.Response(200, json={"choices": [{"message": message, "finish_reason": finish}], "usage": {}})


def sample() -> Sample:
    return Sample(
        "q1",
        {"prompt": "Compute 6 * 7.", "label": "42"},
        [{"role": "user", "content": "Compute 6 * 7."}],
        0,
        0,
        11,
    )


def multiply(expression: str) -> str:
    left, right = expression.split("*")
    return str(int(left) * int(right))


async def async_echo(text: str) -> dict[str, str]:
    return {"echo": text}


TOOLS = [
    Tool(
        "calculator",
        "multiply",
        {"type": "object", "properties": {"expression": {"type": "string"}}},
        multiply,
    ),
    Tool("echo", "echo", {"type": "object", "properties": {"text": {"type": "string"}}}, async_echo),
]


@respx.mock
async def test_tool_calls_run_and_return_as_tool_messages_until_the_answer() -> None:
    route = respx.post(URL).mock(
        side_effect=[
            reply(None, ("calculator", '{"expression": "6*7"}'), ("echo", '{"text": "hi"}')),
            reply("It is \\boxed{42}."),
        ]
    )
    async with ChatClient("http://engine.test", transport=httpx.AsyncHTTPTransport()) as llm:
        episode = await run_tools(llm, sample(), TOOLS, max_tokens=64)
    assert episode.finish_reason == "stop"
    assert episode.response == "It is \\boxed{42}."
    roles = [m["role"] for m in episode.messages]
    assert roles == ["user", "assistant", "tool", "tool", "assistant"]
    assert episode.messages[1]["content"] is None  # allowed: it carries tool_calls
    assert episode.messages[2] == {"role": "tool", "tool_call_id": "call-0", "content": "42"}
    assert json.loads(episode.messages[3]["content"]) == {"echo": "hi"}
    first, second = (json.loads(call.request.content) for call in route.calls)
    assert [t["function"]["name"] for t in first["tools"]] == ["calculator", "echo"]
    assert second["messages"][-1]["role"] == "tool"
    assert (first["seed"], second["seed"]) == (11, 12)  # each turn its own deterministic seed


@respx.mock
@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (("nope", "{}"), "error: no tool named 'nope'; tools: calculator, echo"),
        (("calculator", "{not json"), "error: the arguments are not valid JSON"),
        (("calculator", '{"expression": "six*7"}'), "error: ValueError: invalid literal"),
        (("calculator", '{"wrong": 1}'), "error: TypeError"),
    ],
)
async def test_tool_mistakes_are_told_to_the_model(call: tuple[str, str], expected: str) -> None:
    respx.post(URL).mock(side_effect=[reply(None, call), reply("done")])
    async with ChatClient("http://engine.test", transport=httpx.AsyncHTTPTransport()) as llm:
        episode = await run_tools(llm, sample(), TOOLS)
    assert episode.messages[2]["content"].startswith(expected)
    assert episode.finish_reason == "stop"


@respx.mock
async def test_the_loop_stops_at_max_turns() -> None:
    route = respx.post(URL).mock(return_value=reply(None, ("calculator", '{"expression": "1*1"}')))
    async with ChatClient("http://engine.test", transport=httpx.AsyncHTTPTransport()) as llm:
        episode = await run_tools(llm, sample(), TOOLS, max_turns=3)
    assert route.call_count == 3
    assert episode.finish_reason == "max_turns"
    assert len(episode.completions) == 3
