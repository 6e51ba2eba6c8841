"""Single-turn math: the template to copy for a new task.

Copy this file to ``generator/<task>_generator.py``, give it a new ``TASK_TYPE`` and change
what is specific to the task: the prompt, the rollout, the reward. The data set, repeats and
epochs, concurrency, retries, aborted answers, writing to the buffer and progress all come
from ``buffer.toolkit``. Any hook of ``default_func.py`` may be defined here too.
"""

from typing import Any

from buffer.toolkit import MathReward, prompt_messages, run_rollouts

#: The /start_rollout fields read beyond the toolkit's: none (any other is refused with a 422).
START_ROLLOUT_FIELDS: tuple[str, ...] = ()

TASK_TYPE = "math"

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def prompt(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The data set's prompt, with the answer format the reward expects."""
    messages = prompt_messages(row["prompt"])
    last = messages[-1]
    if last["role"] == "user" and isinstance(last["content"], str):
        last["content"] = f"{last['content']}\n{INSTRUCTION}"
    return messages


async def run_rollout(data: dict[str, Any]) -> None:
    """``data`` is the trainer's /start_rollout payload: input_file, remote_engine_url,
    num_repeat_per_sample, num_epoch, num_process, sampling_params, skip_instance_ids, ..."""
    async with MathReward() as reward:  # math-verify: \\frac{1}{2} = 0.5 = 1/2
        await run_rollouts(data, reward=reward, prompt=prompt)
