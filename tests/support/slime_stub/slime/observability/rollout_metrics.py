"""slime's logging of an evaluation's output (slime/observability/rollout_metrics.py and
metric_utils.py), restated: the mean reward per data set, metrics over its samples, the
truncated ratio, and pass@k over groups of ``args.n_samples_per_eval_prompt``; and of a
training step's samples (``log_rollout_data``: the same metrics over samples).
"""

from __future__ import annotations

import math
from typing import Any

from slime.utils.types import Sample


def log_eval_rollout_data(
    rollout_id: int, args: Any, data: dict[str, Any], extra: dict[str, Any] | None
) -> dict[str, Any]:
    log = dict(extra or {})
    for name, result in data.items():
        rewards = result["rewards"]
        log[f"eval/{name}"] = sum(rewards) / len(rewards)
        if (samples := result.get("samples")) is not None:
            log |= {f"eval/{name}/{k}": v for k, v in metrics_from_samples(args, samples).items()}
        if "truncated" in result:
            log[f"eval/{name}-truncated_ratio"] = sum(result["truncated"]) / len(result["truncated"])
        if args.log_passrate:
            rates = pass_rate(rewards, args.n_samples_per_eval_prompt)
            log |= {f"eval/{name}-{k}": v for k, v in rates.items()}
    return log


def log_rollout_data(
    rollout_id: int, args: Any, samples: list[Sample], extra: dict[str, Any] | None, rollout_time: float
) -> dict[str, Any]:
    """A training step's log, as slime writes it before it builds the train data: the samples'
    metrics under ``rollout/``."""
    log = dict(extra or {})
    log |= {f"rollout/{k}": v for k, v in metrics_from_samples(args, samples).items()}
    return log


def metrics_from_samples(args: Any, samples: list[Sample]) -> dict[str, Any]:
    # slime's compute_statistics over the effective lengths (the loss mask's sum when set)
    lengths = sorted(sample.effective_response_length for sample in samples)
    middle = len(lengths) // 2
    median = lengths[middle] if len(lengths) % 2 else (lengths[middle - 1] + lengths[middle]) / 2
    metrics: dict[str, Any] = {
        "response_len/mean": sum(lengths) / len(lengths),
        "response_len/median": median,
        "response_len/max": max(lengths),
        "response_len/min": min(lengths),
    }
    groups: dict[Any, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    metrics["zero_std/groups"] = sum(
        1 for group in groups.values() if len({s.get_reward_value(args) for s in group}) == 1
    )
    metrics["truncated_ratio"] = sum(s.status == Sample.Status.TRUNCATED for s in samples) / len(samples)
    cached = sum(sample.prefix_cache_info.cached_tokens for sample in samples)
    metrics["avg_cached_tokens_per_sample"] = cached / len(samples)
    return metrics


def pass_rate(flat_rewards: list[float], group_size: int) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... up to the group size; a reward of exactly 1 passes."""
    if group_size == 1:
        return {}
    groups = len(flat_rewards) // group_size
    assert len(flat_rewards) == groups * group_size, f"{len(flat_rewards)=} {groups=} {group_size=}"
    rates = {}
    for k in (2**i for i in range(int(math.log2(group_size)) + 1)):
        estimates = []
        for g in range(groups):
            row = flat_rewards[g * group_size : (g + 1) * group_size]
            correct = sum(1 for r in row if r == 1)
            wrong = group_size - correct
            estimates.append(1.0 if wrong < k else 1.0 - math.comb(wrong, k) / math.comb(group_size, k))
        rates[f"pass@{k}"] = sum(estimates) / groups
    return rates
