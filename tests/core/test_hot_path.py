"""The write path's economies: pending groups the collector does not track, and finished groups
whose default hooks decode only the small fields, with the same outcome as whole items get."""

from __future__ import annotations

import gc
from typing import Any

import orjson
import pytest

from buffer import encoding
from buffer.core.hooks import EVALUATION_HOOKS, Hooks, bind_hooks
from buffer.core.pipeline import GroupRules, Ready, hook_item, process_group, reads_small_fields
from buffer.core.records import Event, decode
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from tests.support.factories import FakeClock, group, trajectory

TURNS = [
    {"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [-0.5, -0.25]},
]


def _items(rewards: list[float], **extra: Any) -> list[dict[str, Any]]:
    return [
        {**item, "turns": TURNS, "tools": [{"type": "function"}], "extra_info": {"epoch": 2, "n": k}}
        for k, item in enumerate(group("q", rewards, **extra))
    ]


def _finished(items: list[dict[str, Any]], hooks: Hooks, size: int, *, small: bool) -> Any:
    raws = [encoding.dumps_parted(item) for item in items]
    decoded = [hook_item(raw, head if small else 0) for raw, head in raws]
    return process_group("t", "q", decoded, GroupRules(size, 1.0, 0.5), hooks, timed_out=len(items) < size)


@pytest.mark.parametrize(
    ("rewards", "size", "hooks"),
    [
        ([0.0, 1.0, 0.5, 1.0], 4, Hooks()),  # normalised
        ([0.0, 1.0, 1.0], 4, Hooks()),  # timed out: padded, uids suffixed, rewards scaled
        ([0.0, 1.0, -1.0, 1.0, 0.25], 5, Hooks()),  # a failed item filtered out, then padded
        ([1.0, 1.0, 1.0, 1.0], 4, Hooks()),  # no diversity: discarded
        ([0.0, 2.0, 1.0], 3, EVALUATION_HOOKS),  # kept as written
    ],
)
def test_the_small_fields_give_the_outcome_whole_items_give(
    rewards: list[float], size: int, hooks: Hooks
) -> None:
    assert reads_small_fields(hooks)
    items = _items(rewards)
    whole = _finished(items, hooks, size, small=False)
    small = _finished(items, hooks, size, small=True)
    assert type(small) is type(whole)
    if isinstance(whole, Ready):
        assert [orjson.loads(item) for item in small.items] == [orjson.loads(item) for item in whole.items]
        assert small.rewards == whole.rewards
        assert all(orjson.loads(item)["turns"] == TURNS for item in small.items)
    else:
        assert small == whole


def test_a_hook_the_generator_defines_sees_whole_items() -> None:
    seen: list[dict[str, Any]] = []

    def filter_item(item: dict[str, Any], task_type: str) -> bool:
        seen.append(item)
        return True

    hooks = bind_hooks({"filter_item": filter_item})
    assert not reads_small_fields(hooks)
    buffer = RolloutBuffer(TaskSettings(group_size=2), hooks_for=lambda name: hooks)
    buffer.write_many(_items([0.0, 1.0]))
    assert [item["turns"] for item in seen] == [TURNS, TURNS]
    assert all(isinstance(item["messages"], list) and item["messages"] for item in seen)


def test_items_are_encoded_small_fields_first_and_read_back_whole() -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=2))
    items = _items([0.0, 1.0])
    buffer.write_many(items)
    served = [orjson.loads(raw) for g in buffer.read().groups for raw in g.items]
    assert [item["turns"] for item in served] == [TURNS, TURNS]
    assert [item["messages"] for item in served] == [item["messages"] for item in items]
    assert [item["raw_reward"] for item in served] == [0.0, 1.0]
    assert served[0]["reward"] < 0 < served[1]["reward"]
    raw, head = encoding.dumps_parted(items[0])
    assert orjson.loads(raw) == items[0]
    assert set(encoding.small_fields(raw, head)) == set(items[0]) - set(encoding.BULKY)


def test_pending_groups_add_no_object_the_collector_tracks(clock: FakeClock) -> None:
    """Each pending group was an object, its list and a NamedTuple per trajectory, all tracked:
    a full collection visited them all (1.5 s at a million)."""
    buffer = RolloutBuffer(TaskSettings(group_size=8), clock=clock)
    buffer.write_many(group("first", [0.5]))
    gc.collect()
    before = len(gc.get_objects())
    for start in range(0, 4000, 500):
        buffer.write_many([trajectory(f"q{n}", 0.5) for n in range(start, start + 500)])
    buffer.write_many(group("several", [0.5] * 3))
    gc.collect()
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    assert buffer.stats()["pending_items"] == 4004
    task = buffer._tasks["default"]
    assert len(task.open["several"].records) == 3
    assert task.open["several"].records[0].uid.startswith("uid-")


def test_a_group_larger_than_a_tuple_keeps_its_records_in_order(clock: FakeClock) -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=200, group_timeout_s=10), clock=clock)
    items = group("big", [n / 150 for n in range(150)])
    buffer.write_many(items)
    assert [r.uid for r in buffer._tasks["default"].open["big"].records] == [i["uid"] for i in items]
    clock.advance(11)
    buffer.expire()
    served = [orjson.loads(raw) for g in buffer.read().groups for raw in g.items]
    assert [item["uid"] for item in served[:150]] == [item["uid"] for item in items]


def test_a_journal_written_before_replays_whole_items(clock: FakeClock) -> None:
    """A ``w`` record without ``h`` (the journal of an earlier version) is decoded whole."""
    items = _items([0.0, 1.0])
    records: list[Event] = []
    for item in items:
        header = {"e": "w", "t": "default", "i": "q", "u": item["uid"], "r": item["reward"], "at": 1.0}
        records.append(decode(orjson.dumps(header) + b"\n" + orjson.dumps(item)))
    buffer = RolloutBuffer(TaskSettings(group_size=2), clock=clock)
    buffer.restore(iter(records))
    task = buffer._tasks["default"]
    assert [record.head for record in task.open["q"].records] == [0, 0]
    task.finish_full()
    served = [orjson.loads(raw) for g in buffer.read().groups for raw in g.items]
    assert [item["turns"] for item in served] == [TURNS, TURNS]
    assert [item["raw_reward"] for item in served] == [0.0, 1.0]
