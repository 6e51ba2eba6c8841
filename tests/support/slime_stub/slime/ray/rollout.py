"""What slime's ``RolloutManager`` does with a rollout function's training output
(slime/ray/rollout.py, with the rollout-id check and the tensor conversion of
slime/observability/rollout_data_utils.py), restated without Ray, torch or GPUs.

``generate`` follows slime's order: call the function, check the rollout ids of split
rollouts, flatten the groups, post-process the rewards, build the train-data dict (with the
top-p assertion) and convert its per-sample lists to tensors. Where slime fails, this fails
the same way: ``torch.as_tensor(None)`` is a TypeError, an assertion is an AssertionError.
"""

from __future__ import annotations

import importlib
import itertools
import math
from typing import Any

from slime.rollout.base_types import call_rollout_fn
from slime.utils.types import Sample

GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_NORMALISED = ("grpo", "gspo", "cispo")
TENSOR_KEYS = (
    "tokens",
    "loss_masks",
    "rollout_log_probs",
    "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets",
)


def load_function(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def generate(
    args: Any, rollout_fn: Any, rollout_id: int, data_source: Any
) -> tuple[list[Sample], dict[str, Any]]:
    """One training step's rollout: the flat samples and the tensorised train data."""
    output = call_rollout_fn(rollout_fn, args, rollout_id, data_source, evaluation=False)
    data = output.samples
    validate_rollout_id_annotated(data)
    while isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    train_data = convert_samples_to_train_data(args, data)
    check_train_side(args, train_data)
    tensorize(train_data)
    return data, train_data


def validate_rollout_id_annotated(node: Any, depth: int = 0) -> None:
    """Lists of samples nested below a group (one rollout split in several samples) must
    carry one shared, set ``rollout_id``."""
    if isinstance(node, Sample):
        return
    assert isinstance(node, list), f"unexpected node in the rollout output: {type(node).__name__}"
    if node and isinstance(node[0], Sample):
        if depth >= 2 and len(node) > 1:
            ids = [sample.rollout_id for sample in node]
            assert None not in ids, f"siblings of one rollout without rollout_id: {ids}"
            assert len(set(ids)) == 1, f"siblings of one rollout must share rollout_id: {ids}"
        return
    for child in node:
        validate_rollout_id_annotated(child, depth + 1)


def post_process_rewards(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    if getattr(args, "custom_reward_post_process_path", None):
        result: tuple[list[float], list[float]] = load_function(args.custom_reward_post_process_path)(
            args, samples
        )
        return result
    raw = [sample.get_reward_value(args) for sample in samples]
    if args.advantage_estimator not in GROUP_NORMALISED or not args.rewards_normalization:
        return raw, raw
    n = args.n_samples_per_prompt
    # Rows of n when the count is exactly n per group; otherwise the whole batch is one row.
    width = n if len(raw) == n * args.rollout_batch_size else len(raw)
    rewards: list[float] = []
    for start in range(0, len(raw), width):
        row = raw[start : start + width]
        mean = sum(row) / len(row)
        centred = [r - mean for r in row]
        if args.advantage_estimator in STD_NORMALISED and args.grpo_std_normalization:
            std = math.sqrt(sum(c * c for c in centred) / (len(row) - 1)) if len(row) > 1 else math.nan
            centred = [c / (std + 1e-6) for c in centred]
        rewards += centred
    return raw, rewards


def convert_samples_to_train_data(args: Any, samples: list[Sample]) -> dict[str, Any]:
    raw_rewards, rewards = post_process_rewards(args, samples)
    assert len(raw_rewards) == len(rewards) == len(samples)
    rollout_ids = [sample.rollout_id for sample in samples]
    taken = {rid for rid in rollout_ids if rid is not None}
    fresh = 0
    for i, rid in enumerate(rollout_ids):
        if rid is None:
            while fresh in taken:
                fresh += 1
            rollout_ids[i] = fresh
            taken.add(fresh)
    train_data: dict[str, Any] = {
        "tokens": [sample.tokens for sample in samples],
        "response_lengths": [sample.response_length for sample in samples],
        "rewards": rewards,
        "raw_reward": raw_rewards,
        "truncated": [int(sample.status == Sample.Status.TRUNCATED) for sample in samples],
        "sample_indices": [sample.index for sample in samples],
        "rollout_ids": rollout_ids,
    }
    loss_masks = []
    for sample in samples:
        if sample.loss_mask is None:
            sample.loss_mask = [1] * sample.response_length
        assert len(sample.loss_mask) == sample.response_length, "loss mask length != response length"
        if sample.remove_sample:
            sample.loss_mask = [0] * sample.response_length
        loss_masks.append(sample.loss_mask)
    train_data["loss_masks"] = loss_masks
    if any(sample.metadata and "raw_reward" in sample.metadata for sample in samples):
        train_data["raw_reward"] = [
            sample.metadata["raw_reward"]
            if sample.metadata and "raw_reward" in sample.metadata
            else sample.reward
            for sample in samples
        ]
    if samples[0].metadata and "round_number" in samples[0].metadata:
        train_data["round_number"] = [sample.metadata["round_number"] for sample in samples]
    # Whether the batch has rollout log probs is read off its first sample.
    if samples[0].rollout_log_probs is not None:
        train_data["rollout_log_probs"] = [sample.rollout_log_probs for sample in samples]
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        for sample in samples:
            assert sample.rollout_top_p_token_ids is not None
            assert sample.rollout_top_p_token_offsets is not None
            assert len(sample.rollout_top_p_token_offsets) == sample.response_length + 1
            assert sample.rollout_top_p_token_offsets[-1] == len(sample.rollout_top_p_token_ids)
        train_data["rollout_top_p_token_ids"] = [sample.rollout_top_p_token_ids for sample in samples]
        train_data["rollout_top_p_token_offsets"] = [sample.rollout_top_p_token_offsets for sample in samples]
    # The pixels a VLM trains on: only this field reaches the trainer (not multimodal_inputs).
    if any(sample.multimodal_train_inputs is not None for sample in samples):
        train_data["multimodal_train_inputs"] = [sample.multimodal_train_inputs for sample in samples]
    return train_data


def check_train_side(args: Any, train_data: dict[str, Any]) -> None:
    """What the loss asks of the batch: TIS and the mismatch metrics need rollout log probs,
    --use-rollout-logprobs reads them as the old log probs."""
    if getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False):
        assert "rollout_log_probs" in train_data, "rollout_log_probs must be provided for TIS"
    if getattr(args, "use_rollout_logprobs", False) and "rollout_log_probs" not in train_data:
        raise KeyError("rollout_log_probs")  # the loss reads them as the old log probs


def tensorize(train_data: dict[str, Any]) -> None:
    """Each per-sample list becomes a tensor: every value must be a flat list of numbers."""
    for key in TENSOR_KEYS:
        if key in train_data:
            train_data[key] = [_as_tensor(value, key) for value in train_data[key]]


def _as_tensor(value: Any, key: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{key}: could not convert {type(value).__name__} to a tensor")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{key}: not a flat list of numbers")
    return tuple(value)
