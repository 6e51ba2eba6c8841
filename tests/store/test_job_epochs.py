"""A job's finished groups are counted per instance and epoch where the trajectories say their
epoch, through the journal's replay and a snapshot alike (issue 22)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from buffer.toolkit.dataset import Plan, ResumePoint
from tests.support.factories import FakeClock, trajectory
from tests.support.stores import Opened, on_journal


def said(instance_id: str, epoch: int | None, repeats: range | list[int]) -> list[dict[str, Any]]:
    """Trajectories as the toolkit writes them (``extra_info.epoch``, ``extra_info.repeat``)."""
    extra = {} if epoch is None else {"epoch": epoch}
    return [
        trajectory(instance_id, task_type="rec", extra_info={"finish_reason": "stop", "repeat": r, **extra})
        for r in repeats
    ]


def point(opened: Opened) -> dict[str, list[Any]]:
    """The task's resume point, each list in order (a snapshot need not keep their order)."""
    return {key: sorted(entries) for key, entries in opened.buffer.resume_point("rec").items()}


def test_the_resume_point_counts_groups_by_their_epoch_across_restarts(tmp_path: Path) -> None:
    clock = FakeClock()

    first = on_journal(tmp_path / "data", clock)
    first.buffer.job_started("rec", "gen", {}, plan="p")
    items = said("X", 1, range(4))  # epoch 1's X finished before epoch 0's
    items += said("Z", None, range(4))  # a generator of its own: no epoch
    items += said("W", 0, [0, 1]) + said("W", 1, [0, 1])  # two epochs in one group: none
    items += said("V", 2, [0])  # times out too small: discarded, counted
    items += said("Y", 0, [0, 1])  # open
    for item in items:
        first.buffer.write(item)
    clock.advance(61)
    first.buffer.write(said("Y", 0, [1])[0])  # keeps Y open past V's timeout
    expected = {
        "finished_groups": [["V", 1], ["W", 1], ["X", 1], ["Z", 1]],
        "open_groups": [["Y", [0, 1, 1]]],
        "finished_epochs": [["V", 2, 1], ["X", 1, 1]],
        "open_epochs": [["Y", 0]],
    }
    assert point(first) == expected
    first.stop()

    second = on_journal(tmp_path / "data", clock)  # the records replayed
    assert point(second) == expected
    second.store.compact()
    second.stop()

    third = on_journal(tmp_path / "data", clock)  # from the snapshot
    assert point(third) == expected
    third.buffer.job_ended("rec", finished=False)  # kept unfinished: a start of the plan continues it
    third.stop()

    fourth = on_journal(tmp_path / "data", clock)
    assert point(fourth) == expected
    fourth.stop()

    # the resumed plan makes exactly what is missing
    plan = Plan(
        [{"instance_id": i, "prompt": i} for i in "XYZWV"],
        num_repeat_per_sample=4,
        num_epoch=3,
        shuffle=False,
        resume=ResumePoint.from_json(expected),
    )
    groups: dict[tuple[int, str], list[int]] = {}
    for sample in plan:
        groups.setdefault((sample.epoch, sample.instance_id), []).append(sample.repeat)
    every = [0, 1, 2, 3]
    assert groups == {
        (0, "X"): every,
        (2, "X"): every,
        (0, "Y"): [3],  # holds 0, 1 and 1: one more
        (1, "Y"): every,
        (2, "Y"): every,
        (1, "Z"): every,
        (2, "Z"): every,
        (1, "W"): every,
        (2, "W"): every,
        (0, "V"): every,
        (1, "V"): every,
    }


def test_a_remote_runs_count_is_kept_through_restarts_and_snapshots_until_a_job_starts(
    tmp_path: Path,
) -> None:
    """Lease workers making a task's plan with no job: the first work granted starts the task's
    remote run, whose resume point a restarted service's workers walk from."""
    clock = FakeClock()

    first = on_journal(tmp_path / "data", clock)
    assert first.buffer.remote_run("rec") is True  # nothing counted the task's groups
    assert first.buffer.remote_run("rec") is False  # its remote run does now
    for item in said("X", 0, range(4)) + said("Y", 0, [0]):
        first.buffer.write(item)
    expected = {
        "finished_groups": [["X", 1]],
        "open_groups": [["Y", [0]]],
        "finished_epochs": [["X", 0, 1]],
        "open_epochs": [["Y", 0]],
    }
    assert point(first) == expected
    first.stop()

    second = on_journal(tmp_path / "data", clock)  # the records replayed
    assert point(second) == expected
    assert second.buffer.jobs == {}  # nothing to resume
    second.store.compact()
    second.stop()

    third = on_journal(tmp_path / "data", clock)  # from the snapshot
    assert point(third) == expected
    assert third.buffer.remote_run("rec") is False
    third.buffer.job_started("rec", "gen", {}, plan="p")  # a job's start counts afresh, as any start
    assert point(third)["finished_groups"] == []
    assert third.buffer.remote_run("rec") is False  # the job counts
    third.stop()


def test_a_task_whose_unfinished_job_counts_starts_no_remote_run(tmp_path: Path) -> None:
    opened = on_journal(tmp_path / "data", FakeClock())
    opened.buffer.job_started("rec", "gen", {}, plan="p")
    opened.buffer.job_ended("rec", finished=False)  # its count goes on for a start of its plan
    assert opened.buffer.remote_run("rec") is False
    assert opened.buffer.job_continues("rec", "gen", "p")
    opened.close()
