"""The generator plug-in contract, and the default for every optional hook.

A generator is a file ``generator/<task>_generator.py`` that defines

    TASK_TYPE: str                      the task's name, unique across the folder
    run_rollout(data: dict) -> None     sync or async; runs the task and writes trajectories

and may define any hook listed in ``HOOKS`` at the end of this module. A hook it leaves out
takes the default defined here. The service checks every generator's hooks against ``HOOKS``
when it loads the file, so this module is the one place the contract is written down.

A *group* is ``(instance_id, items)``, an *item* a trajectory dict with at least ``uid``,
``instance_id``, ``messages``, ``reward`` and ``extra_info``. Each finished group goes
through, in this order::

    is_valid_group -> filter_item (each item) -> normalize_group_data -> pad_group_data
        -> transform_group

``get_group_data_meta_info`` summarises everything written since the last read.

The defaults behave like slime's rollout buffer, with two fixes: padded copies get new,
distinct ``uid``s, and groups with no valid reward are left as they are instead of
dividing by zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Item = dict[str, Any]
Group = tuple[Any, list[Item]]

#: A failed trajectory is written with this reward; ``filter_item`` drops it.
FAILURE_REWARD = -1.0

#: ``extra_info.finish_reason`` of a trajectory still aborted after its continuations.
ABORTED = "abort"


def is_valid_reward(reward: Any) -> bool:
    """A reward the default pipeline trains on: a finite number in [0, 1]."""
    return (
        isinstance(reward, (int, float))
        and not isinstance(reward, bool)
        and math.isfinite(reward)
        and 0 <= reward <= 1
    )


def filter_item(item: Item, task_type: str) -> bool:
    """Keep an item with an instance id, a list of messages and a reward in [0, 1], whose
    answer was not left aborted.

    Failed trajectories carry ``FAILURE_REWARD`` and are dropped here; so are those whose last
    answer the engine still aborted after every continuation (``extra_info.finish_reason``
    ``"abort"``): their last reply is cut where the engine stopped, not where the model did.
    """
    extra_info = item.get("extra_info")
    aborted = isinstance(extra_info, dict) and extra_info.get("finish_reason") == ABORTED
    return (
        "instance_id" in item
        and isinstance(item.get("messages"), list)
        and is_valid_reward(item.get("reward"))
        and not aborted
    )


def is_valid_group(group: Group, min_valid_group_size: int, task_type: str) -> tuple[bool, bool]:
    """Return ``(is_valid, is_finished)``.

    Finished when the group has ``min_valid_group_size`` items; valid when it is finished and
    its rewards are not all equal (a group of equal rewards has no advantage to learn from).
    """
    _, items = group
    is_finished = len(items) >= min_valid_group_size
    has_reward_diversity = len({_hashable(item.get("reward")) for item in items}) > 1
    return is_finished and has_reward_diversity, is_finished


def normalize_group_data(group: Group, epsilon: float = 1e-8, algo: str = "grpo") -> Group:
    """GRPO: ``reward = (r - mean) / (std + epsilon)`` over the group's valid rewards.

    The mean and the population std are taken over rewards in [0, 1]; other rewards pass
    through. A group whose valid rewards are all zero (or that has none) is left as it is;
    one with std below ``epsilon`` gets 0. The original reward is kept as ``raw_reward``.
    """
    if algo != "grpo":
        raise ValueError(f"normalize_group_data supports algo='grpo' only, not {algo!r}")
    instance_id, items = group
    rewards = [item["reward"] for item in items]
    valid = [r for r in rewards if is_valid_reward(r)]
    if not valid or all(r == 0 for r in valid):
        normalized = list(rewards)
    else:
        mean = sum(valid) / len(valid)
        std = math.sqrt(sum((r - mean) ** 2 for r in valid) / len(valid))
        if std < epsilon:
            normalized = [0.0 if is_valid_reward(r) else r for r in rewards]
        else:
            normalized = [(r - mean) / (std + epsilon) if is_valid_reward(r) else r for r in rewards]
    for item, raw, new in zip(items, rewards, normalized, strict=True):
        item["raw_reward"] = raw
        item["reward"] = new
    return instance_id, items


def pad_group_data(group: Group, group_size: int) -> Group:
    """Bring the group to exactly ``group_size`` items by duplicating items.

    As in slime, rewards are scaled by ``group_size / len(items)`` to keep their range, and
    an item that ends up in ``k`` places carries ``1/k`` of its scaled reward in each, so
    duplicates weigh no more than the item did. Copies get new uids ``<uid>-pad<k>`` and
    ``extra_info.padded_from`` names the original.
    """
    instance_id, items = group
    n = len(items)
    if n == 0 or n >= group_size:
        return instance_id, items
    pads = group_size - n
    # Item i ends up in copies[i] places (itself included); the first pads % n get one more.
    copies = [1 + pads // n + (i < pads % n) for i in range(n)]
    for item, count in zip(items, copies, strict=True):
        item["reward"] = item["reward"] * group_size / n / count
    padded = list(items)
    for k in range(pads):
        source = items[k % n]
        padded.append(
            {
                **source,
                "uid": f"{source['uid']}-pad{k // n + 1}",
                "extra_info": {**source.get("extra_info", {}), "padded_from": source["uid"]},
            }
        )
    return instance_id, padded


def get_group_data_meta_info(temp_data: dict[Any, list[Item]]) -> dict[str, Any]:
    """Statistics over every item written since the last read, before any filtering.

    ``reward_std`` is the sample standard deviation, as in slime.
    """
    rewards = [item["reward"] for items in temp_data.values() for item in items]
    total = len(rewards)
    if not total:
        return {
            "total_samples": 0,
            "num_groups": 0,
            "avg_group_size": 0,
            "avg_reward": 0,
            "reward_std": 0,
            "reward_min": 0,
            "reward_max": 0,
        }
    mean = sum(rewards) / total
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (total - 1)) if total > 1 else 0.0
    return {
        "total_samples": total,
        "num_groups": len(temp_data),
        "avg_group_size": total / len(temp_data),
        "avg_reward": mean,
        "reward_std": std,
        "reward_min": min(rewards),
        "reward_max": max(rewards),
    }


def transform_group(group: Group, task_type: str) -> Group:
    """slime's newer single hook over a finished group; the default changes nothing."""
    return group


def _hashable(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


# slime's default_func.py names, for generators that import them.
default_filter_item = filter_item
default_is_valid_group = is_valid_group
default_normalize_group_data = normalize_group_data
default_pad_group_data = pad_group_data
default_get_group_data_meta_info = get_group_data_meta_info


@dataclass(frozen=True)
class HookSpec:
    """One optional hook: the arguments the buffer passes and the default.

    ``params`` are passed positionally. A hook may also take only the first
    ``min_params`` of them: slime's hooks were written to both forms over time.
    """

    name: str
    params: tuple[str, ...]
    min_params: int
    default: Callable[..., Any]


HOOKS: dict[str, HookSpec] = {
    spec.name: spec
    for spec in (
        HookSpec("filter_item", ("item", "task_type"), 1, filter_item),
        HookSpec("is_valid_group", ("group", "min_valid_group_size", "task_type"), 2, is_valid_group),
        HookSpec("normalize_group_data", ("group",), 1, normalize_group_data),
        HookSpec("pad_group_data", ("group", "group_size"), 2, pad_group_data),
        HookSpec("get_group_data_meta_info", ("temp_data",), 1, get_group_data_meta_info),
        HookSpec("transform_group", ("group", "task_type"), 1, transform_group),
    )
}
