"""The jobs' ledger: which generator jobs run, kept with the buffer so a restart resumes them.

The service starts a generator job for a task (``/start_rollout``); the ledger remembers what
started it (``job``), that it ended (``job_end``), that a clean shutdown paused it
(``job_pause``) and how many times in a row it was running when the service died
(``job_resume``), each as a record kept with the buffer's own. While a job runs, its task
counts the groups of each instance that finish (``TaskBuffer.start_job_count``), so a job
resumed after a restart is told what it already made (``resume_point``) and makes only the
rest. ``RolloutBuffer`` calls it under its lock, and replays its records through ``apply``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from buffer import encoding
from buffer.core.records import encode
from buffer.core.task import TaskBuffer

#: The record kinds the ledger writes and replays.
KINDS = frozenset({"job", "job_end", "job_pause", "job_resume"})

#: Where a record goes (a store's ``append``), or None when nothing is kept.
Log = Callable[[bytes], None] | None


class JobLedger:
    def __init__(self) -> None:
        #: The generator jobs running, by buffer task: what started each, to start it again
        #: after a restart.
        self.jobs: dict[str, dict[str, Any]] = {}

    def started(self, task: TaskBuffer, generator: str, data: dict[str, Any], log: Log) -> None:
        self.jobs[task.task_type] = {"generator": generator, "data": data, "crashes": 0}
        task.start_job_count()
        if log is not None:
            log(encode({"e": "job", "t": task.task_type, "g": generator, "data": data}))

    def ended(self, task_type: str, task: TaskBuffer | None, log: Log) -> None:
        if self.jobs.pop(task_type, None) is not None and log is not None:
            log(encode({"e": "job_end", "t": task_type}))
        if task is not None:
            task.stop_job_count()

    def paused(self, task_type: str, log: Log) -> None:
        spec = self.jobs.get(task_type)
        if spec is not None:
            spec["paused"] = True
            if log is not None:
                log(encode({"e": "job_pause", "t": task_type}))

    def crashes_if_resumed(self, task_type: str) -> int:
        spec = self.jobs[task_type]
        return 0 if spec.get("paused") else int(spec.get("crashes", 0)) + 1

    def resumed(self, task_type: str, crashes: int, log: Log) -> None:
        spec = self.jobs[task_type]
        spec["crashes"], spec["paused"] = crashes, False
        if log is not None:
            log(encode({"e": "job_resume", "t": task_type, "crashes": crashes}))

    @staticmethod
    def resume_point(task: TaskBuffer) -> dict[str, Any]:
        """What the task's job has produced since it started (its timed-out groups finished
        first): see ``RolloutBuffer.resume_point``."""
        finished = task.job_finished or Counter()
        return {
            "finished_groups": [[instance_id, count] for instance_id, count in finished.items()],
            "open_groups": [
                [group.instance_id, [_repeat_of(record.raw) for record in group.records]]
                for group in task.open.values()
            ],
        }

    # -- a restart -----------------------------------------------------------------------

    def apply(
        self, header: dict[str, Any], task_of: Callable[[str], TaskBuffer], tasks: Mapping[str, TaskBuffer]
    ) -> None:
        """Replay one of the ledger's records (``KINDS``); ``task_of`` finds or makes a task."""
        kind, task_type = header["e"], header["t"]
        if kind == "job":
            self.jobs[task_type] = {"generator": header["g"], "data": header["data"], "crashes": 0}
            task_of(task_type).start_job_count()
        elif kind == "job_end":
            self.jobs.pop(task_type, None)
            if (ended := tasks.get(task_type)) is not None:
                ended.stop_job_count()
        elif kind == "job_pause":
            self.jobs[task_type]["paused"] = True
        else:
            self.jobs[task_type].update(crashes=header["crashes"], paused=False)

    def snapshot(self, tasks: Mapping[str, TaskBuffer]) -> dict[str, dict[str, Any]]:
        """The jobs as a snapshot's ``state`` record keeps them: each with the groups its task
        finished since it started."""
        jobs = {}
        for name, spec in self.jobs.items():
            task = tasks.get(name)
            finished = task.job_finished if task is not None else None
            jobs[name] = {
                **spec,
                "finished": list(map(list, finished.items())) if finished is not None else None,
            }
        return jobs

    def restore(self, jobs: dict[str, dict[str, Any]], task_of: Callable[[str], TaskBuffer]) -> None:
        """Take the jobs from a snapshot's ``state`` record."""
        self.jobs = jobs
        for task_type, spec in jobs.items():
            finished = spec.pop("finished", None)
            if finished is not None:
                task_of(task_type).start_job_count((instance_id, count) for instance_id, count in finished)


def _repeat_of(raw: bytes) -> int | None:
    """A trajectory's ``extra_info.repeat``, where the toolkit wrote one."""
    extra_info = encoding.loads(raw).get("extra_info")
    repeat = extra_info.get("repeat") if isinstance(extra_info, dict) else None
    return repeat if isinstance(repeat, int) and not isinstance(repeat, bool) else None
