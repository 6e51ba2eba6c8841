"""``GET /stats``: what the generation routes were asked, how it ended, how much ran at once."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SimStats:
    """Counters of the generation routes: what came in, how it ended, how much ran at once."""

    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    dropped: int = 0  # connections dropped by an outage in "reset" mode
    by_finish_reason: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def enter(self) -> None:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def reset(self) -> None:
        """Zero every counter; requests still running are still counted in flight."""
        self.requests = self.prompt_tokens = self.completion_tokens = self.dropped = 0
        self.max_in_flight = self.in_flight
        self.by_status.clear()
        self.by_finish_reason.clear()

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "by_status": {str(status): count for status, count in sorted(self.by_status.items())},
            "dropped": self.dropped,
            "by_finish_reason": dict(sorted(self.by_finish_reason.items())),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
