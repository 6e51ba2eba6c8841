"""slime's rollout function outputs (slime/rollout/base_types.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> Any:
    """A bare return value (slime's older contract) is wrapped in the output type."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output
