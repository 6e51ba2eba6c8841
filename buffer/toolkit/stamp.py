"""Writing the policy versions a trajectory was sampled under onto it.

Each turn keeps the engine's ``weight_version`` where the engine reports one; a turn the
engine did not stamp gets the service's version when its first request started (the gate
records one version per engine request, and a completion's ``attempts`` says how many of
them were its own). The trajectory carries the lowest and highest as
``extra_info.policy_version_min`` and ``_max``: the lowest is what the staleness bound reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from buffer.policy.versions import as_version

if TYPE_CHECKING:
    from buffer.toolkit.types import Completion


def completion_versions(completions: Sequence[Completion], versions: Sequence[int]) -> list[int | None]:
    """The version each completion's first request started under, where it can be told."""
    if not versions:
        return [None] * len(completions)
    if sum(completion.attempts for completion in completions) != len(versions):
        return [min(versions)] * len(completions)  # cannot split: the conservative bound
    result: list[int | None] = []
    at = 0
    for completion in completions:
        part = versions[at : at + completion.attempts]
        result.append(min(part) if part else None)
        at += completion.attempts
    return result


def stamp(trajectory: dict[str, Any], completions: Sequence[Completion], versions: Sequence[int]) -> None:
    """Fill the turns' missing ``weight_version`` and set the trajectory's lowest and highest."""
    found: list[int] = list(versions)
    turns = trajectory.get("turns")
    if isinstance(turns, list):
        for turn, version in zip(turns, completion_versions(completions, versions), strict=False):
            if turn.get("weight_version") is None and version is not None:
                turn["weight_version"] = version
            if (engine_version := as_version(turn.get("weight_version"))) is not None:
                found.append(engine_version)
    if found:
        info = trajectory.setdefault("extra_info", {})
        info["policy_version_min"] = min(found)
        info["policy_version_max"] = max(found)
