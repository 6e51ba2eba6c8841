"""The replay pool (issue 24, "beyond every peer"): good groups kept after their read and served
again beside fresh ones, in a stated ratio, by a staleness-aware priority, durably.

``buffer.core.replay_pool`` has the rules; these tests go through ``RolloutBuffer`` as the
service does, and through both stores for the restarts (a restart: close the store, restore
a new buffer from the same data)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from buffer.core.hooks import bind_hooks
from buffer.core.records import ExportRow, decode
from buffer.core.replay_pool import ReplaySettings, advantage_of, replay_count
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.errors import InvalidInput
from buffer.store.base import Store
from buffer.store.memory import MemoryStore
from buffer.store.sqlite import Journal
from tests.support.factories import FakeClock, group

WALL = 1_700_000_000.0
KEEP_ALL = bind_hooks({"is_valid_group": lambda group, size, task_type: (True, True)})


def make(clock: FakeClock, capacity: int = 8, max_uses: int = 2, max_lag: int = 4) -> RolloutBuffer:
    return RolloutBuffer(
        TaskSettings(group_size=2),
        clock=clock,
        wall_clock=lambda: WALL + clock.now,
        replay=ReplaySettings(capacity, max_uses, max_lag),
    )


def fill(buffer: RolloutBuffer, names: Iterable[str], rewards: tuple[float, float] = (0.0, 1.0)) -> None:
    for name in names:
        for item in group(name, list(rewards)):
            buffer.write(item)


def ids(result: Any) -> list[str]:
    return [g.instance_id for g in result.groups]


def replayed(result: Any) -> list[str]:
    return [g.instance_id for g in result.groups[len(result.groups) - result.replayed :]]


def items(result: Any) -> list[dict[str, Any]]:
    return [orjson.loads(raw) for g in result.groups for raw in g.items]


def pool_state(buffer: RolloutBuffer) -> list[tuple[Any, ...]]:
    """Every entry of the pool, as a restart must give it back."""
    entries = buffer._reads.pool.entries.values()
    return sorted(
        (
            e.seq,
            e.task_type,
            e.instance_id,
            e.items,
            e.low,
            e.high,
            e.advantage,
            e.first_read,
            e.read_id,
            e.uses,
        )
        for e in entries
    )


# -- what is kept, and in which order ----------------------------------------------------------


def test_a_group_served_fresh_with_a_learning_signal_is_kept(clock: FakeClock) -> None:
    buffer = make(clock)
    buffer.configure_task("math", TaskSettings(group_size=2), KEEP_ALL)
    for rewards, name in (((0.0, 1.0), "varied"), ((1.0, 1.0), "equal")):
        for item in group(name, list(rewards), task_type="math"):
            buffer.write(item)
    assert ids(buffer.read()) == ["varied", "equal"]
    assert [entry[2] for entry in pool_state(buffer)] == ["varied"]  # equal rewards: nothing to learn


def test_the_pool_is_bounded_and_keeps_the_freshest_then_the_largest_advantage(clock: FakeClock) -> None:
    buffer = make(clock, capacity=3)
    buffer.policy.set_version(0)
    fill(buffer, ["old-wide"], (0.0, 1.0))  # version 0, |A| 0.5
    buffer.policy.set_version(1)
    fill(buffer, ["new-narrow"], (0.0, 0.2))  # version 1, |A| 0.1
    fill(buffer, ["new-wide"], (0.0, 1.0))  # version 1, |A| 0.5
    fill(buffer, ["new-mid"], (0.0, 0.6))  # version 1, |A| 0.3
    buffer.read()
    kept = {entry[2] for entry in pool_state(buffer)}
    assert kept == {"new-wide", "new-mid", "new-narrow"}  # the oldest version left first, however wide
    assert buffer.replay_pool()["dropped"] == {}  # a group never kept is not counted as dropped
    fill(buffer, ["fresh"])
    result = buffer.read(max_items=8, replay_ratio=0.75)  # 4 groups: up to 3 replayed, at most 3 x 1 fresh
    assert ids(result) == ["fresh", "new-wide", "new-mid", "new-narrow"]
    assert result.replayed == 3
    assert advantage_of((0.0, 1.0)) == 0.5
    assert advantage_of((1.0, 1.0)) is None


def test_a_better_group_pushes_the_lowest_out(clock: FakeClock) -> None:
    buffer = make(clock, capacity=1)
    buffer.policy.set_version(0)
    fill(buffer, ["a"])
    buffer.read()
    buffer.policy.set_version(1)
    fill(buffer, ["b"])
    buffer.read()
    assert [entry[2] for entry in pool_state(buffer)] == ["b"]
    assert buffer.replay_pool()["dropped"] == {"default": {"capacity": 1}}


# -- the ratio -----------------------------------------------------------------------------------


def test_a_read_takes_at_most_its_ratio_from_the_pool_and_the_rest_fresh(clock: FakeClock) -> None:
    buffer = make(clock)
    fill(buffer, [f"p{i}" for i in range(4)])
    buffer.read()  # four groups in the pool
    fill(buffer, [f"f{i}" for i in range(8)])
    result = buffer.read(max_items=8, replay_ratio=0.5)  # a batch of 4 groups
    assert ids(result) == ["f0", "f1", "p3", "p2"]
    assert result.meta_info["replayed"] == 2
    assert result.meta_info["returned_groups"] == 4
    result = buffer.read(max_items=8, replay_ratio=0.3)  # floor(0.3 x 4) = 1: f1, kept by the last read
    assert ids(result) == ["f2", "f3", "f4", "f1"]


def test_fresh_groups_short_are_not_made_up_by_replay(clock: FakeClock) -> None:
    buffer = make(clock)
    fill(buffer, [f"p{i}" for i in range(4)])
    buffer.read()
    fill(buffer, ["f0"])
    result = buffer.read(max_items=16, replay_ratio=0.5)  # 8 groups asked, 1 fresh: 1 replayed, not 4
    assert ids(result) == ["f0", "p3"]
    assert buffer.read(max_items=16, replay_ratio=0.5).groups == []  # no fresh group: nothing at all
    fill(buffer, ["f1"])
    assert replayed(buffer.read(max_items=16, replay_ratio=0.25)) == []  # 1 replayed of 2 is past 0.25
    assert [replay_count(0.5, 1, 8), replay_count(0.25, 3, None), replay_count(0.2, 4, 5)] == [1, 1, 1]


def test_a_replayed_group_is_never_one_of_an_instance_the_read_serves_fresh(clock: FakeClock) -> None:
    buffer = make(clock)
    fill(buffer, ["q"])
    buffer.read()
    fill(buffer, ["q", "r"])
    result = buffer.read(max_items=8, replay_ratio=0.5)
    assert ids(result) == ["q", "r"]  # the kept q waits: slime merges one read's groups by instance
    assert result.replayed == 0


def test_a_read_of_one_task_replays_that_tasks_groups_only(clock: FakeClock) -> None:
    buffer = make(clock)
    fill(buffer, ["m"], (0.0, 1.0))
    for item in group("c", [0.0, 1.0], task_type="code"):
        buffer.write(item)
    buffer.read()
    fill(buffer, ["m2"])
    result = buffer.read("default", max_items=4, replay_ratio=0.5)
    assert ids(result) == ["m2", "m"]


# -- leaving: uses and lag -----------------------------------------------------------------------


def test_a_group_leaves_after_max_uses(clock: FakeClock) -> None:
    buffer = make(clock, capacity=1, max_uses=2)
    buffer.configure_task("default", TaskSettings(group_size=2), KEEP_ALL)
    fill(buffer, ["p"])
    buffer.read()
    uses = []
    for step in range(3):
        fill(buffer, [f"h{step}"], (1.0, 1.0))  # equal rewards: served fresh, never kept
        result = buffer.read(max_items=4, replay_ratio=0.5)
        uses += [
            item["extra_info"]["replay"]["uses"] for item in items(result) if "replay" in item["extra_info"]
        ]
    assert uses == [1, 1, 2, 2]  # two trajectories a group, replayed twice, then gone
    assert pool_state(buffer) == []
    counters = buffer.replay_pool()
    assert counters["replayed"] == {"default": 2}
    assert counters["dropped"] == {"default": {"uses": 1}}


def test_a_group_past_max_lag_is_never_served_and_leaves(clock: FakeClock) -> None:
    buffer = make(clock, max_lag=1, max_uses=3)
    buffer.configure_task("default", TaskSettings(group_size=2), KEEP_ALL)
    buffer.policy.set_version(0)
    fill(buffer, ["old"])
    buffer.read()
    buffer.policy.set_version(1)
    fill(buffer, ["f1"], (1.0, 1.0))  # fresh groups with equal rewards: never kept
    assert ids(buffer.read(max_items=4, replay_ratio=0.5)) == ["f1", "old"]  # lag 1: still served
    buffer.policy.set_version(2)
    fill(buffer, ["f2"], (1.0, 1.0))
    assert ids(buffer.read(max_items=4, replay_ratio=0.5)) == ["f2"]  # old is 2 behind: gone
    assert pool_state(buffer) == []
    assert buffer.replay_pool()["dropped"] == {"default": {"lag": 1}}


# -- marked, and counted apart from fresh groups ------------------------------------------------


def test_replayed_trajectories_are_marked_and_otherwise_as_first_served(clock: FakeClock) -> None:
    buffer = make(clock)
    buffer.policy.set_version(3)
    fill(buffer, ["p"])
    first = buffer.read()
    delivered = buffer.total_read
    buffer.policy.set_version(5)
    fill(buffer, ["f"])
    clock.advance(10)
    result = buffer.read(max_items=4, replay_ratio=0.5)
    fresh, again = items(result)[:2], items(result)[2:]
    assert all("replay" not in item["extra_info"] for item in fresh)
    marks = [item["extra_info"].pop("replay") for item in again]
    assert marks == [{"uses": 1, "first_read": WALL + 1000.0, "read_id": 1, "version_lag": 2}] * 2
    assert again == items(first)  # rewards, versions, everything else as first served
    assert buffer.total_read == delivered + 2  # the fresh group alone counts as delivered
    assert result.meta_info["finished_groups"] == ["f"]
    assert buffer.stats()["tasks"]["default"]["delivered_groups"] == 2


def test_a_replayed_sample_keeps_its_rollout_logprobs_and_versions(clock: FakeClock) -> None:
    from buffer.trainer.samples import samples_from_turns

    buffer = make(clock)
    turn = {
        "prompt_ids": [1, 2, 3],
        "output_ids": [7, 8],
        "output_logprobs": [-0.5, -0.25],
        "finish_reason": "stop",
        "message_index": 1,
        "weight_version": 4,
        "weight_versions": [[3, 1], [4, 1]],
        "logprobs": "sampling",
    }
    for item in group("p", [0.0, 1.0], turns=[turn]):
        buffer.write(item)
    first = items(buffer.read())
    fill(buffer, ["f"])
    again = items(buffer.read(max_items=4, replay_ratio=0.5))[2:]
    for original, replay in zip(first, again, strict=True):
        (old,) = samples_from_turns(original, original["reward"], original["raw_reward"])
        (new,) = samples_from_turns(replay, replay["reward"], replay["raw_reward"])
        assert new.rollout_log_probs == old.rollout_log_probs == [-0.5, -0.25]
        assert new.token_versions == old.token_versions == [3, 4]
        assert new.metadata["replay"]["uses"] == 1


# -- off: nothing changes ---------------------------------------------------------------------


def test_with_the_pool_off_reads_and_records_are_as_before(clock: FakeClock) -> None:
    def run(replay: ReplaySettings | None) -> tuple[list[Any], list[Any]]:
        store = MemoryStore()
        buffer = RolloutBuffer(
            TaskSettings(group_size=2), clock=clock, wall_clock=lambda: WALL, replay=replay
        )
        buffer.restore(store.recover())
        buffer.attach(store)
        reads = []
        for step in range(3):
            for i in range(3):
                for j, item in enumerate(group(f"q{step}-{i}", [0.0, 1.0])):
                    buffer.write({**item, "uid": f"{step}-{i}-{j}"})
            result = buffer.read(max_items=4)
            reads.append((ids(result), items(result), result.meta_info, result.replayed))
        records = [decode(record) for record in (*store._snapshot, *store._events)]
        store.close()
        for event in records:
            event.header.pop("at", None)  # a group's finishing time is the process's clock
        return reads, records

    before = run(None)
    assert run(ReplaySettings(capacity=0)) == before
    assert [event.header["e"] for event in before[1]].count("read") == 3
    assert all("pool" not in event.header for event in before[1])
    with pytest.raises(InvalidInput) as refused:
        make(clock, capacity=0).read(max_items=4, replay_ratio=0.5)
    assert refused.value.errors[0]["field"] == "replay_ratio"
    assert "--replay-capacity" in refused.value.errors[0]["reason"]


# -- durable -----------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "memory"])
def reopen(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[Callable[..., Any]]:
    """Open a buffer over the test's store, closing the one open before: a restart."""
    memory: list[MemoryStore] = []
    opened: list[Store] = []

    def open_(capacity: int = 8, store: Store | None = None) -> RolloutBuffer:
        for previous in opened:
            previous.close()
        if store is None:
            if request.param == "sqlite":
                store = Journal(tmp_path / "data", sync=False)
            else:
                memory[:] = memory or [MemoryStore()]
                store = memory[0]
        opened.append(store)
        buffer = make(clock, capacity=capacity)
        buffer.restore(store.recover())
        buffer.attach(store)
        return buffer

    yield open_
    for store in opened:
        store.close()


