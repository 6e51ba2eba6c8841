"""Test data: trajectories, groups, a clock the tests move by hand, generator files, and a sink
that keeps what a toolkit run writes."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

_uids = itertools.count()


def trajectory(instance_id: Any = "q1", reward: Any = 0.5, **extra: Any) -> dict[str, Any]:
    """A valid trajectory as a generator writes it."""
    item: dict[str, Any] = {
        "instance_id": instance_id,
        "uid": f"uid-{next(_uids)}",
        "messages": [
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": "\\boxed{2}"},
        ],
        "reward": reward,
        "extra_info": {"finish_reason": "stop"},
    }
    item.update(extra)
    return item


def group(instance_id: Any, rewards: list[float], **extra: Any) -> list[dict[str, Any]]:
    return [trajectory(instance_id, reward, **extra) for reward in rewards]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write_generator(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(source)
    return path


class Collected:
    """A toolkit sink that keeps what is written, each checked as the buffer would accept it."""

    def __init__(self) -> None:
        self.trajectories: list[dict[str, Any]] = []

    async def write(self, trajectory: dict[str, Any]) -> None:
        from buffer.service.models import TRAJECTORY

        TRAJECTORY.validate_python(trajectory)
        self.trajectories.append(trajectory)

    async def aclose(self) -> None:
        return None
