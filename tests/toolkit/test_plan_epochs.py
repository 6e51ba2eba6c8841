"""A resumed plan skips the groups that finished by their epoch, where the resume point says
it (issue 22): with several epochs at once, epoch 1's group of an instance can finish before
epoch 0's."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from buffer.toolkit.dataset import Plan, ResumePoint


def rows(*ids: str) -> list[dict[str, str]]:
    return [{"instance_id": instance_id, "prompt": f"{instance_id}?"} for instance_id in ids]


def made(plan: Plan) -> Counter[tuple[int, str]]:
    return Counter((sample.epoch, sample.instance_id) for sample in plan)


def test_a_later_epochs_finished_group_is_skipped_not_the_earlier_one() -> None:
    # epoch 1's X finished, epoch 0's X did not: finished_groups counts it too, as an older
    # buffer's reader expects
    resume = ResumePoint.from_json({"finished_groups": [["X", 1]], "finished_epochs": [["X", 1, 1]]})
    plan = Plan(rows("X", "Y"), num_repeat_per_sample=2, num_epoch=2, shuffle=False, resume=resume)
    assert made(plan) == {(0, "X"): 2, (0, "Y"): 2, (1, "Y"): 2}
    assert plan.total() == 6


def test_an_open_group_of_a_later_epoch_gets_its_missing_repeats_there() -> None:
    resume = ResumePoint.from_json({"open_groups": [["X", [0, 2]]], "open_epochs": [["X", 1]]})
    plan = Plan(rows("X"), num_repeat_per_sample=4, num_epoch=3, shuffle=False, resume=resume)
    assert made(plan) == {(0, "X"): 4, (1, "X"): 2, (2, "X"): 4}
    assert sorted(s.repeat for s in plan if s.epoch == 1) == [1, 3]


def test_groups_that_say_no_epoch_still_count_per_instance_and_the_trainers_skips_come_first() -> None:
    # Z: two groups without an epoch; X: the trainer skipped one, and epoch 2's finished
    resume = ResumePoint.from_json(
        {"finished_groups": [["Z", 2], ["X", 1]], "finished_epochs": [["X", 2, 1]], "open_groups": []}
    )
    plan = Plan(
        rows("X", "Z"),
        num_repeat_per_sample=1,
        num_epoch=4,
        shuffle=False,
        skip_instance_ids=["X"],
        resume=resume,
    )
    assert made(plan) == {(1, "X"): 1, (3, "X"): 1, (2, "Z"): 1, (3, "Z"): 1}


def test_a_resume_point_without_epochs_is_read_as_before() -> None:
    resume = ResumePoint.from_json({"finished_groups": [["X", 1]], "open_groups": [["X", [1]]]})
    assert resume == ResumePoint({"X": 1}, {"X": [1]})
    plan = Plan(rows("X"), num_repeat_per_sample=2, num_epoch=2, shuffle=False, resume=resume)
    assert [(s.epoch, s.repeat) for s in plan] == [(1, 0)]


@pytest.mark.parametrize("epoch", [-1, "1", True, 1.5])
def test_a_resume_point_with_a_bad_epoch_says_so(epoch: object) -> None:
    with pytest.raises(ValueError, match="epoch must be a whole number"):
        ResumePoint.from_json({"finished_epochs": [["X", epoch, 1]]})


def test_the_counted_total_and_epoch_sizes_are_what_iteration_yields_with_epochs() -> None:
    rng = random.Random(22)
    for _ in range(300):
        ids = [str(i % 4 if rng.random() < 0.3 else i) for i in range(rng.randint(0, 6))]
        num_epoch = rng.randint(1, 6)
        finished = {str(rng.randint(0, 6)): rng.randint(1, 2) for _ in range(rng.randint(0, 2))}
        finished_epochs = {
            (str(rng.randint(0, 6)), rng.randint(0, num_epoch + 1)): rng.randint(1, 2)
            for _ in range(rng.randint(0, 4))
        }
        held = {str(rng.randint(0, 6)): [rng.choice([0, 1, None])] for _ in range(rng.randint(0, 2))}
        held_epochs = {key: rng.randint(0, num_epoch) for key in held if rng.random() < 0.6}
        resume = ResumePoint(finished, held, finished_epochs, held_epochs)
        skips = [str(rng.randint(0, 6)) for _ in range(rng.randint(0, 3))]
        count = rng.randint(1, 3)
        for index in range(count):
            plan = Plan(
                rows(*ids),
                num_repeat_per_sample=rng.randint(1, 3),
                num_epoch=num_epoch,
                skip_instance_ids=skips,
                resume=resume,
                share=(index, count),
            )
            assert plan.total() == len(list(plan)), plan
            whole = replace(plan, share=(0, 1))
            first, later = whole.epoch_sizes()
            walked = Counter(sample.epoch for sample in whole)
            assert all(walked[epoch] == first.get(epoch, later) for epoch in range(num_epoch)), whole


def test_a_far_epoch_in_the_resume_point_is_counted_without_walking_the_rest() -> None:
    resume = ResumePoint.from_json({"finished_groups": [["q0", 1]], "finished_epochs": [["q0", 7, 1]]})
    plan = Plan(rows("q0", "q1"), num_repeat_per_sample=2, num_epoch=10**12, resume=resume)
    assert plan.total() == 2 * (2 * 10**12 - 1)
    first, later = plan.epoch_sizes()
    assert (first[0], first[7], later) == (4, 2, 4)
