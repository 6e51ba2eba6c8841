"""Reward statistics kept incrementally: O(1) per reward, mergeable across tasks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from default_func import get_group_data_meta_info


@dataclass(slots=True)
class RewardStats:
    """Count, mean, spread and range of a stream of rewards (Welford's method)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    minimum: float = math.inf
    maximum: float = -math.inf

    def add(self, reward: float) -> None:
        self.count += 1
        delta = reward - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (reward - self.mean)
        if reward < self.minimum:  # comparisons, not min()/max(): this runs on every write
            self.minimum = reward
        if reward > self.maximum:
            self.maximum = reward

    def merge(self, other: RewardStats) -> RewardStats:
        """A new accumulator over both streams (Chan et al.'s parallel update)."""
        if not other.count:
            return RewardStats(self.count, self.mean, self.m2, self.minimum, self.maximum)
        if not self.count:
            return RewardStats(other.count, other.mean, other.m2, other.minimum, other.maximum)
        count = self.count + other.count
        delta = other.mean - self.mean
        return RewardStats(
            count=count,
            mean=self.mean + delta * other.count / count,
            m2=self.m2 + other.m2 + delta * delta * self.count * other.count / count,
            minimum=min(self.minimum, other.minimum),
            maximum=max(self.maximum, other.maximum),
        )

    def to_json(self) -> list[float | None]:
        """As a JSON list; the infinite bounds of an empty accumulator as nulls."""
        bounds = [b if math.isfinite(b) else None for b in (self.minimum, self.maximum)]
        return [self.count, self.mean, self.m2, *bounds]

    @classmethod
    def from_json(cls, values: list[Any]) -> RewardStats:
        count, mean, m2, minimum, maximum = values
        return cls(
            count,
            mean,
            m2,
            math.inf if minimum is None else minimum,
            -math.inf if maximum is None else maximum,
        )

    @property
    def sample_std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0

    def meta_info(self, num_groups: int) -> dict[str, Any]:
        """The statistics in the shape of ``default_func.get_group_data_meta_info``."""
        if not self.count:
            return get_group_data_meta_info({})
        return {
            "total_samples": self.count,
            "num_groups": num_groups,
            "avg_group_size": self.count / num_groups if num_groups else 0,
            "avg_reward": self.mean,
            "reward_std": self.sample_std,
            "reward_min": self.minimum,
            "reward_max": self.maximum,
        }
