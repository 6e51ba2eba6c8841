"""Reading the data set and planning samples: repeats, epochs, shuffles, seeds, skips."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from buffer.toolkit.dataset import DatasetError, Plan, ResumePoint, derive_seed, prompt_messages, read_rows


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rows(n: int) -> list[dict[str, object]]:
    return [{"instance_id": f"q{i}", "prompt": f"question {i}", "label": str(i)} for i in range(n)]


def test_rows_without_an_instance_id_get_their_line_number_and_keep_their_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1", "source": "x"}, {"prompt": "b"}])
    read = read_rows(path)
    assert [row["instance_id"] for row in read] == [0, 1]
    assert read[0]["source"] == "x"


def test_a_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not valid JSON"):
        read_rows(path)
    path.write_text('{"label": "1"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: a row must be an object with a prompt"):
        read_rows(path)


def test_prompts_become_chat_messages() -> None:
    assert prompt_messages("hi") == [{"role": "user", "content": "hi"}]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_messages(chat) == chat
    with pytest.raises(DatasetError):
        prompt_messages(42)


def test_each_prompt_is_repeated_in_a_row_for_every_epoch() -> None:
    plan = Plan(rows(3), num_repeat_per_sample=4, num_epoch=2, shuffle=False)
    samples = list(plan)
    assert len(samples) == plan.total() == 24
    first_epoch = [(s.instance_id, s.repeat) for s in samples[:12]]
    assert first_epoch == [(f"q{i}", r) for i in range(3) for r in range(4)]
    assert {s.epoch for s in samples[12:]} == {1}


def test_the_shuffle_is_seeded_and_differs_between_epochs() -> None:
    def order(seed: int) -> list[list[object]]:
        samples = list(Plan(rows(20), num_epoch=2, seed=seed))
        return [[s.instance_id for s in samples if s.epoch == e] for e in (0, 1)]

    assert order(1) == order(1)
    assert order(1) != order(2)
    first, second = order(1)
    assert first != second
    assert sorted(map(str, first)) == sorted(map(str, second))


def test_seeds_depend_on_instance_repeat_and_epoch_only() -> None:
    samples = list(Plan(rows(5), num_repeat_per_sample=3, num_epoch=2, seed=7))
    assert len({s.seed for s in samples}) == len(samples)
    again = {
        (s.instance_id, s.repeat, s.epoch): s.seed
        for s in Plan(rows(5), num_repeat_per_sample=3, num_epoch=2, seed=7)
    }
    assert all(again[(s.instance_id, s.repeat, s.epoch)] == s.seed for s in samples)
    assert samples[0].seed == derive_seed(7, samples[0].instance_id, samples[0].repeat, samples[0].epoch)
    assert derive_seed(8, "q0", 0, 0) != derive_seed(7, "q0", 0, 0)


def test_each_skipped_id_skips_one_group_matching_ints_and_strings() -> None:
    data = [{"instance_id": 5, "prompt": "a"}, {"instance_id": "q", "prompt": "b"}]
    plan = Plan(data, num_repeat_per_sample=2, num_epoch=3, shuffle=False, skip_instance_ids=["5", 5, "q"])
    groups = Counter((s.epoch, s.instance_id) for s in plan)
    assert set(groups.values()) == {2}  # whole groups only
    assert sorted(groups, key=str) == sorted([(2, 5), (1, "q"), (2, "q")], key=str)
    assert plan.total() == 6


def test_a_resumed_plan_skips_finished_groups_and_fills_only_the_open_ones() -> None:
    # q0 finished in both epochs, q1 in the first and holds repeats 0 and 2 of its second,
    # q2 holds one trajectory that says no repeat; the trainer also skipped q3's first group.
    resume = ResumePoint.from_json(
        {"finished_groups": [["q0", 2], ["q1", 1]], "open_groups": [["q1", [0, 2]], ["q2", [None]]]}
    )
    plan = Plan(
        rows(4), num_repeat_per_sample=4, num_epoch=2, shuffle=False, skip_instance_ids=["q3"], resume=resume
    )
    made = Counter((s.epoch, s.instance_id) for s in plan)
    assert made == {(1, "q1"): 2, (0, "q2"): 3, (1, "q2"): 4, (1, "q3"): 4}
    assert sorted(s.repeat for s in plan if s.instance_id == "q1") == [1, 3]
    assert sorted(s.repeat for s in plan if (s.epoch, s.instance_id) == (0, "q2")) == [1, 2, 3]
    assert plan.total() == sum(made.values()) == 13


def test_a_resumed_plan_matches_ids_by_their_text_as_the_skips_do() -> None:
    data = [{"instance_id": 7, "prompt": "a"}, {"instance_id": 8, "prompt": "b"}]
    resume = ResumePoint.from_json({"finished_groups": [["7", 1]], "open_groups": [[8, [1]]]})
    plan = Plan(data, num_repeat_per_sample=2, shuffle=False, resume=resume)
    assert [(s.instance_id, s.repeat) for s in plan] == [(8, 0)]


def test_a_device_or_a_pipe_is_refused_not_read(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not a regular file"):
        read_rows("/dev/zero")
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DatasetError, match="not a regular file"):
        read_rows(fifo)  # without a writer, opening it would block
    with pytest.raises(DatasetError, match="not a regular file"):
        read_rows(tmp_path)
    with pytest.raises(DatasetError, match="cannot be read"):
        read_rows(tmp_path / "missing.jsonl")


def test_a_line_or_a_file_past_its_limit_is_an_error_that_says_so(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b" * 100}])
    assert len(read_rows(path, max_line_bytes=200)) == 2
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: a line longer than 50 bytes"):
        read_rows(path, max_line_bytes=50)
    with pytest.raises(DatasetError, match="larger than 64"):
        read_rows(path, max_bytes=64)


def test_the_total_of_a_long_plan_is_counted_not_walked() -> None:
    """slime's benchmarks ask for 100,000 epochs: walking them took seconds before the first request."""
    rows = [{"instance_id": f"q{i}", "prompt": "p"} for i in range(5)]
    plan = Plan(rows, num_repeat_per_sample=8, num_epoch=10**12, share=(1, 3))
    assert plan.total() == 8 * ((5 * 10**12 - 1 + 2) // 3)


def test_the_counted_total_is_what_iteration_yields() -> None:
    rng = random.Random(7)
    for _ in range(200):
        rows = [
            {"instance_id": i % 4 if rng.random() < 0.3 else i, "prompt": "p"}
            for i in range(rng.randint(0, 7))
        ]
        skips = [rng.randint(0, 9) for _ in range(rng.randint(0, 4))]
        resume = None
        if rng.random() < 0.5:
            finished = {str(rng.randint(0, 7)): rng.randint(1, 3) for _ in range(rng.randint(0, 3))}
            held = {str(rng.randint(0, 7)): [rng.choice([0, 1, None])] for _ in range(rng.randint(0, 2))}
            resume = ResumePoint(finished, held)
        count = rng.randint(1, 3)
        for index in range(count):
            plan = Plan(
                rows,
                num_repeat_per_sample=rng.randint(1, 3),
                num_epoch=rng.randint(1, 6),
                skip_instance_ids=skips,
                resume=resume,
                share=(index, count),
            )
            assert plan.total() == len(list(plan)), plan
            whole = replace(plan, share=(0, 1))
            first, later = whole.epoch_sizes()
            walked = Counter(sample.epoch for sample in whole)
            assert all(walked[epoch] == first.get(epoch, later) for epoch in range(whole.num_epoch)), whole


def test_a_plans_samples_are_found_by_their_items_without_a_walk() -> None:
    rows = [{"instance_id": i, "prompt": f"What is {i} + 1?"} for i in range(3)]
    plan = Plan(rows, num_repeat_per_sample=2, num_epoch=10**9, seed=5)
    made = {(s.epoch, str(s.instance_id), s.repeat): s for s in Plan(rows, 2, 3, seed=5)}
    items = [(2, "1", 1), (0, "2", 0), (2, "7", 0)]  # no row 7: left out
    assert plan.find(items) == [made[(2, "1", 1)], made[(0, "2", 0)]]
    assert plan.find([(10**9 - 1, "0", 0)])[0].seed == derive_seed(5, 0, 0, 10**9 - 1)
