"""slime's pass-rate logging on the train side (slime/observability/train_metric_utils.py
``log_passrate`` and metric_utils.py ``compute_pass_rate``), restated: the step's ``raw_reward``
reshaped into ``rollout_batch_size`` groups of ``n_samples_per_prompt``, with slime's assertion.
"""

from __future__ import annotations

from typing import Any

from slime.observability.rollout_metrics import pass_rate


def log_passrate(args: Any, train_data: dict[str, Any]) -> dict[str, float]:
    flat_rewards = list(train_data["raw_reward"])
    group_size = args.n_samples_per_prompt
    num_groups = args.rollout_batch_size
    if group_size == 1:
        return {}
    assert len(flat_rewards) == num_groups * group_size, f"{len(flat_rewards)=} {num_groups=} {group_size=}"
    return pass_rate(flat_rewards, group_size)
