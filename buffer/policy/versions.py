"""Which policy versions a trajectory, or a group, was sampled under."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from buffer import encoding


def as_version(value: Any) -> int | None:
    """A version as a number: an int, or a string of one (SGLang reports strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def trajectory_versions(item: Mapping[str, Any]) -> tuple[int, int] | None:
    """The lowest and highest version of a trajectory: ``extra_info.policy_version_min`` and
    ``_max`` where the toolkit wrote them, every turn's ``weight_version`` and its per-token runs
    (``weight_versions``); None if unknown."""
    found: list[int] = []
    info = item.get("extra_info")
    if isinstance(info, dict):
        for key in ("policy_version_min", "policy_version_max"):
            if (version := as_version(info.get(key))) is not None:
                found.append(version)
    turns = item.get("turns")
    if isinstance(turns, list):
        for turn in turns:
            if not isinstance(turn, dict):
                continue
            if (version := as_version(turn.get("weight_version"))) is not None:
                found.append(version)
            found.extend(
                version for version, _ in run_list(turn.get("weight_versions")) if version is not None
            )
    return (min(found), max(found)) if found else None


def run_list(value: Any) -> list[tuple[int | None, int]]:
    """A turn's per-token versions (``weight_versions: [[version, count], ...]``) as pairs;
    entries that are not such a pair are skipped."""
    if not isinstance(value, list):
        return []
    pairs: list[tuple[int | None, int]] = []
    for run in value:
        if isinstance(run, (list, tuple)) and len(run) == 2 and type(run[1]) is int and run[1] >= 0:
            pairs.append((as_version(run[0]), run[1]))
    return pairs


def group_versions(items: Iterable[bytes]) -> tuple[int, int] | None:
    """The lowest and highest version over a group's stored trajectories."""
    low: int | None = None
    high: int | None = None
    for raw in items:
        span = trajectory_versions(encoding.loads(raw))
        if span is None:
            continue
        low = span[0] if low is None else min(low, span[0])
        high = span[1] if high is None else max(high, span[1])
    return None if low is None or high is None else (low, high)


def versioned(item: Mapping[str, Any], current: int | None) -> Mapping[str, Any]:
    """``item`` as written, or, where it says no version (a generator without the service's gate,
    an engine that reports "default"), a copy at the service's ``current`` version (0 before the
    trainer said one), so no trajectory is beyond the staleness bound for want of a version."""
    if trajectory_versions(item) is not None:
        return item
    info = item.get("extra_info")
    version = 0 if current is None else current
    extra = {
        **(info if isinstance(info, dict) else {}),
        "policy_version_min": version,
        "policy_version_max": version,
    }
    return {**item, "extra_info": extra}
