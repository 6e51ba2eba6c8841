"""The jobs' ledger: which generator jobs run, kept with the buffer so a restart resumes them.

The service starts a generator job for a task (``/start_rollout``); the ledger remembers what
started it (``job``), that it ended (``job_end``), that a clean shutdown paused it
(``job_pause``) and how many times in a row it was running when the service died without
progress since its last start (``job_resume``), each as a record kept with the buffer's own.
While a job runs, its task counts the groups of each instance and epoch that finish
(``TaskBuffer.start_job_count``; the epoch the trajectories' ``extra_info.epoch`` says, kept in
the group's ``fin`` record), so a job resumed after a restart is told what it already made
(``resume_point``) and makes only the rest. ``RolloutBuffer`` calls it under its lock, and
replays its records through ``apply``.

A job that ends without finishing (failed, cancelled, not resumed) is kept as ``unfinished``
with its generator and its plan (a fingerprint of the fields that define it), and its task
goes on counting: a later start of the same generator and plan continues it
(``continues``, ``started(..., resumed=True)``) instead of making the whole plan again.
Progress is the task's trajectories written (``TaskBuffer.written``) since the job's last
start: as the records are replayed in the order they were written, a replay finds the same
count at each ``job`` and ``job_resume`` record as the run that wrote it.

A task may have no job at all: remote lease workers (``rollout-buffer worker --leases``) make its
plan, and after a restart they walk it again from the task's resume point. So the first work the
lease board grants for a task whose groups nothing counts starts a *remote run* (``remote``): a
``job`` record marked ``remote``, kept as an unfinished job of no generator, whose count goes on
as an unfinished job's does, through restarts and snapshots, until a job of the task starts
(which, unless it continues, counts afresh, as any start does). Nothing resumes it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from buffer import encoding
from buffer.core.records import encode
from buffer.core.task import JobGroup, TaskBuffer, epoch_of, extra_int

#: The record kinds the ledger writes and replays.
KINDS = frozenset({"job", "job_end", "job_pause", "job_resume"})

#: Where a record goes (a store's ``append``), or None when nothing is kept.
Log = Callable[[bytes], None] | None


class JobLedger:
    def __init__(self) -> None:
        #: The generator jobs running, by buffer task: what started each, to start it again
        #: after a restart.
        self.jobs: dict[str, dict[str, Any]] = {}

    def running(self) -> dict[str, dict[str, Any]]:
        """The jobs running (the unfinished ones left out)."""
        return {name: spec for name, spec in self.jobs.items() if not spec.get("unfinished")}

    def started(
        self,
        task: TaskBuffer,
        generator: str,
        data: dict[str, Any],
        log: Log,
        *,
        plan: str | None = None,
        resumed: bool = False,
    ) -> None:
        """``resumed``: the job continues the task's unfinished one, whose count goes on."""
        self._start(task, generator, data, plan, resumed)
        if log is not None:
            record = {"e": "job", "t": task.task_type, "g": generator, "data": data, "plan": plan}
            log(encode({**record, "resumed": True} if resumed else record))

    def remote(self, task: TaskBuffer, log: Log) -> bool:
        """Remote lease workers were granted the task's work: if nothing counts its finished
        groups (no job, running or unfinished), count them from now on as a remote run's; False
        where something does already."""
        if task.job_finished is not None:
            return False
        self._remote(task)
        if log is not None:
            # A ``job`` record: a service that does not know ``remote`` finds a job of no
            # generator, says so, and keeps it unfinished, not resumed: what a remote run is.
            log(
                encode({"e": "job", "t": task.task_type, "g": None, "data": {}, "plan": None, "remote": True})
            )
        return True

    def _remote(self, task: TaskBuffer) -> None:
        self.jobs[task.task_type] = {"generator": None, "plan": None, "unfinished": True, "remote": True}
        task.start_job_count()

    def _start(self, task: TaskBuffer, generator: str, data: Any, plan: str | None, resumed: bool) -> None:
        self.jobs[task.task_type] = {
            "generator": generator,
            "data": data,
            "crashes": 0,
            "plan": plan,
            "written": task.written,
        }
        if not resumed or task.job_finished is None:
            task.start_job_count()

    def ended(self, task_type: str, task: TaskBuffer | None, log: Log, *, finished: bool = True) -> None:
        """``finished``: the job made its whole plan; else it is kept as unfinished, its task
        counting on, for a later start of the same plan to continue it."""
        spec = self.jobs.get(task_type)
        if spec is None or spec.get("unfinished"):
            return
        self._end(task_type, task, finished)
        if log is not None:
            record = {"e": "job_end", "t": task_type}
            log(encode(record if finished else {**record, "unfinished": True}))

    def _end(self, task_type: str, task: TaskBuffer | None, finished: bool) -> None:
        spec = self.jobs.pop(task_type)
        if not finished:
            self.jobs[task_type] = {
                "generator": spec["generator"],
                "plan": spec.get("plan"),
                "unfinished": True,
            }
        elif task is not None:
            task.stop_job_count()

    def continues(self, task_type: str, generator: str, plan: str | None) -> bool:
        """Whether a job of ``generator`` and ``plan`` started now continues the task's
        unfinished one: the same generator, the same plan."""
        spec = self.jobs.get(task_type)
        return (
            spec is not None
            and bool(spec.get("unfinished"))
            and plan is not None
            and spec.get("plan") == plan
            and spec["generator"] == generator
        )

    def paused(self, task_type: str, log: Log) -> None:
        spec = self.jobs.get(task_type)
        if spec is not None:
            spec["paused"] = True
            if log is not None:
                log(encode({"e": "job_pause", "t": task_type}))

    def crashes_if_resumed(self, task: TaskBuffer) -> int:
        """0 after a clean stop; 1 after a crash of a job that wrote trajectories since its
        last start (a crash with progress starts the count again); else one more."""
        spec = self.jobs[task.task_type]
        if spec.get("paused"):
            return 0
        progressed = spec.get("written") is not None and task.written > spec["written"]
        return 1 if progressed else int(spec.get("crashes", 0)) + 1

    def resumed(self, task: TaskBuffer, crashes: int, log: Log) -> None:
        task_type = task.task_type
        spec = self.jobs[task_type]
        spec["crashes"], spec["paused"], spec["written"] = crashes, False, task.written
        if log is not None:
            log(encode({"e": "job_resume", "t": task_type, "crashes": crashes}))

    @staticmethod
    def resume_point(task: TaskBuffer) -> dict[str, Any]:
        """What the task's job has produced since it started (its timed-out groups finished
        first): see ``RolloutBuffer.resume_point``. ``finished_groups`` counts every group of an
        instance, as before epochs were counted, so an older reader still skips as many;
        ``finished_epochs`` and ``open_epochs`` are there only when some group says its epoch."""
        per_instance: Counter[Any] = Counter()
        finished_epochs = []
        for (instance_id, epoch), count in (task.job_finished or Counter()).items():
            per_instance[instance_id] += count
            if epoch is not None:
                finished_epochs.append([instance_id, epoch, count])
        open_groups, open_epochs = [], []
        for group in task.open.values():
            items = [encoding.loads(record.raw) for record in group.records]
            open_groups.append([group.instance_id, [extra_int(item, "repeat") for item in items]])
            epoch = epoch_of(items)
            if epoch is not None:
                open_epochs.append([group.instance_id, epoch])
        point: dict[str, Any] = {
            "finished_groups": [[instance_id, count] for instance_id, count in per_instance.items()],
            "open_groups": open_groups,
        }
        if finished_epochs:
            point["finished_epochs"] = finished_epochs
        if open_epochs:
            point["open_epochs"] = open_epochs
        return point

    # -- a restart -----------------------------------------------------------------------

    def apply(
        self, header: dict[str, Any], task_of: Callable[[str], TaskBuffer], tasks: Mapping[str, TaskBuffer]
    ) -> None:
        """Replay one of the ledger's records (``KINDS``); ``task_of`` finds or makes a task."""
        kind, task_type = header["e"], header["t"]
        if kind == "job" and header.get("remote"):
            self._remote(task_of(task_type))
        elif kind == "job":
            resumed = bool(header.get("resumed"))
            self._start(task_of(task_type), header["g"], header["data"], header.get("plan"), resumed)
        elif kind == "job_end":
            if task_type in self.jobs:
                self._end(task_type, tasks.get(task_type), not header.get("unfinished"))
        elif kind == "job_pause":
            self.jobs[task_type]["paused"] = True
        else:
            written = task_of(task_type).written
            self.jobs[task_type].update(crashes=header["crashes"], paused=False, written=written)

    def snapshot(self, tasks: Mapping[str, TaskBuffer]) -> Callable[[], dict[str, dict[str, Any]]]:
        """The jobs as a snapshot's ``state`` record keeps them: each with the groups its task
        finished since it started, ``finished`` ``[instance_id, count]`` of the groups that
        say no epoch, ``finished_epochs`` ``[instance_id, epoch, count]`` of the others. The
        counts are copied now (under the buffer's lock: a copy of pointers); the function
        returned makes the record's lists, outside it."""
        copied: dict[str, tuple[dict[str, Any], dict[JobGroup, int] | None]] = {}
        for name, spec in self.jobs.items():
            task = tasks.get(name)
            finished = task.job_finished if task is not None else None
            copied[name] = (dict(spec), None if finished is None else dict(finished))

        def jobs() -> dict[str, dict[str, Any]]:
            made = {}
            for name, (spec, finished) in copied.items():
                if finished is None:
                    made[name] = {**spec, "finished": None}
                    continue
                made[name] = {
                    **spec,
                    "finished": [[iid, count] for (iid, epoch), count in finished.items() if epoch is None],
                    "finished_epochs": [
                        [iid, epoch, count] for (iid, epoch), count in finished.items() if epoch is not None
                    ],
                }
            return made

        return jobs

    def restore(self, jobs: dict[str, dict[str, Any]], task_of: Callable[[str], TaskBuffer]) -> None:
        """Take the jobs from a snapshot's ``state`` record (one written before epochs were
        counted has only ``finished``: its groups count as saying no epoch)."""
        self.jobs = jobs
        for task_type, spec in jobs.items():
            finished = spec.pop("finished", None)
            finished_epochs = spec.pop("finished_epochs", ())
            if finished is not None:
                counts: list[tuple[JobGroup, int]] = [((iid, None), count) for iid, count in finished]
                counts += [((iid, epoch), count) for iid, epoch, count in finished_epochs]
                task_of(task_type).start_job_count(counts)
