"""The typed answers of the buffer's API: a batch of rollout data, jobs, statistics, a started rollout."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RolloutBatch(BaseModel):
    """What ``/get_rollout_data`` returned: whole groups, their items contiguous, oldest first.

    ``items`` are the trajectories as the server sent them (after the task's hooks: GRPO
    rewards, ``raw_reward``, padding); ``meta_info`` the statistics of everything written
    since the previous successful read. An empty batch means nothing was ready in time.
    """

    items: list[dict[str, Any]] = Field(default_factory=list)
    meta_info: dict[str, Any] = Field(default_factory=dict)
    message: str = ""

    @property
    def success(self) -> bool:
        return bool(self.items)

    @property
    def replayed(self) -> int:
        """How many of the groups (the last ones) the replay pool served again: each of their
        trajectories says ``extra_info.replay``."""
        return int(self.meta_info.get("replayed") or 0)

    @property
    def finished_groups(self) -> list[Any]:
        """Instance ids of the groups returned or discarded since the previous read (for resumes)."""
        return list(self.meta_info.get("finished_groups") or [])

    def groups(self, group_size: int | None = None) -> list[list[dict[str, Any]]]:
        """The items split into groups, in order.

        The server sends each group's items together, so a group ends where the instance id
        (or the item's ``task_type``) changes. Two groups of one instance back to back (an
        instance repeated across epochs) are told apart by ``group_size``: given, or inferred
        from ``meta_info["returned_groups"]`` when all groups in the batch have one size.
        """
        runs: list[list[dict[str, Any]]] = []
        last: tuple[Any, Any] | None = None
        for item in self.items:
            key = (item.get("task_type"), item.get("instance_id"))
            if not runs or key != last:
                runs.append([])
                last = key
            runs[-1].append(item)
        size = group_size or self._uniform_group_size(runs)
        if not size:
            return runs
        return [run[start : start + size] for run in runs for start in range(0, len(run), size)]

    def _uniform_group_size(self, runs: list[list[dict[str, Any]]]) -> int | None:
        returned = self.meta_info.get("returned_groups")
        if not isinstance(returned, int) or returned <= len(runs) or len(self.items) % returned:
            return None
        size = len(self.items) // returned
        return size if all(len(run) % size == 0 for run in runs) else None


class JobInfo(BaseModel):
    """A generator job (``GET /jobs/{id}``): its status, times, counters, progress and failure."""

    model_config = ConfigDict(extra="allow")

    id: str
    task_type: str
    status: str  # running, succeeded, failed, cancelled
    started_at: float | None = None
    finished_at: float | None = None
    counters: dict[str, Any] = Field(default_factory=dict)
    progress: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    where: str | None = None  # where the generator failed, e.g. "generator/x_generator.py:42 in run_rollout"


class BufferStats(BaseModel):
    """``GET /buffer/stats``: slime's four counters, and per task its groups and items."""

    model_config = ConfigDict(extra="allow")

    current_size: int = 0  # items ready to read
    max_size: int = -1  # --max-buffered-trajectories; -1: unbounded
    total_written: int = 0
    total_read: int = 0
    pending_items: int = 0  # in groups not yet complete
    duplicates: int = 0
    current_task: str | None = None
    tasks: dict[str, dict[str, Any]] = Field(default_factory=dict)


class StartedRollout(BaseModel):
    """``POST /start_rollout``: the job started, or the one already running for the task."""

    model_config = ConfigDict(extra="allow")

    message: str = ""
    task_type: str
    job_id: str | None = None
    job: JobInfo | None = None
