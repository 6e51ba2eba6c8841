"""A short history of the buffer's counters, sampled once a second, for the dashboard.

Each sample is a plain dict::

    {"t": <wall-clock seconds>, "total_written": int, "total_read": int,
     "pending_groups": int, "ready_groups": int, "delivered_groups": int,   (over every task)
     "tasks": {task_type: {"written", "delivered_items", "pending_groups", "ready_groups",
                           "delivered_groups", "reward_mean", "reward_std", "reward_count",
                           "reward_sum", "served_age_s_sum", "served_age_count"}}}

``tasks`` holds the ``keep_tasks`` tasks written to most recently (and the current one), not
every task: a sample costs the same with 20,000 task names as with 20. The totals cover all.
The reward mean and std are all-time statistics of the task; the reward sum and count (and
the served groups' ages) give the mean over any window between two samples.
Rates (trajectories per second) are left to the reader: they are the difference of two
successive ``total_written`` over the difference of their ``t``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from buffer.core.rollout_buffer import RolloutBuffer

#: The task counters each sample keeps, under the names the sample gives them.
TASK_FIELDS = {
    "written": "total_written",
    "delivered_items": "delivered_items",
    "pending_groups": "pending_groups",
    "ready_groups": "ready_groups",
    "delivered_groups": "delivered_groups",
    "reward_mean": "reward_mean",
    "reward_std": "reward_std",
    # Windowed means: (sum' - sum) / (count' - count) between two samples.
    "reward_count": "reward_count",
    "reward_sum": "reward_sum",
    # The trainer's lag over a window, likewise.
    "served_age_s_sum": "served_age_s_sum",
    "served_age_count": "served_age_count",
}


class History:
    """The last ``keep`` samples, at most one per ``interval_s`` (ten minutes at one a second).

    The sweeper may call ``sample`` more often than ``interval_s``: the extra calls are skipped,
    so the history always spans the same time."""

    def __init__(
        self,
        keep: int = 600,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        keep_tasks: int = 16,
    ) -> None:
        self._samples: deque[dict[str, Any]] = deque(maxlen=keep)
        self._keep_tasks = keep_tasks
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None

    def sample(self, buffer: RolloutBuffer) -> dict[str, Any] | None:
        """Record the buffer's counters; the sample, or None when the last is too recent."""
        now = self._clock()
        # 5% slack: a sweeper sleeping exactly ``interval_s`` must not skip every other tick.
        if self._last is not None and now - self._last < self._interval_s * 0.95:
            return None
        self._last = now
        names = buffer.active_tasks(self._keep_tasks)
        if buffer.current_task not in names and buffer.has_task(buffer.current_task):
            names = [buffer.current_task, *names[: self._keep_tasks - 1]]
        summary = buffer.summary(names)
        entry = {
            "t": time.time(),
            **{key: value for key, value in summary.items() if key != "tasks"},
            "tasks": {
                name: {field: counters[source] for field, source in TASK_FIELDS.items()}
                for name, counters in summary["tasks"].items()
            },
        }
        self._samples.append(entry)
        return entry

    def snapshot(self) -> list[dict[str, Any]]:
        return list(self._samples)