def used_once(buffer: RolloutBuffer) -> None:
    """Groups in the pool, one of them replayed once."""
    buffer.policy.set_version(1)
    fill(buffer, ["a", "b", "c"])
    buffer.read()
    fill(buffer, ["d"])
    assert replayed(buffer.read(max_items=4, replay_ratio=0.5)) == ["c"]
    buffer.journal.wait_durable_blocking(10)  # type: ignore[union-attr]


def test_a_restart_keeps_the_pool_and_its_use_counts(reopen: Callable[..., RolloutBuffer]) -> None:
    buffer = reopen()
    used_once(buffer)
    kept = pool_state(buffer)
    assert [(entry[2], entry[-1]) for entry in kept] == [("a", 0), ("b", 0), ("c", 1), ("d", 0)]
    again = reopen()
    assert pool_state(again) == kept
    again.policy.set_version(1)
    fill(again, ["e"])
    result = again.read(max_items=4, replay_ratio=0.5)
    assert replayed(result) == ["d"]
    assert items(result)[-1]["extra_info"]["replay"]["uses"] == 1


def test_a_compaction_keeps_the_pool(reopen: Callable[..., RolloutBuffer]) -> None:
    buffer = reopen()
    used_once(buffer)
    kept = pool_state(buffer)
    store = buffer.journal
    assert store is not None
    store.compact()  # the read records are replaced: only the snapshot's pool records hold the pool
    store.wait_durable_blocking(10)
    assert store.counters()["compactions"] == 1
    assert pool_state(reopen()) == kept


