"""Multi-turn tool use: the model may call a calculator before it answers.

The rollout is ``run_tools``: the model's tool calls run and come back as ``tool`` messages
until it answers or ``max_turns`` is reached; the conversation stays in OpenAI's format, so
the trainer masks the tool output. Without an ``input_file``, the task uses its own data set,
``generator/data/calculator.jsonl``.
"""

import functools
from pathlib import Path
from typing import Any

from buffer.toolkit import MathReward, Tool, calculate, run_rollouts, run_tools

TASK_TYPE = "calculator"

DATA = Path(__file__).parent / "data" / "calculator.jsonl"

#: The /start_rollout fields read beyond the toolkit's: none (any other is refused with a 422).
START_ROLLOUT_FIELDS: tuple[str, ...] = ()


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression with integers, + - * / and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
        "required": ["expression"],
    },
    fn=calculate,
)


async def run_rollout(data: dict[str, Any]) -> None:
    data = {"input_file": str(DATA), **data}
    rollout = functools.partial(run_tools, tools=[CALCULATOR], max_turns=4)
    async with MathReward() as reward:
        await run_rollouts(data, reward=reward, rollout=rollout)
