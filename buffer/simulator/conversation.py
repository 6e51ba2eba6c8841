"""The conversation as the simulated model sees it, and its own output read back.

Two directions, both of the ChatML format the simulator's chat template writes:

- ``parse_prompt(text)``: a rendered prompt (decoded from the token ids of a ``/generate`` or a
  token-id ``/v1/completions`` request) back into messages and tools: the ``<tools>`` block of
  the system turn, user turns whose body is only ``<tool_response>`` blocks as tool results,
  ``<think>`` and ``<tool_call>`` blocks of assistant turns. An assistant turn left open at the
  end (no ``<|im_end|>`` after it) is the reply being written, not history.
- ``parse_output(text, thinking)``: the model's raw output split as an engine's reasoning and
  tool-call parsers split it (Qwen3's ``<think>``, Hermes' ``<tool_call>``): reasoning, content,
  tool calls. An unfinished ``<tool_call>`` stays in the content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what the template writes when thinking is switched off

_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class SimMessage:
    """One message, whichever way it came: from a chat request or from a rendered prompt."""

    role: str
    text: str
    tool_calls: list[Call] = field(default_factory=list)
    reasoning: str | None = None


@dataclass(slots=True)
class Conversation:
    """The messages and tools of a prompt; an open assistant turn at its end is not among them
    (``SimModel.open_reply`` finds it, by its token ids)."""

    messages: list[SimMessage]
    tools: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Output:
    reasoning: str | None
    content: str | None
    tool_calls: list[Call]


def parse_prompt(text: str) -> Conversation:
    """The conversation a rendered ChatML prompt holds (see the module docstring)."""
    messages: list[SimMessage] = []
    tools: list[dict[str, Any]] = []
    blocks = text.split(IM_START)[1:]
    for index, block in enumerate(blocks):
        role, _, body = block.partition("\n")
        closed = IM_END in body
        body = body.split(IM_END, 1)[0]
        if not closed and index == len(blocks) - 1 and role == "assistant":
            continue  # the reply being written
        if role == "system":
            tools_block = _TOOLS_BLOCK.search(body)
            if tools_block:
                tools = [json.loads(line) for line in tools_block.group(1).splitlines() if line.strip()]
                body = body.split("# Tools", 1)[0].rstrip("\n")
            messages.append(SimMessage("system", body))
        elif role == "user" and body.startswith("<tool_response>"):
            messages.extend(SimMessage("tool", result) for result in _TOOL_RESPONSE.findall(body))
        elif role == "assistant":
            output = parse_output(body, thinking=body.startswith(THINK_START))
            messages.append(
                SimMessage("assistant", output.content or "", output.tool_calls, output.reasoning)
            )
        else:
            messages.append(SimMessage(role, body))
    return Conversation(messages, tools)


def parse_output(text: str, thinking: bool) -> Output:
    """Reasoning, content and tool calls of the model's raw output (see the module docstring)."""
    reasoning: str | None = None
    rest = text
    if thinking and text.startswith(THINK_START):
        inner = text[len(THINK_START) :]
        if THINK_END in inner:
            thought, _, rest = inner.partition(THINK_END)
            reasoning, rest = thought.strip("\n"), rest.lstrip("\n")
        else:  # cut off while reasoning
            reasoning, rest = inner.lstrip("\n"), ""
    calls = []
    for match in _TOOL_CALL.finditer(rest):
        try:
            call = json.loads(match.group(1))
            calls.append(Call(str(call["name"]), dict(call.get("arguments") or {})))
        except (ValueError, KeyError, TypeError):
            calls = []
            break
    if calls:
        content = rest.split("<tool_call>", 1)[0].strip() or None
        return Output(reasoning, content, calls)
    return Output(reasoning, rest if rest or reasoning is None else None, [])
