"""An OpenAI-SDK tool-calling agent, trained as it is, through the rollout buffer's gateway.

``calculator_agent`` is an ordinary agent loop written against the ``openai`` package (streamed
answers, a calculator tool): nothing in it knows about RL. ``run_rollout`` runs it against a
fresh gateway session per sample (``gateway_session``), which records every call with its
token ids, and scores the answer; ending the session writes the trajectory to its group, in the
job's task: ``data["task_type"]``, which is the ``rollout_name`` when the trainer gave one.

It needs the ``openai`` package: ``pip install 'rollout-buffer[openai]'`` (the ``dev`` extra has
it too). The import is inside the agent, so the service loads this file on any install; without
the package a job of this task fails with ``ModuleNotFoundError: No module named 'openai'``.
"""

import asyncio
import json
from pathlib import Path
from typing import Any

from buffer.toolkit import calculate, gateway_session, read_rows

TASK_TYPE = "openai_agent"

DATA = Path(__file__).parent / "data" / "calculator.jsonl"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with integers, + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


async def calculator_agent(base_url: str, api_key: str, question: str, max_turns: int = 4) -> str:
    """The agent: any OpenAI-compatible server would do."""
    from openai import AsyncOpenAI  # the openai extra; see the module's docstring

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the calculator, then state the result."},
        {"role": "user", "content": question},
    ]
    try:
        for _ in range(max_turns):
            stream = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=TOOLS,
                stream=True,  # type: ignore[arg-type]
            )
            content, calls = "", {}
            async for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is None:
                    continue
                content += delta.content or ""
                for call in delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                    if call.function is not None:
                        entry["name"] += call.function.name or ""
                        entry["arguments"] += call.function.arguments or ""
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
            messages.append(
                {"role": "assistant", "content": content or None, "tool_calls": tool_calls or None}
            )
            if not tool_calls:
                return content
            for call in tool_calls:
                expression = json.loads(call["function"]["arguments"]).get("expression", "")
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": calculate(expression)}
                )
        return content
    finally:
        await client.close()


async def run_rollout(data: dict[str, Any]) -> None:
    rows = await asyncio.to_thread(read_rows, data.get("input_file") or DATA)
    repeats = int(data.get("num_repeat_per_sample") or 1)
    limit = asyncio.Semaphore(int(data.get("num_process") or 16))

    async def one(row: dict[str, Any]) -> None:
        async with (
            limit,
            gateway_session(
                data.get("remote_buffer_url"),
                data.get("task_type") or TASK_TYPE,  # the rollout_name this job runs under, if any
                row["instance_id"],
                remote_engine_url=data.get("remote_engine_url"),
                metadata={"label": row.get("label")},
            ) as session,
        ):
            answer = await calculator_agent(session.base_url, session.api_key, row["prompt"])
            session.reward = 1.0 if str(row.get("label")) in answer else 0.0

    for _ in range(int(data.get("num_epoch") or 1)):
        await asyncio.gather(*(one(row) for row in rows for _ in range(repeats)))
