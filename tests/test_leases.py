"""The service's work leases: one holder per item, taken back after its holder goes silent,
never granted again once its trajectory is in the buffer."""

from __future__ import annotations

import orjson

from buffer.workers.leases import LeaseBoard, item_key
from tests.factories import FakeClock, trajectory


def written(instance_id: str, repeat: int, epoch: int = 0) -> bytes:
    return orjson.dumps(trajectory(instance_id, extra_info={"epoch": epoch, "repeat": repeat}))


def test_an_item_is_granted_to_one_worker_at_a_time(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    keys = [item_key(0, "q1", r) for r in range(2)]
    assert board.claim("t", "a", keys, ttl_s=10) == keys
    assert board.claim("t", "b", keys, ttl_s=10) == []
    assert board.claim("t", "a", keys, ttl_s=10) == keys  # its own again: a renewal


def test_a_silent_workers_items_become_orphans_and_a_renewing_ones_do_not(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    board.claim("t", "a", ["k1"], ttl_s=10)
    board.claim("t", "b", ["k2"], ttl_s=10)
    clock.advance(6)
    board.claim("t", "b", [], ttl_s=10)  # b's heartbeat
    clock.advance(6)
    granted, others = board.orphans("t", "c", limit=10, ttl_s=10)
    assert granted == ["k1"]
    assert others == 1  # b still holds k2
    assert board.claim("t", "a", ["k1"], ttl_s=10) == []  # a came back too late: c has it


def test_an_item_written_is_never_granted_again(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    key = item_key(0, "q1", 1)
    board.claim("t", "a", [key], ttl_s=10)
    board.observe("t", written("q1", 1))
    clock.advance(60)
    assert board.orphans("t", "b", limit=10, ttl_s=10) == ([], 0)
    assert board.claim("t", "b", [key], ttl_s=10) == []


def test_writes_to_tasks_without_leases_are_ignored(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    board.observe("other", written("q1", 0))
    board.observe("other", b"not json")
    assert board.claim("other", "a", [item_key(0, "q1", 0)], ttl_s=1) == [item_key(0, "q1", 0)]
