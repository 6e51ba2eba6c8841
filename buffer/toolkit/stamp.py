"""Writing the policy versions a trajectory was sampled under onto it.

Each turn keeps the engine's ``weight_version`` where the engine reports one; a turn the
engine did not stamp gets the service's version when its first request started (the gate
records one version per engine request, 0 before the trainer's first ``POST /policy``, and a
completion's ``attempts`` says how many of them were its own). Each turn's per-token runs
(``weight_versions``, ``parts``) are completed the same way. The trajectory carries the lowest
and highest as ``extra_info.policy_version_min`` and ``_max``: the lowest is what the staleness
bound reads.
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
        return [_lowest(versions)] * len(completions)  # cannot split: the conservative bound
    result: list[int | None] = []
    at = 0
    for completion in completions:
        result.append(_lowest(versions[at : at + completion.attempts]))
        at += completion.attempts
    return result


def _lowest(versions: Sequence[Any]) -> int | None:
    """The lowest of the versions that are numbers (None where none is)."""
    return min((v for v in map(as_version, versions) if v is not None), default=None)


def stamp(trajectory: dict[str, Any], completions: Sequence[Completion], versions: Sequence[int]) -> None:
    """Fill the turns' missing ``weight_version`` and per-token runs (``weight_versions``), and set
    the trajectory's lowest and highest."""
    # Only numbers compare: a gate's None (no version yet) and an engine's "default" say none.
    found: list[int] = [v for v in map(as_version, versions) if v is not None]
    turns = trajectory.get("turns")
    if isinstance(turns, list):
        for turn, version in zip(turns, completion_versions(completions, versions), strict=False):
            if turn.get("weight_version") is None and version is not None:
                turn["weight_version"] = version
            own = as_version(turn.get("weight_version"))
            if own is not None:
                found.append(own)
            runs = turn.get("weight_versions")
            if runs is None and own is not None:
                turn["weight_versions"] = [[own, len(turn.get("output_ids") or ())]]
            elif isinstance(runs, list):
                fill = version if version is not None else own
                for run in runs:  # a run no engine nor gate versioned: the completion's version
                    number = as_version(run[0])
                    if number is None and fill is not None:
                        run[0] = number = fill
                    if number is not None:
                        found.append(number)
    if found:
        info = trajectory.setdefault("extra_info", {})
        info["policy_version_min"] = min(found)
        info["policy_version_max"] = max(found)
