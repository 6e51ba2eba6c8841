"""The generator toolkit: everything a generator needs but its prompt, loop and reward.

from buffer.toolkit import MathReward, run_rollouts

TASK_TYPE = "math"

async def run_rollout(data):
    async with MathReward() as reward:
        await run_rollouts(data, reward=reward)
"""

from buffer.toolkit.agent import Tool, run_tools, single_turn
from buffer.toolkit.dataset import Plan, derive_seed, prompt_messages, read_rows
from buffer.toolkit.llm import ChatClient, ContinuePolicy, LLMError, RetryPolicy
from buffer.toolkit.rewards import (
    MathReward,
    RemoteRewardModel,
    RewardModelError,
    choice_reward,
    extract_boxed,
)
from buffer.toolkit.runner import Progress, RolloutSettings, run_rollouts
from buffer.toolkit.sink import HttpSink, LocalSink, open_sink
from buffer.toolkit.types import Completion, Episode, Sample

__all__ = [
    "ChatClient",
    "Completion",
    "ContinuePolicy",
    "Episode",
    "HttpSink",
    "LLMError",
    "LocalSink",
    "MathReward",
    "Plan",
    "Progress",
    "RemoteRewardModel",
    "RetryPolicy",
    "RewardModelError",
    "RolloutSettings",
    "Sample",
    "Tool",
    "choice_reward",
    "derive_seed",
    "extract_boxed",
    "open_sink",
    "prompt_messages",
    "read_rows",
    "run_rollouts",
    "run_tools",
    "single_turn",
]
