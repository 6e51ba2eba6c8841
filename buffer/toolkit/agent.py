"""Rollouts: one answer, or a multi-turn loop with tools.

A tool is an OpenAI function schema and a Python callable (sync or async) that takes the
call's arguments as keyword arguments. The model's ``tool_calls`` run and come back as
``tool`` messages until the model answers without calling a tool, or ``max_turns`` is
reached. The conversation stays in OpenAI's format, so the trainer can tell the model's
turns from the tools' output and mask the latter; each completion is handed the previous one,
so a token-in/token-out client extends the prompt's ids instead of rendering it again.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from buffer.toolkit.llm import EngineClient
from buffer.toolkit.types import Completion, Episode, Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON Schema of the arguments
    fn: Callable[..., Any]

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def __call__(self, arguments: dict[str, Any]) -> str:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**arguments)
        else:
            result = await asyncio.to_thread(self.fn, **arguments)  # a tool may block: not on the loop
        return result if isinstance(result, str) else json.dumps(result)


async def single_turn(llm: EngineClient, sample: Sample, **sampling: Any) -> Episode:
    """One answer to the prompt."""
    completion = await llm.complete(sample.messages, seed=sample.seed, **sampling)
    return Episode([*sample.messages, completion.message()], completion.finish_reason, [completion])


async def run_tools(
    llm: EngineClient,
    sample: Sample,
    tools: Sequence[Tool],
    *,
    max_turns: int = 8,
    **sampling: Any,
) -> Episode:
    """Let the model call ``tools`` until it answers, for at most ``max_turns`` answers.

    A tool that raises, an unknown tool or arguments that are not JSON become a tool message
    saying so: the model sees its mistake, as it would from a real environment.
    """
    by_name = {tool.name: tool for tool in tools}
    schemas = [tool.schema for tool in tools]
    messages = list(sample.messages)
    completions: list[Completion] = []
    for turn in range(max_turns):
        previous = completions[-1] if completions else None
        completion = await llm.complete(
            messages, tools=schemas, seed=sample.seed + turn, previous=previous, **sampling
        )
        completions.append(completion)
        messages.append(completion.message())
        if not completion.tool_calls or completion.finish_reason in ("length", "abort"):
            return Episode(messages, completion.finish_reason, completions, schemas)
        for call in completion.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.get("id", ""),
                    "content": await _call_tool(by_name, call),
                }
            )
    return Episode(messages, "max_turns", completions, schemas)


async def _call_tool(tools: dict[str, Tool], call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    name = function.get("name")
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None:
        return f"error: no tool named {name!r}; tools: {', '.join(sorted(tools))}"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as exc:
        return f"error: the arguments are not valid JSON: {exc}"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    try:
        return await tool(arguments)
    except Exception as exc:
        logger.debug("tool %s raised", name, exc_info=True)
        return f"error: {type(exc).__name__}: {exc}"
