"""The policy's part in a read: setting stale groups aside, and mixing tasks by weight.

Called by ``RolloutBuffer.read`` under its lock; works on the tasks' ready queues directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from buffer.core.mixing import allocate, fill_shortfall
from buffer.core.task import ReadyGroup, TaskBuffer
from buffer.policy.state import Policy
from buffer.policy.versions import group_versions

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


def choose_mixed(
    tasks: Mapping[str, TaskBuffer],
    weights: Mapping[str, float],
    max_items: int,
    policy: Policy,
    one_group_per_instance: bool,
) -> tuple[list[ReadyGroup], dict[str, Any]]:
    """The groups one mixed read of at most ``max_items`` items takes (at least one group),
    left in place: each task's share by largest remainder over the run, a short task made up
    by the others. With ``one_group_per_instance``, a later group of an instance already
    chosen waits for the next read, as in an unmixed read."""
    sizes = [task.settings.group_size for task in tasks.values()] or [1]
    total = max(1, max_items // max(1, min(sizes)))
    eligible: dict[str, list[ReadyGroup]] = {}
    seen: set[Any] = set()
    for name, task in tasks.items():
        eligible[name] = []
        for group in task.ready:
            if one_group_per_instance and group.instance_id in seen:
                continue
            seen.add(group.instance_id)
            eligible[name].append(group)
    served = {name: policy.served_groups.get(name, 0) for name in tasks}
    quota = allocate(weights, served, total)
    requested = dict(quota)
    available = {name: len(groups) for name, groups in eligible.items()}
    short = fill_shortfall(quota, available, weights)
    chosen: list[ReadyGroup] = []
    taken = 0
    returned: dict[str, int] = dict.fromkeys(tasks, 0)
    # Round-robin across tasks so a batch cut short by max_items still holds every share.
    progress = True
    while progress:
        progress = False
        for name in tasks:
            if returned[name] >= quota.get(name, 0) or returned[name] >= len(eligible[name]):
                continue
            group = eligible[name][returned[name]]
            size = len(group.items)
            if chosen and taken + size > max_items:
                continue
            chosen.append(group)
            taken += size
            returned[name] += 1
            progress = True
    meta: dict[str, Any] = {"weights": dict(weights), "requested": requested, "returned": returned}
    if short:
        meta["short"] = short
        meta["message"] = "made up by other tasks: " + ", ".join(
            f"{name} had {available.get(name, 0)} of {requested[name]}" for name in sorted(short)
        )
    return chosen, meta
