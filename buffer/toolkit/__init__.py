"""The generator toolkit: everything a generator needs but its prompt, loop and reward.

from buffer.toolkit import MathReward, run_rollouts

TASK_TYPE = "math"

async def run_rollout(data):
    async with MathReward() as reward:
        await run_rollouts(data, reward=reward)

What every generator imports, so it pulls in nothing of the service's side: it may import
``buffer.policy`` (the gate its engine requests pass) and the shared leaves; never the service,
the store, the workers or the trainer (``.importlinter``). It reaches the job it runs in through
``buffer.current``: the service hands a job in its own process a writer and its lease board.
"""

from buffer.toolkit.agent import Tool, run_tools, single_turn
from buffer.toolkit.arithmetic import calculate
from buffer.toolkit.dataset import Plan, derive_seed, prompt_messages, read_rows
from buffer.toolkit.failfast import MisconfiguredEngine
from buffer.toolkit.gateway import GatewayError, GatewaySession, gateway_session
from buffer.toolkit.llm import ChatClient, ContinuePolicy, EngineClient, LLMError, RetryPolicy
from buffer.toolkit.records import turn_records
from buffer.toolkit.rewards import (
    MathReward,
    RemoteRewardModel,
    RewardModelError,
    choice_reward,
    extract_boxed,
)
from buffer.toolkit.runner import Progress, RolloutSettings, policy_client, run_rollouts
from buffer.toolkit.sink import HttpSink, open_sink
from buffer.toolkit.tito import (
    TemplateError,
    TokenClient,
    TokenizerMissing,
    TokenRenderer,
    hermes_tool_calls,
    load_tokenizer,
    split_reasoning,
)
from buffer.toolkit.types import Completion, Episode, Sample, TokenCapture

__all__ = [
    "ChatClient",
    "Completion",
    "ContinuePolicy",
    "EngineClient",
    "Episode",
    "GatewayError",
    "GatewaySession",
    "HttpSink",
    "LLMError",
    "MathReward",
    "MisconfiguredEngine",
    "Plan",
    "Progress",
    "RemoteRewardModel",
    "RetryPolicy",
    "RewardModelError",
    "RolloutSettings",
    "Sample",
    "TemplateError",
    "TokenCapture",
    "TokenClient",
    "TokenRenderer",
    "TokenizerMissing",
    "Tool",
    "calculate",
    "choice_reward",
    "derive_seed",
    "extract_boxed",
    "gateway_session",
    "hermes_tool_calls",
    "load_tokenizer",
    "open_sink",
    "policy_client",
    "prompt_messages",
    "read_rows",
    "run_rollouts",
    "run_tools",
    "single_turn",
    "split_reasoning",
    "turn_records",
]
