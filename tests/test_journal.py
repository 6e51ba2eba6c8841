"""The buffer on disk, without HTTP: a restore rebuilds exactly the state that was journaled."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from buffer import export
from buffer.errors import BufferFull, StorageFailed
from buffer.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE, Hooks, bind_hooks
from buffer.journal import Journal, JournalCorrupt, read_records
from buffer.rollout_buffer import RolloutBuffer
from buffer.task import TaskSettings
from tests.factories import FakeClock, group, trajectory

CUSTOM_META = bind_hooks({"get_group_data_meta_info": lambda temp_data: {"instances": sorted(temp_data)}})
FAILING = bind_hooks({"normalize_group_data": lambda group, *args: 1 / 0})


def hooks_for(source: str) -> Hooks:
    """What the generator registry would give for each generator name."""
    return {"custom": CUSTOM_META, "broken": FAILING}.get(source, Hooks())


class Service:
    """A buffer with its journal in ``directory``, opened and closed as the service does."""

    def __init__(self, directory: Path, clock: FakeClock, **options: Any) -> None:
        self.journal = Journal(directory, **options)
        self.buffer = RolloutBuffer(
            TaskSettings(group_size=4, group_timeout_s=60),
            clock=clock,
            wall_clock=lambda: clock.now + 1.7e9,
            hooks_for=hooks_for,
        )
        try:
            self.restored = self.buffer.restore(self.journal.recover())
            self.buffer.attach(self.journal)
        except BaseException:
            self.journal.close()
            raise

    def close(self) -> None:
        self.journal.close()


@pytest.fixture
def open_service(tmp_path: Path, clock: FakeClock) -> Iterator[Any]:
    services: list[Service] = []

    def open_(**options: Any) -> Service:
        for service in services:  # the folder is locked: one service at a time
            service.close()
        services.append(Service(tmp_path / "data", clock, **options))
        return services[-1]

    yield open_
    for service in services:
        service.close()


def state(buffer: RolloutBuffer) -> dict[str, Any]:
    """Everything a client can observe, without changing it."""
    tasks = buffer._tasks
    return {
        "stats": {**buffer.stats(), "journal": None},  # the journal's own counters start afresh
        "ready": [(g.task_type, g.instance_id, g.seq, g.items) for g in buffer.peek()],
        "open": {
            name: [(g.instance_id, g.size, [r.uid for r in g.records]) for g in task.open.values()]
            for name, task in tasks.items()
        },
        "set_aside": [(g.task_type, g.instance_id, g.hook, g.items) for g in buffer.set_aside()],
        "meta": buffer._meta_info(list(tasks.values())),
        "finished": {name: list(task.finished_instance_ids) for name, task in tasks.items()},
        "window_discarded": {name: dict(task.window_discarded) for name, task in tasks.items()},
        "settings": {name: (task.settings, task.hooks_source, task.hooks) for name, task in tasks.items()},
        "current": buffer.current_task,
        "recent": list(buffer.recent),
        "reads": buffer.reads,
        "jobs": buffer.jobs,
    }


def fill(buffer: RolloutBuffer, clock: FakeClock) -> None:
    """A buffer with a bit of everything: two tasks, ready, open, delivered, discarded and
    set-aside groups, a duplicate, a dict reward, a custom meta hook, reads with windows."""
    buffer.configure_task("math", TaskSettings(group_size=2, reward_key="acc"), Hooks())
    buffer.configure_task(
        "eval", TaskSettings(group_size=2), EVALUATION_HOOKS, hooks_source=EVALUATION_SOURCE
    )
    buffer.configure_task("broken", TaskSettings(group_size=1), FAILING)
    buffer.configure_task("custom", TaskSettings(group_size=2), CUSTOM_META)
    for i in range(3):
        buffer.write_many(group(f"m{i}", [{"acc": 0.0}, {"acc": 1.0}], task_type="math"))
    buffer.read("math", max_items=2)  # m0 delivered; m1, m2 ready
    buffer.write(trajectory("m9", {"acc": 1.0}, task_type="math"))  # open
    duplicate = trajectory("e1", 1.0, task_type="eval")
    buffer.write(duplicate)
    buffer.write(duplicate)
    buffer.write(trajectory("e1", 0.0, task_type="eval"))
    buffer.write(trajectory("b1", 1.0, task_type="broken"))  # set aside: its hook raises
    buffer.write(trajectory("late", 1.0, task_type="math"))
    clock.advance(30)
    buffer.write(trajectory("fresh", 1.0, task_type="math"))
    buffer.configure_task("math", TaskSettings(group_size=2, group_timeout_s=40, reward_key="acc"), Hooks())
    clock.advance(15)
    buffer.expire()  # m9 and late time out (45 s > 40 s): too small, discarded; fresh stays open
    buffer.write_many(group("c1", [0.0, 1.0], task_type="custom"))
    buffer.write(trajectory("c2", 0.0, task_type="custom"))
    buffer.write(trajectory(7, 0.5))  # the current task, with an integer instance id
    buffer.job_started("math", "math", {"task_type": "math", "num_repeat_per_sample": 2})
    buffer.job_started("eval", "math", {"task_type": "eval"})
    buffer.job_ended("eval")


def test_a_restart_restores_everything_a_client_can_see(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    fill(first.buffer, clock)
    before = state(first.buffer)
    second = open_service()
    assert second.restored > 0
    assert state(second.buffer) == before
    # and it goes on the same way: the next read returns the same groups and statistics
    assert second.buffer.read().meta_info == first.buffer.read().meta_info


def test_a_snapshot_restores_the_same_state_as_the_journal(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    fill(first.buffer, clock)
    first.journal.compact()
    first.buffer.write(trajectory("after", 1.0, task_type="math"))  # into the new segment
    first.journal.wait_durable_blocking(5)
    before = state(first.buffer)
    journal_dir = first.journal.directory / "journal"
    assert len(list(journal_dir.glob("*.snapshot"))) == 1
    assert len(list(journal_dir.glob("*.log"))) == 1  # the segments it replaces are gone
    second = open_service()
    assert state(second.buffer) == before
    second.journal.compact()  # a snapshot of a restored buffer restores the same again
    assert state(open_service().buffer) == before


def test_a_group_delivered_is_never_delivered_again(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    for i in range(4):
        first.buffer.write_many(group(f"q{i}", [0, 1, 0, 1]))
    delivered = [g.instance_id for g in first.buffer.read(max_items=8).groups]
    second = open_service()
    remaining = [g.instance_id for g in second.buffer.read().groups]
    assert delivered == ["q0", "q1"]
    assert remaining == ["q2", "q3"]
    assert open_service().buffer.read().groups == []


def test_finished_groups_not_yet_reported_survive_a_restart(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.buffer.read()
    first.buffer.write(trajectory("q2", 1))
    clock.advance(120)  # q2 times out, too small: discarded, to be reported with the next read
    first.buffer.expire()
    first.buffer.write_many(group("q3", [0, 1, 0, 1]))
    meta = open_service().buffer.read().meta_info
    assert meta["finished_groups"] == ["q2", "q3"]
    assert meta["discarded_groups"] == {"timeout_too_small": 1}


def test_an_open_group_keeps_its_age_across_a_restart(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    first.buffer.write_many(group("q1", [1, 1, 1]))
    clock.advance(50)
    second = open_service()
    second.buffer.expire()
    assert second.buffer._tasks["default"].open  # 50 s of 60: still open
    clock.advance(11)
    second.buffer.expire()
    assert not second.buffer._tasks["default"].open


def test_retried_writes_are_recognised_after_a_restart(open_service: Any, clock: FakeClock) -> None:
    items = group("q1", [0, 1, 0, 1])
    open_service().buffer.write_many(items[:2])
    second = open_service()
    results = second.buffer.write_many(items)
    assert [r.duplicate for r in results] == [True, True, False, False]
    assert len(second.buffer.read().groups[0].items) == 4


def test_a_torn_last_record_is_cut_off_and_the_rest_restored(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.buffer.write(trajectory("q2", 1.0))
    first.close()
    segment = max((first.journal.directory / "journal").glob("*.log"))
    size = segment.stat().st_size
    os.truncate(segment, size - 10)  # the last write, half on disk
    second = open_service()
    assert segment.stat().st_size < size - 10  # cut back to the last whole record
    assert second.buffer.stats()["pending_items"] == 0
    assert [g.instance_id for g in second.buffer.read().groups] == ["q1"]
    second.buffer.write(trajectory("q2", 1.0))  # and the journal goes on after it
    assert open_service().buffer.stats()["pending_items"] == 1


def test_a_bad_record_before_the_end_stops_the_start_up(
    open_service: Any, clock: FakeClock, tmp_path: Path
) -> None:
    first = open_service()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.close()
    second = open_service()  # a new segment after the first
    second.buffer.write(trajectory("q2", 1.0))
    second.close()
    oldest = min((tmp_path / "data" / "journal").glob("*.log"))
    data = bytearray(oldest.read_bytes())
    data[20] ^= 0xFF
    oldest.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=oldest.name):
        Service(tmp_path / "data", clock)


def test_a_group_left_full_but_open_by_a_crash_is_finished(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.close()
    segment = max((first.journal.directory / "journal").glob("*.log"))
    events, end, _ = _records(segment)
    assert events[-1]["e"] == "fin"
    os.truncate(segment, end)  # the group's outcome never reached the disk
    assert [g.instance_id for g in open_service().buffer.read().groups] == ["q1"]


def _records(path: Path) -> tuple[list[dict[str, Any]], int, int]:
    events, end, size = read_records(path)
    last = events[-1]
    # the offset where the last record starts
    start = end - (8 + len(orjson.dumps(last.header)) + 1 + len(last.payload))
    return [e.header for e in events], start, size


def test_one_folder_serves_one_buffer(open_service: Any, clock: FakeClock, tmp_path: Path) -> None:
    open_service()
    with pytest.raises(RuntimeError, match="in use by another rollout buffer"):
        Journal(tmp_path / "data")


def test_reads_are_exported_with_their_time_and_read_id(open_service: Any, clock: FakeClock) -> None:
    service = open_service()
    service.buffer.configure_task("math", TaskSettings(group_size=2), Hooks())
    service.buffer.write_many(group("q1", [0, 1], task_type="math"))
    service.buffer.write_many(group("q2", [1, 1, 0, 0], task_type="default"))
    first = service.buffer.read("math")
    clock.advance(1)
    second = service.buffer.read("default")
    service.journal.wait_durable_blocking(5)
    lines = [
        orjson.loads(line)
        for chunk in export.read(service.journal.delivered_dir)
        for line in chunk.splitlines()
    ]
    assert [(x["read_id"], x["task_type"], x["instance_id"]) for x in lines] == [
        (1, "math", "q1"),
        (1, "math", "q1"),
        *[(2, "default", "q2")] * 4,
    ]
    delivered = [orjson.loads(item) for result in (first, second) for g in result.groups for item in g.items]
    assert [x["trajectory"] for x in lines] == delivered
    since = lines[2]["delivered_at"]
    later = b"".join(export.read(service.journal.delivered_dir, since=since))
    assert [orjson.loads(line)["read_id"] for line in later.splitlines()] == [2, 2, 2, 2]
    only_math = b"".join(export.read(service.journal.delivered_dir, task_type="math"))
    assert len(only_math.splitlines()) == 2


def test_exports_past_the_retention_are_dropped(open_service: Any, clock: FakeClock) -> None:
    service = open_service(retention_s=3600)
    old = service.journal.delivered_dir / "2020-01-01T00.jsonl"
    old.write_bytes(b"{}\n")
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.buffer.read()
    service.journal.wait_durable_blocking(5)
    assert not old.exists()
    assert len(list(service.journal.delivered_dir.glob("*.jsonl"))) == 1


def test_a_write_is_durable_when_its_wait_returns(open_service: Any, clock: FakeClock) -> None:
    service = open_service()

    async def write_and_wait() -> None:
        service.buffer.write_many(group("q1", [0, 1, 0, 1]))
        await service.buffer.wait_durable()

    asyncio.run(write_and_wait())
    segment = max((service.journal.directory / "journal").glob("*.log"))
    assert [record.header["e"] for record in read_records(segment)[0]] == ["task", "w", "w", "w", "w", "fin"]
    assert service.journal.commits >= 1


def test_a_full_buffer_refuses_new_groups_but_lets_open_ones_finish(clock: FakeClock) -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=2), clock=clock, max_buffered=3)
    buffer.write_many(group("q1", [0, 1]))
    buffer.write(trajectory("q2", 1))
    with pytest.raises(BufferFull) as refused:
        buffer.write(trajectory("q3", 1))
    assert refused.value.headers() == {"Retry-After": "1"}
    assert buffer.stats()["pending_items"] == 1  # nothing taken from the refused write
    buffer.write(trajectory("q2", 0))  # q2 is open: taken, and it finishes
    assert buffer.buffered_items() == 4
    buffer.read()
    buffer.write(trajectory("q3", 1))  # room again


def test_compaction_runs_by_itself_as_the_journal_grows(open_service: Any, clock: FakeClock) -> None:
    service = open_service(compact_bytes=64 * 1024)
    for i in range(200):  # ~1 KB a trajectory, 4 a group: well past 64 KB
        service.buffer.write_many(group(f"q{i}", [0, 1, 0, 1]))
        if i % 50 == 49:
            service.buffer.read()
    service.journal.wait_durable_blocking(5)
    for _ in range(100):
        if service.journal.compactions:
            break
        time.sleep(0.05)
    assert service.journal.compactions >= 1
    before = state(service.buffer)
    assert state(open_service().buffer) == before


def test_a_disk_that_fails_refuses_writes_and_keeps_what_reached_it(
    open_service: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = open_service()
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.journal.wait_durable_blocking(5)

    def disk_full(self: Journal, fd: int, parts: list[bytes]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Journal, "_write", disk_full)
    service.buffer.write(trajectory("q2", 1.0))
    with pytest.raises(StorageFailed, match="No space left on device"):
        service.journal.wait_durable_blocking(5)
    with pytest.raises(StorageFailed, match="No space left on device"):
        service.buffer.write(trajectory("q3", 1.0))  # refused before anything changes
    monkeypatch.undo()
    restarted = open_service()
    assert [g.instance_id for g in restarted.buffer.read().groups] == ["q1"]
    assert restarted.buffer.stats()["pending_items"] == 0  # q2 was never acknowledged
