"""Sharing one read between tasks by weight.

The shares are those of the whole run, not of one read: each read aims at the cumulative
target ``weight / total_weight * (served so far + this read)`` and rounds by largest
remainder, so over many reads every task's share converges to its weight even when a batch
does not divide evenly, and a task that was short once gets its groups back later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def allocate(weights: Mapping[str, float], served: Mapping[str, int], total: int) -> dict[str, int]:
    """How many of ``total`` groups each task of ``weights`` should give to this read."""
    tasks = [task for task, weight in weights.items() if weight > 0]
    if total <= 0 or not tasks:
        return dict.fromkeys(weights, 0)
    weight_sum = sum(weights[task] for task in tasks)
    grand = sum(served.get(task, 0) for task in tasks) + total
    wanted = {task: max(0.0, weights[task] / weight_sum * grand - served.get(task, 0)) for task in tasks}
    scale = sum(wanted.values())
    if scale <= 0:
        wanted = {task: weights[task] / weight_sum * total for task in tasks}
    else:
        wanted = {task: value * total / scale for task, value in wanted.items()}
    quota = {task: math.floor(value) for task, value in wanted.items()}
    left = total - sum(quota.values())
    by_remainder = sorted(tasks, key=lambda task: (-(wanted[task] - quota[task]), -weights[task], task))
    for task in by_remainder[:left]:
        quota[task] += 1
    return {task: quota.get(task, 0) for task in weights}


def fill_shortfall(
    quota: dict[str, int], available: Mapping[str, int], weights: Mapping[str, float]
) -> dict[str, int]:
    """Move the groups a task cannot give to tasks that have more, heaviest weight first.

    Returns how many each task was short by (only tasks that were)."""
    short = {
        task: quota[task] - available.get(task, 0) for task in quota if quota[task] > available.get(task, 0)
    }
    missing = 0
    for task, count in short.items():
        quota[task] -= count
        missing += count
    for task in sorted(quota, key=lambda task: (-weights.get(task, 0.0), task)):
        if missing <= 0:
            break
        spare = available.get(task, 0) - quota[task]
        if spare > 0:
            extra = min(spare, missing)
            quota[task] += extra
            missing -= extra
    return short
