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
    ``_max`` where the toolkit wrote them, and every turn's ``weight_version``; None if unknown."""
    found: list[int] = []
    info = item.get("extra_info")
    if isinstance(info, dict):
        for key in ("policy_version_min", "policy_version_max"):
            if (version := as_version(info.get(key))) is not None:
                found.append(version)
    turns = item.get("turns")
    if isinstance(turns, list):
        for turn in turns:
            if isinstance(turn, dict) and (version := as_version(turn.get("weight_version"))) is not None:
                found.append(version)
    return (min(found), max(found)) if found else None


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