def test_a_restart_with_the_pool_turned_off_lets_its_groups_go_at_the_next_read(
    reopen: Callable[..., RolloutBuffer],
) -> None:
    used_once(reopen())
    off = reopen(capacity=0)
    assert len(pool_state(off)) == 4
    fill(off, ["e"])
    assert ids(off.read()) == ["e"]
    assert pool_state(off) == []
    assert pool_state(reopen(capacity=0)) == []  # and that too is kept


class Faulty(MemoryStore):
    """A store that, once ``fault`` is set, crashes between a read and its record (``lose``:
    the read is never kept) or cannot keep it and takes it back (``refuse``: ``undo``, as a
    failed commit does)."""

    fault: str | None = None

    def read(self, record: bytes, rows: Callable[[], Iterable[ExportRow]], undo: Callable[[], None]) -> None:
        if self.fault == "refuse":
            undo()
        elif self.fault is None:
            super().read(record, rows, undo)


def opened(clock: FakeClock, store: Store, **settings: Any) -> RolloutBuffer:
    buffer = make(clock, **settings)
    buffer.restore(store.recover())
    buffer.attach(store)
    return buffer


def test_a_crash_between_a_read_and_its_record_loses_nothing_and_duplicates_nothing(
    clock: FakeClock,
) -> None:
    store = Faulty()
    buffer = opened(clock, store)
    used_once(buffer)
    before = pool_state(buffer)
    fill(buffer, ["e"])
    store.fault = "lose"
    assert replayed(buffer.read(max_items=4, replay_ratio=0.5)) == ["d"]  # served, then the crash
    store.close()
    store.fault = None
    again = opened(clock, store)
    assert pool_state(again) == before  # d's use and e's entry never happened
    again.policy.set_version(1)
    result = again.read(max_items=4, replay_ratio=0.5)
    assert ids(result) == ["e", "d"]  # e fresh again, d replayed for the first time again
    assert [entry[2] for entry in pool_state(again)].count("e") == 1
    store.close()


def test_a_read_the_store_takes_back_leaves_the_pool_as_it_was(clock: FakeClock) -> None:
    store = Faulty()
    buffer = opened(clock, store, capacity=2)
    fill(buffer, ["a", "b"])
    buffer.read()
    counters, before = buffer.replay_pool(), pool_state(buffer)
    fill(buffer, ["c", "d"])
    store.fault = "refuse"
    result = buffer.read(max_items=8, replay_ratio=0.5)
    assert ids(result) == ["c", "d", "b", "a"]  # a and b replayed, c and d kept: a and b evicted
    assert pool_state(buffer) == before  # ... all of it taken back
    assert buffer.replay_pool() == counters
    assert [g.instance_id for g in buffer.peek()] == ["c", "d"]  # given back, ready again
    store.close()
