"""Rewards a generator can use as they are.

- ``MathReward``: the final (boxed) answer is mathematically the label (math-verify);
- ``choice_reward``: the chosen option letter is the label;
- ``RemoteRewardModel``: a reward model behind HTTP, called in batches;
- ``extract_boxed``: the content of the last ``\\boxed{...}``, for rewards of your own.
"""

from buffer.toolkit.rewards.answers import extract_boxed
from buffer.toolkit.rewards.choice import choice_reward
from buffer.toolkit.rewards.math_reward import MathReward
from buffer.toolkit.rewards.reward_model import RemoteRewardModel, RewardModelError

__all__ = ["MathReward", "RemoteRewardModel", "RewardModelError", "choice_reward", "extract_boxed"]
