"""The buffer core, without HTTP or an event loop."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from buffer.core.hooks import Hooks, bind_hooks
from buffer.core.pipeline import INVALID_GROUP, TIMEOUT_TOO_SMALL, TOO_FEW_VALID_ITEMS
from buffer.core.rollout_buffer import DEFAULT_TASK, RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.errors import BufferFull, InvalidInput
from tests.support.factories import FakeClock, group, trajectory


def make_buffer(clock: FakeClock, **settings: Any) -> RolloutBuffer:
    return RolloutBuffer(TaskSettings(**{"group_size": 4, **settings}), clock=clock)


def items_of(result: Any) -> list[dict[str, Any]]:
    return [orjson.loads(item) for g in result.groups for item in g.items]


def test_a_group_is_ready_when_full_and_a_read_returns_it_whole(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    for item in group("q1", [0, 1, 0]):
        buffer.write(item)
    assert buffer.read().groups == []
    buffer.write(trajectory("q1", 1))
    result = buffer.read()
    assert [g.instance_id for g in result.groups] == ["q1"]
    items = items_of(result)
    assert len(items) == 4
    assert sorted(item["raw_reward"] for item in items) == [0, 0, 1, 1]
    assert sorted(item["reward"] for item in items) == pytest.approx([-1, -1, 1, 1])
    assert buffer.read().groups == []


def test_a_later_write_of_a_finished_instance_opens_a_new_group(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    for item in group("q1", [0, 1, 0, 1, 1, 0]):
        buffer.write(item)
    result = buffer.read()
    assert [len(g.items) for g in result.groups] == [4]  # never over-full
    assert buffer.stats()["tasks"][DEFAULT_TASK]["pending_items"] == 2


def test_instance_ids_keep_their_type(clock: FakeClock) -> None:
    buffer = make_buffer(clock, group_size=2)
    buffer.write(trajectory(1, 0))
    buffer.write(trajectory("1", 1))
    assert buffer.read().groups == []  # 1 and "1" are two instances, as in slime
    buffer.write(trajectory(1, 1))
    result = buffer.read()
    assert result.groups[0].instance_id == 1
    assert result.meta_info["finished_groups"] == [1]


def test_reads_return_groups_oldest_first_and_never_split_or_drop_one(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    for name in ["a", "b", "c"]:
        for item in group(name, [0, 1, 1, 0]):
            buffer.write(item)
    first = buffer.read(max_items=6)  # room for one group of 4, not two
    assert [g.instance_id for g in first.groups] == ["a"]
    second = buffer.read(max_items=2)  # smaller than a group: one whole group still
    assert [g.instance_id for g in second.groups] == ["b"]
    assert [g.instance_id for g in buffer.read().groups] == ["c"]


def test_a_uid_written_twice_is_counted_once(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    item = trajectory("q1", 1)
    assert not buffer.write(item).duplicate
    assert buffer.write(dict(item)).duplicate
    stats = buffer.stats()
    assert stats["total_written"] == 1
    assert stats["duplicates"] == 1


def test_uids_are_generated_when_missing(clock: FakeClock) -> None:
    buffer = make_buffer(clock, group_size=2)
    uids = [buffer.write({**trajectory("q", r), "uid": None}).uid for r in (0, 1)]
    assert len(set(uids)) == 2
    assert {item["uid"] for item in items_of(buffer.read())} == set(uids)


def test_a_group_that_stops_receiving_writes_times_out_and_is_kept_when_big_enough(clock: FakeClock) -> None:
    buffer = make_buffer(clock, group_timeout_s=10, min_timeout_group_size_ratio=0.7)
    for item in group("big", [0, 1, 1]):  # 3/4 >= 0.7
        buffer.write(item)
    for item in group("small", [0, 1]):  # 2/4 < 0.7
        buffer.write(item)
    clock.advance(9.9)
    assert buffer.read().groups == []
    clock.advance(0.2)
    result = buffer.read()
    assert [g.instance_id for g in result.groups] == ["big"]
    assert len(result.groups[0].items) == 4  # padded
    assert result.meta_info["discarded_groups"] == {TIMEOUT_TOO_SMALL: 1}
    assert sorted(result.meta_info["finished_groups"]) == ["big", "small"]


def test_each_write_restarts_its_group_timeout(clock: FakeClock) -> None:
    buffer = make_buffer(clock, group_timeout_s=10)
    buffer.write(trajectory("slow", 0))
    buffer.write(trajectory("other", 0))
    for _ in range(3):  # 18 s in all, never 10 s without a write
        clock.advance(6)
        buffer.write(trajectory("slow", 1))
    buffer.expire()
    tasks = buffer.stats()["tasks"][DEFAULT_TASK]
    assert tasks["pending_groups"] == 0  # "slow" filled up, "other" timed out
    assert tasks["discarded_groups"] == {TIMEOUT_TOO_SMALL: 1}
    assert tasks["ready_groups"] == 1


def test_timeout_checks_do_not_scan_every_pending_group(clock: FakeClock) -> None:
    buffer = make_buffer(clock, group_size=8, group_timeout_s=100)
    for n in range(5000):
        buffer.write(trajectory(f"q{n}", 0.5))
    task = buffer._tasks[DEFAULT_TASK]
    visited = 0
    real_values = task.open.values

    def counting_values() -> Any:
        nonlocal visited
        for value in real_values():
            visited += 1
            yield value

    task.open.values = counting_values  # type: ignore[method-assign]
    for _ in range(100):
        buffer.expire()
    assert visited <= 100  # one look at the oldest group per check


def test_groups_with_equal_rewards_and_too_few_valid_items_are_discarded_and_reported(
    clock: FakeClock,
) -> None:
    buffer = make_buffer(clock)
    for item in group("same", [1, 1, 1, 1]) + group("failed", [-1, -1, -1, 0]) + group("good", [0, 1, 1, 1]):
        buffer.write(item)
    result = buffer.read()
    assert [g.instance_id for g in result.groups] == ["good"]
    assert result.meta_info["discarded_groups"] == {INVALID_GROUP: 1, TOO_FEW_VALID_ITEMS: 1}
    assert sorted(result.meta_info["finished_groups"]) == ["failed", "good", "same"]


def test_a_group_with_a_failed_item_is_filtered_and_padded_back(clock: FakeClock) -> None:
    buffer = make_buffer(clock, group_size=8)
    for item in group("q", [0, 1, 0, 1, 1, 0, 1, -1]):
        buffer.write(item)
    items = items_of(buffer.read())
    assert len(items) == 8
    assert len({item["uid"] for item in items}) == 8
    assert all(item["raw_reward"] != -1 for item in items)


def test_meta_info_covers_everything_written_since_the_last_successful_read(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    for item in group("q1", [0, 1, 1, 0]) + group("q2", [1, 1]):
        buffer.write(item)
    meta = buffer.read().meta_info
    assert meta["total_samples"] == 6
    assert meta["num_groups"] == 2
    assert meta["avg_group_size"] == 3
    assert meta["avg_reward"] == pytest.approx(4 / 6)
    assert meta["reward_min"] == 0
    assert meta["reward_max"] == 1
    empty = buffer.read()  # nothing returned: the window goes on
    assert empty.meta_info["total_samples"] == 0
    for item in group("q2", [0, 0]):
        buffer.write(item)
    assert buffer.read().meta_info["total_samples"] == 2


def test_served_statistics_describe_what_a_read_returns_while_a_backlog_drains(clock: FakeClock) -> None:
    """slime's figures cover what was written since the last read: nothing while the trainer
    drains a backlog. ``served`` covers the groups returned, raw rewards, every read."""
    buffer = make_buffer(clock)
    for item in group("q1", [0, 1, 1, 0]) + group("q2", [1, 1, 0, 1]) + group("q3", [1, 1, 1, 0]):
        buffer.write(item)
    first = buffer.read(max_items=4).meta_info
    assert first["total_samples"] == 12
    assert first["served"]["total_samples"] == 4
    assert first["served"]["avg_reward"] == pytest.approx(0.5)
    second = buffer.read(max_items=4).meta_info  # nothing written since the last read
    assert second["total_samples"] == 0
    assert second["served"]["num_groups"] == 1
    assert second["served"]["avg_reward"] == pytest.approx(0.75)
    assert second["served"]["reward_min"] == 0


def test_an_unsuccessful_read_reports_statistics_but_keeps_finished_groups_for_the_next(
    clock: FakeClock,
) -> None:
    buffer = make_buffer(clock)
    for item in group("same", [1, 1, 1, 1]):
        buffer.write(item)
    empty = buffer.read()
    assert empty.groups == []
    assert empty.meta_info["finished_groups"] == []
    assert empty.meta_info["total_samples"] == 4
    for item in group("good", [0, 1, 0, 1]):
        buffer.write(item)
    assert sorted(buffer.read().meta_info["finished_groups"]) == ["good", "same"]


def test_tasks_keep_separate_groups_settings_and_hooks(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    buffer.configure_task("math", TaskSettings(group_size=2), Hooks())
    buffer.configure_task("code", TaskSettings(group_size=3), Hooks())
    for item in group("q", [0, 1], task_type="math") + group("q", [1, 0, 1], task_type="code"):
        buffer.write(item)
    assert [len(g.items) for g in buffer.read("math").groups] == [2]
    assert [len(g.items) for g in buffer.read("code").groups] == [3]


def test_unlabelled_writes_go_to_the_most_recently_started_task(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    assert buffer.write(trajectory()).task_type == DEFAULT_TASK
    buffer.configure_task("math", TaskSettings(group_size=2), Hooks())
    assert buffer.write(trajectory()).task_type == "math"
    buffer.configure_task("code", TaskSettings(group_size=2), Hooks())
    assert buffer.write(trajectory()).task_type == "code"
    assert buffer.write(trajectory(task_type="math")).task_type == "math"


def test_a_read_of_all_tasks_interleaves_oldest_first_and_merges_statistics(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    buffer.configure_task("math", TaskSettings(group_size=2), Hooks())
    buffer.configure_task("code", TaskSettings(group_size=2), Hooks())
    for name, task in [("m1", "math"), ("c1", "code"), ("m2", "math")]:
        for item in group(name, [0, 1], task_type=task):
            buffer.write(item)
    result = buffer.read()
    assert [g.instance_id for g in result.groups] == ["m1", "c1", "m2"]
    assert result.meta_info["total_samples"] == 6
    assert set(result.meta_info["tasks"]) == {"math", "code"}
    assert result.meta_info["tasks"]["math"]["total_samples"] == 4


def test_reconfiguring_a_task_keeps_what_is_buffered(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    buffer.configure_task("math", TaskSettings(group_size=4), Hooks())
    for item in group("ready", [0, 1, 0, 1]) + group("open", [0, 1], task_type="math"):
        buffer.write(item)
    buffer.configure_task("math", TaskSettings(group_size=2), Hooks())
    for item in group("open", [1, 0], task_type="math"):
        buffer.write(item)
    sizes = {g.instance_id: len(g.items) for g in buffer.read("math").groups}
    assert sizes == {"ready": 4, "open": 4}  # the open group kept the size it opened with


def test_peek_leaves_groups_in_place(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    for item in group("q1", [0, 1, 0, 1]):
        buffer.write(item)
    assert [g.instance_id for g in buffer.peek()] == ["q1"]
    assert [g.instance_id for g in buffer.read().groups] == ["q1"]


def test_a_dict_of_named_rewards_trains_on_reward_key(clock: FakeClock) -> None:
    buffer = make_buffer(clock, group_size=2)
    buffer.configure_task("math", TaskSettings(group_size=2, reward_key="accuracy"), Hooks())
    buffer.write(trajectory("q", {"accuracy": 1.0, "format": 0.2}))
    buffer.write(trajectory("q", {"accuracy": 0.0, "format": 0.9}))
    items = items_of(buffer.read())
    assert sorted(item["raw_reward"] for item in items) == [0.0, 1.0]
    assert {item["rewards"]["format"] for item in items} == {0.2, 0.9}


def test_a_dict_reward_without_a_key_to_choose_is_refused_and_nothing_is_written(clock: FakeClock) -> None:
    buffer = make_buffer(clock)
    good = trajectory("q", 1)
    with pytest.raises(InvalidInput, match=r"1\.reward: names several rewards"):
        buffer.write_many([good, trajectory("q", {"a": 1, "b": 0})])
    assert buffer.stats()["total_written"] == 0
    assert not buffer.write(good).duplicate  # the refused batch did not mark its uids seen


def test_a_hook_that_raises_sets_the_group_aside_and_reads_go_on(clock: FakeClock) -> None:
    def normalize_group_data(group: Any) -> Any:
        if group[0] == "bad":
            raise ZeroDivisionError("boom")
        return group

    buffer = RolloutBuffer(clock=clock)
    buffer.configure_task(
        "math", TaskSettings(group_size=2), bind_hooks({"normalize_group_data": normalize_group_data})
    )
    for item in group("bad", [0, 1]) + group("good", [0, 1]):
        buffer.write(item)
    result = buffer.read()
    assert [g.instance_id for g in result.groups] == ["good"]
    assert result.meta_info["discarded_groups"] == {"hook_error:normalize_group_data": 1}
    (aside,) = buffer.set_aside()
    assert aside.instance_id == "bad"
    assert aside.hook == "normalize_group_data"
    assert "ZeroDivisionError: boom" in aside.error
    assert "Traceback" in aside.traceback
    assert len(aside.items) == 2


@pytest.mark.parametrize(
    ("hooks", "hook"),
    [
        ({"pad_group_data": lambda group, size: (group[0], group[1][:1])}, "pad_group_data"),
        ({"normalize_group_data": lambda group: None}, "normalize_group_data"),
        ({"is_valid_group": lambda group, size, task: "yes"}, "is_valid_group"),
        (
            {"transform_group": lambda group, task: (group[0], [{"uid": "x"} for _ in group[1]])},
            "transform_group",
        ),
    ],
)
def test_hooks_that_break_the_contract_set_the_group_aside(clock: FakeClock, hooks: Any, hook: str) -> None:
    buffer = RolloutBuffer(clock=clock)
    buffer.configure_task("math", TaskSettings(group_size=2), bind_hooks(hooks))
    for item in group("q", [0, 1]):
        buffer.write(item)
    assert buffer.read().groups == []
    assert [g.hook for g in buffer.set_aside()] == [hook]


def test_slime_pad_hooks_that_copy_uids_still_yield_distinct_uids(clock: FakeClock) -> None:
    def pad_group_data(group: Any, group_size: int) -> Any:
        instance_id, items = group
        return instance_id, (items * group_size)[:group_size]  # the same dicts again

    buffer = RolloutBuffer(clock=clock)
    buffer.configure_task(
        "math",
        TaskSettings(group_size=4, min_valid_item_size_ratio=0.5),
        bind_hooks({"pad_group_data": pad_group_data}),
    )
    for item in group("q", [0, 1, -1, -1]):
        buffer.write(item)
    items = items_of(buffer.read())
    assert len(items) == 4
    assert len({item["uid"] for item in items}) == 4


def test_older_slime_hook_signatures_are_accepted(clock: FakeClock) -> None:
    hooks = bind_hooks(
        {
            "filter_item": lambda item: item["reward"] >= 0,  # without task_type
            "is_valid_group": lambda group, min_size: len(group[1]) >= min_size,  # returns a bool
            "transform_group": lambda group: group,
        }
    )
    buffer = RolloutBuffer(clock=clock)
    buffer.configure_task("math", TaskSettings(group_size=2), hooks)
    for item in group("q", [1, 1]):
        buffer.write(item)
    assert [g.instance_id for g in buffer.read().groups] == ["q"]


def test_a_custom_meta_info_hook_sees_everything_written_since_the_last_read(clock: FakeClock) -> None:
    seen: list[dict[str, int]] = []

    def get_group_data_meta_info(temp_data: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        seen.append({key: len(items) for key, items in temp_data.items()})
        return {"groups": len(temp_data)}

    buffer = RolloutBuffer(clock=clock)
    buffer.configure_task(
        "math", TaskSettings(group_size=2), bind_hooks({"get_group_data_meta_info": get_group_data_meta_info})
    )
    for item in group("a", [0, 1]) + group("b", [0]):
        buffer.write(item)
    assert buffer.read().meta_info["groups"] == 2
    assert seen[-1] == {"a": 2, "b": 1}
    buffer.write(trajectory("b", 1))
    buffer.read()
    assert seen[-1] == {"b": 1}


def test_writes_from_other_threads_are_safe(clock: FakeClock) -> None:
    import threading

    buffer = RolloutBuffer(TaskSettings(group_size=4), clock=clock)

    def writer(prefix: str) -> None:
        for n in range(200):
            for item in group(f"{prefix}{n}", [0, 1, 0, 1]):
                buffer.write(item)

    threads = [threading.Thread(target=writer, args=(p,)) for p in "abcd"]
    for thread in threads:
        thread.start()
    delivered = 0
    while any(t.is_alive() for t in threads):
        delivered += buffer.read().num_items
    for thread in threads:
        thread.join()
    delivered += buffer.read().num_items
    assert delivered == 4 * 200 * 4


def test_a_read_counts_how_long_its_groups_waited_since_they_finished() -> None:
    """The trainer's lag: a group finished at t and read at t + 5 waited 5 s."""
    import time

    later = [0.0]
    buffer = RolloutBuffer(TaskSettings(group_size=2), wall_clock=lambda: time.time() + later[0])
    buffer.write_many(group("q1", [0, 1]) + group("q2", [1, 0]))
    later[0] = 5.0
    assert len(buffer.read(max_items=2).groups) == 1
    counters = buffer.stats()["tasks"][DEFAULT_TASK]
    assert counters["served_age_count"] == 1
    assert counters["served_age_s_sum"] == pytest.approx(5.0, abs=0.5)
    buffer.peek()  # looking is no serving
    assert buffer.stats()["tasks"][DEFAULT_TASK]["served_age_count"] == 1


def test_a_full_buffer_refuses_new_groups_but_lets_open_ones_finish(clock: FakeClock) -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=2), clock=clock, max_buffered=3)
    buffer.write_many(group("q1", [0, 1]))
    buffer.write(trajectory("q2", 1))
    with pytest.raises(BufferFull) as refused:
        buffer.write(trajectory("q3", 1))
    assert refused.value.headers() == {"Retry-After": "1"}
    assert buffer.stats()["pending_items"] == 1  # nothing taken from the refused write
    assert buffer.stats()["refused_full"] == 1
    buffer.write(trajectory("q2", 0))  # q2 is open: taken, and it finishes
    assert buffer.buffered_items() == 4
    buffer.read()
    buffer.write(trajectory("q3", 1))  # room again
