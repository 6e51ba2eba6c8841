"""The policy's part in a read: setting stale groups aside, and mixing tasks by weight.

Called by ``RolloutBuffer.read`` under its lock; works on the tasks' ready queues directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from buffer.policy.mixing import allocate, fill_shortfall
from buffer.policy.state import Policy
from buffer.policy.versions import group_versions
from buffer.task import ReadyGroup, TaskBuffer

STALE = "stale"


def span_of(group: ReadyGroup, cache: dict[int, tuple[int, int] | None]) -> tuple[int, int] | None:
    """A ready group's (lowest, highest) version, parsed once per group."""
    if group.seq not in cache:
        cache[group.seq] = group_versions(group.items)
    return cache[group.seq]


def stale_groups(task: TaskBuffer, policy: Policy, cache: dict[int, tuple[int, int] | None]) -> list[int]:
    """The seqs of the task's ready groups whose lag is past its ``max_staleness``."""
    bound = task.settings.max_staleness
    if bound is None or policy.version is None:
        return []
    stale = []
    for group in task.ready:
        lag = policy.lag_of(span_of(group, cache))
        if lag is not None and lag > bound:
            stale.append(group.seq)
    return stale


def drop(task: TaskBuffer, seqs: list[int]) -> None:
    """Take the groups ``seqs`` off the task's ready queue, counted as discarded ``stale``."""
    wanted = set(seqs)
    kept = []
    for group in task.ready:
        if group.seq in wanted:
            task.ready_items -= len(group.items)
            task.finished_instance_ids.append(group.instance_id)
            task.discarded[STALE] += 1
            task.window_discarded[STALE] += 1
        else:
            kept.append(group)
    task.ready.clear()
    task.ready.extend(kept)


def take_mixed(
    tasks: Mapping[str, TaskBuffer], weights: Mapping[str, float], max_items: int, policy: Policy
) -> tuple[list[ReadyGroup], dict[str, Any]]:
    """Groups for one mixed read of at most ``max_items`` items (at least one group), each
    task's share by largest remainder over the run, short tasks made up by the others."""
    sizes = [task.settings.group_size for task in tasks.values()] or [1]
    total = max(1, max_items // max(1, min(sizes)))
    served = {name: policy.served_groups.get(name, 0) for name in tasks}
    quota = allocate(weights, served, total)
    requested = dict(quota)
    available = {name: len(task.ready) for name, task in tasks.items()}
    short = fill_shortfall(quota, available, weights)
    groups: list[ReadyGroup] = []
    taken = 0
    returned: dict[str, int] = dict.fromkeys(tasks, 0)
    # Round-robin across tasks so a batch cut short by max_items still holds every share.
    progress = True
    while progress:
        progress = False
        for name, task in tasks.items():
            if returned[name] >= quota[name] or not task.ready:
                continue
            size = len(task.ready[0].items)
            if groups and taken + size > max_items:
                continue
            groups.append(task.pop_ready())
            taken += size
            returned[name] += 1
            progress = True
    meta: dict[str, Any] = {"weights": dict(weights), "requested": requested, "returned": returned}
    if short:
        meta["short"] = short
        meta["message"] = "made up by other tasks: " + ", ".join(
            f"{name} had {available.get(name, 0)} of {requested[name]}" for name in sorted(short)
        )
    return groups, meta
