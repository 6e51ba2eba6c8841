"""The buffer on disk, without HTTP: a restore rebuilds exactly the state that was journaled."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from buffer.core.hooks import EVALUATION_HOOKS, EVALUATION_SOURCE, Hooks, bind_hooks
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.errors import BufferFull, InvalidInput, StorageFailed
from buffer.service import cli
from buffer.store import check as datacheck
from buffer.store import export
from buffer.store import sqlite as journal_module
from buffer.store.sqlite import Journal, JournalCorrupt
from tests.support.factories import FakeClock, group, trajectory
from tests.support.paths import REPO

WALL_BASE = time.time() - 1000  # the fake clock's wall time: now, so the export retention keeps it
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
            wall_clock=lambda: clock.now + WALL_BASE,
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
    stats = buffer.stats()
    for counters in stats["tasks"].values():  # the trainer's lag is counted afresh by each process
        del counters["served_age_s_sum"], counters["served_age_count"]
    return {
        "stats": {**stats, "journal": None},  # the journal's own counters start afresh
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
    first.buffer.write(trajectory("after", 1.0, task_type="math"))  # after the snapshot
    first.journal.wait_durable_blocking(5)
    before = state(first.buffer)
    assert first.journal.compactions == 1
    assert [h["e"] for h in headers(first.journal.database, "events")] == ["nop", "w"]  # the rest replaced
    assert headers(first.journal.database, "snapshot")
    second = open_service()
    assert state(second.buffer) == before
    second.journal.compact()  # a snapshot of a restored buffer restores the same again
    second.journal.wait_durable_blocking(5)
    assert state(open_service().buffer) == before


def headers(database: Path, table: str) -> list[dict[str, Any]]:
    with contextlib.closing(sqlite3.connect(database)) as db:
        return [orjson.loads(row[0]) for row in db.execute(f"SELECT header FROM {table} ORDER BY id")]


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


def crash_image(journal: Journal, target: Path) -> Path:
    """The data folder as a SIGKILL would leave it now: the database and its WAL, unmerged."""
    target.mkdir()
    for suffix in ("", "-wal"):
        source = journal.database.with_name(journal.database.name + suffix)
        shutil.copyfile(source, target / source.name)
    return target


@contextlib.contextmanager
def opened(directory: Path, clock: FakeClock, **options: Any) -> Iterator[Service]:
    service = Service(directory, clock, **options)
    try:
        yield service
    finally:
        service.close()


def test_a_torn_last_commit_is_dropped_and_the_rest_restored(
    open_service: Any, clock: FakeClock, tmp_path: Path
) -> None:
    first = open_service()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.journal.wait_durable_blocking(5)
    first.buffer.write(trajectory("q2", 1.0))
    first.journal.wait_durable_blocking(5)
    image = crash_image(first.journal, tmp_path / "crashed")
    wal = image / "buffer.sqlite3-wal"
    os.truncate(wal, wal.stat().st_size - 10)  # the last commit, half on disk
    with opened(image, clock) as second:
        assert second.buffer.stats()["pending_items"] == 0
        assert [g.instance_id for g in second.buffer.read().groups] == ["q1"]
        second.buffer.write(trajectory("q2", 1.0))  # and the journal goes on after it
        second.journal.wait_durable_blocking(5)
    with opened(image, clock) as third:
        assert third.buffer.stats()["pending_items"] == 1


def corrupt_events(directory: Path) -> None:
    """Overwrite a leaf page in the middle of the events table."""
    database = directory / "buffer.sqlite3"
    with contextlib.closing(sqlite3.connect(database)) as db:
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        pages = db.execute("SELECT pageno FROM dbstat WHERE name = 'events' AND pagetype = 'leaf'").fetchall()
    page = sorted(pages)[len(pages) // 2][0]
    with database.open("r+b") as file:
        file.seek((page - 1) * page_size + 8)
        file.write(b"\xff" * 64)


def many_groups(service: Service, count: int) -> None:
    for i in range(count):
        service.buffer.write_many(group(f"q{i}", [0, 1, 0, 1]))


def test_a_damaged_database_stops_the_start_up_naming_the_file(
    open_service: Any, clock: FakeClock, tmp_path: Path
) -> None:
    many_groups(open_service(), 60)
    open_service().close()
    corrupt_events(tmp_path / "data")
    with pytest.raises(JournalCorrupt, match=r"buffer\.sqlite3"):
        Service(tmp_path / "data", clock)


def test_check_repair_salvages_every_readable_event_and_says_what_was_dropped(
    open_service: Any, clock: FakeClock, tmp_path: Path
) -> None:
    first = open_service()
    many_groups(first, 60)
    first.buffer.read(max_items=8)  # q0, q1 delivered
    first.close()
    assert datacheck.check(tmp_path / "data").ok
    corrupt_events(tmp_path / "data")
    found = datacheck.check(tmp_path / "data")
    assert not found.ok
    assert found.problems
    repaired = datacheck.check(tmp_path / "data", repair=True)
    assert repaired.repaired
    assert repaired.unreadable or repaired.not_replayed  # named, row by row
    assert (tmp_path / "data" / "buffer.sqlite3.damaged").exists()
    assert datacheck.check(tmp_path / "data").ok
    with opened(tmp_path / "data", clock) as second:
        restored = [g.instance_id for g in second.buffer.read().groups]
    assert "q0" not in restored
    assert "q59" in restored
    assert 30 < len(restored) < 58  # what the damaged page held is gone, the rest is back


def test_a_group_left_full_but_open_by_a_crash_is_finished(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    first.buffer.write_many(group("q1", [0, 1, 0, 1]))
    first.close()
    assert headers(first.journal.database, "events")[-1]["e"] == "fin"
    with contextlib.closing(sqlite3.connect(first.journal.database)) as db:
        db.execute("DELETE FROM events WHERE id = (SELECT max(id) FROM events)")  # the outcome never landed
        db.commit()
    assert [g.instance_id for g in open_service().buffer.read().groups] == ["q1"]


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
        orjson.loads(line) for chunk in export.read(service.journal.database) for line in chunk.splitlines()
    ]
    assert [(x["read_id"], x["task_type"], x["instance_id"]) for x in lines] == [
        (1, "math", "q1"),
        (1, "math", "q1"),
        *[(2, "default", "q2")] * 4,
    ]
    delivered = [orjson.loads(item) for result in (first, second) for g in result.groups for item in g.items]
    assert [x["trajectory"] for x in lines] == delivered
    since = lines[2]["delivered_at"]
    later = b"".join(export.read(service.journal.database, since=since))
    assert [orjson.loads(line)["read_id"] for line in later.splitlines()] == [2, 2, 2, 2]
    only_math = b"".join(export.read(service.journal.database, task_type="math"))
    assert len(only_math.splitlines()) == 2


def test_exports_past_the_retention_are_dropped(open_service: Any, clock: FakeClock) -> None:
    service = open_service(retention_s=3600)
    with contextlib.closing(sqlite3.connect(service.journal.database)) as db:
        db.execute("INSERT INTO delivered VALUES (1, 1, 1577836800.0, 'default', 'old', '{}')")
        db.commit()
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.buffer.read()
    service.journal.wait_durable_blocking(5)
    lines = b"".join(export.read(service.journal.database)).splitlines()
    assert [orjson.loads(line)["instance_id"] for line in lines] == ["q1"] * 4


def test_a_write_is_durable_when_its_wait_returns(open_service: Any, clock: FakeClock) -> None:
    service = open_service()

    async def write_and_wait() -> None:
        service.buffer.write_many(group("q1", [0, 1, 0, 1]))
        await service.buffer.wait_durable()

    asyncio.run(write_and_wait())
    kinds = [header["e"] for header in headers(service.journal.database, "events")]
    assert kinds == ["task", "w", "w", "w", "w", "fin"]
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


@pytest.fixture
def fast_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "RETRY_INTERVAL_S", 0.05)


class FailingCommits:
    """Makes the journal's commits raise ``error`` while ``failing`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
        self.failing = threading.Event()
        self.failing.set()
        self.error = error
        commit = Journal._commit

        def failing_commit(journal: Journal, batch: list[Any], first: int) -> None:
            if self.failing.is_set():
                raise self.error
            commit(journal, batch, first)

        monkeypatch.setattr(Journal, "_commit", failing_commit)


def wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def exported(service: Service) -> list[tuple[int, str]]:
    lines = b"".join(export.read(service.journal.database)).splitlines()
    return [(row["read_id"], row["instance_id"]) for row in map(orjson.loads, lines)]


def test_a_full_disk_takes_reads_back_refuses_changes_and_recovers_without_a_restart(
    open_service: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, fast_retry: None
) -> None:
    service = open_service()
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.buffer.write_many(group("q2", [0, 1, 0, 1]))
    service.journal.wait_durable_blocking(5)
    before = state(service.buffer)
    disk = FailingCommits(monkeypatch, sqlite3.OperationalError("database or disk is full"))
    assert [g.instance_id for g in service.buffer.read().groups] == ["q1", "q2"]
    with pytest.raises(StorageFailed, match="No space left on device"):
        service.journal.wait_durable_blocking(5)  # the reader gets a 503...
    assert [g.instance_id for g in service.buffer.peek()] == ["q1", "q2"]  # ...and the groups are back
    assert state(service.buffer) == before  # as if the read had never been
    assert service.buffer.stats()["tasks"]["default"]["delivered_groups"] == 0
    with pytest.raises(StorageFailed):
        service.buffer.write(trajectory("q3", 1.0))  # refused before anything changes
    with pytest.raises(StorageFailed):
        service.buffer.read()
    assert service.buffer.stats()["journal"]["failed"]
    disk.failing.clear()  # space freed: the writer's next try succeeds
    wait_until(lambda: service.journal.failure is None)
    service.buffer.write_many(group("q3", [0, 1, 0, 1]))
    assert [g.instance_id for g in service.buffer.read().groups] == ["q1", "q2", "q3"]
    service.journal.wait_durable_blocking(5)
    assert exported(service) == [(1, "q1")] * 4 + [(1, "q2")] * 4 + [(1, "q3")] * 4
    restarted = open_service()
    assert restarted.buffer.read().groups == []  # delivered once, never again
    assert restarted.buffer.stats()["tasks"]["default"]["delivered_groups"] == 3


def test_the_writer_survives_any_exception_and_fails_the_waiters_loudly(
    open_service: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, fast_retry: None
) -> None:
    service = open_service()
    bug = FailingCommits(monkeypatch, OverflowError("timestamp too large"))
    service.buffer.write(trajectory("q1", 1.0))
    with pytest.raises(StorageFailed, match="OverflowError: timestamp too large"):
        service.journal.wait_durable_blocking(5)  # never a hang
    bug.failing.clear()
    wait_until(lambda: service.journal.failure is None)
    service.buffer.write(trajectory("q1", 0.0))
    service.journal.wait_durable_blocking(5)
    started = time.monotonic()
    service.close()
    assert time.monotonic() - started < 5  # the writer stops when asked
    assert open_service().buffer.stats()["pending_items"] == 2  # the first write was kept on the retry


def test_an_infinite_export_retention_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="finite"):
        Journal(tmp_path / "data", retention_s=math.inf)


def test_the_journal_refuses_what_it_could_not_read_back(open_service: Any, clock: FakeClock) -> None:
    with pytest.raises(InvalidInput, match=r"s\.group_timeout_s: must be a finite number"):
        journal_module.encode({"e": "task", "s": {"group_timeout_s": math.inf, "reward_key": None}})
    service = open_service()
    with pytest.raises(InvalidInput, match="finite"):
        service.buffer.configure_task("math", TaskSettings(group_size=2, group_timeout_s=math.nan), Hooks())
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    assert [g.instance_id for g in open_service().buffer.read().groups] == ["q1"]  # it still starts


def test_compaction_never_makes_durable_a_state_ahead_of_a_queued_read(
    open_service: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    service = open_service()
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.buffer.write_many(group("q2", [0, 1, 0, 1]))
    service.journal.wait_durable_blocking(5)
    held, holding = threading.Event(), threading.Event()
    commit = Journal._commit

    def held_commit(journal: Journal, batch: list[Any], first: int) -> None:
        if journal is service.journal:
            holding.set()
            held.wait(10)
        commit(journal, batch, first)

    monkeypatch.setattr(Journal, "_commit", held_commit)
    read = service.buffer.read()  # queued behind the held writer
    assert len(read.groups) == 2
    holding.wait(5)
    service.journal.compact()  # the state without q1 and q2, staged and queued
    crashed = crash_image(service.journal, tmp_path / "crashed")  # a SIGKILL now
    with opened(crashed, clock) as after_crash:  # the read never answered: its groups are there
        assert [g.instance_id for g in after_crash.buffer.read().groups] == ["q1", "q2"]
    held.set()
    service.journal.wait_durable_blocking(5)
    assert service.journal.compactions == 1
    restarted = open_service()  # the read answered: delivered, exported, never again
    assert restarted.buffer.read().groups == []
    assert exported(restarted) == [(1, "q1")] * 4 + [(1, "q2")] * 4


KILL_DURING_EXPORT = """
import os, signal, sys
from pathlib import Path
from buffer.store import export
from buffer.store.sqlite import Journal
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from tests.support.factories import group

journal = Journal(Path(sys.argv[1]))
buffer = RolloutBuffer(TaskSettings(group_size=2))
buffer.restore(journal.recover())
buffer.attach(journal)
for i in range(3):
    buffer.write_many(group(f"q{i}", [0.0, 1.0]))
journal.wait_durable_blocking(5)

def killed(*args):  # SIGKILL between the read's record and its export
    os.kill(os.getpid(), signal.SIGKILL)

export.rows = export.lines = killed
buffer.read()
journal.wait_durable_blocking(5)
"""


def test_a_sigkill_between_a_read_and_its_export_loses_nothing(clock: FakeClock, tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_DURING_EXPORT, str(data)], env=env, timeout=60, check=False
    )
    assert killed.returncode == -signal.SIGKILL
    with opened(data, clock) as service:
        assert exported(service) == []  # neither exported...
        assert [g.instance_id for g in service.buffer.read().groups] == ["q0", "q1", "q2"]  # ...nor lost


def test_a_folder_of_the_former_journal_is_migrated_once(
    open_service: Any, clock: FakeClock, tmp_path: Path
) -> None:
    first = open_service()
    fill(first.buffer, clock)
    first.journal.wait_durable_blocking(5)
    before = state(first.buffer)
    lines = b"".join(export.read(first.journal.database))
    first.close()
    data = tmp_path / "data"
    with contextlib.closing(sqlite3.connect(first.journal.database)) as db:
        rows = db.execute("SELECT header, payload FROM events ORDER BY id").fetchall()
    (data / "journal").mkdir()
    frames = b""
    for header, payload in rows:  # the former format: <u32 length><u32 CRC-32> body
        body = header.encode() + b"\n" + payload
        frames += struct.pack("<II", len(body), zlib.crc32(body)) + body
    (data / "journal" / "00000001.log").write_bytes(frames + b"\x10\x00")  # and a torn tail
    (data / "delivered").mkdir()
    (data / "delivered" / "2026-11-21T14.jsonl").write_bytes(lines + b'{"delivered_at": 17')
    for path in data.glob("buffer.sqlite3*"):
        path.unlink()
    second = open_service()
    assert state(second.buffer) == before
    assert b"".join(export.read(second.journal.database)) == lines
    assert (data / "journal.migrated" / "00000001.log").exists()
    assert not (data / "journal").exists()
    third = open_service()  # once
    assert state(third.buffer) == before
    assert b"".join(export.read(third.journal.database)) == lines


def test_a_read_taken_back_returns_its_groups_to_their_places(
    open_service: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, fast_retry: None
) -> None:
    service = open_service()
    for name in ("q1", "q1", "q2"):  # a second group of q1: the read passes it over
        service.buffer.write_many(group(name, [0, 1, 0, 1]))
    service.journal.wait_durable_blocking(5)
    queue = service.buffer._tasks["default"].ready
    before = [(g.instance_id, g.seq) for g in queue]
    FailingCommits(monkeypatch, OSError(28, "No space left on device"))
    assert [g.instance_id for g in service.buffer.read().groups] == ["q1", "q2"]
    with pytest.raises(StorageFailed):
        service.journal.wait_durable_blocking(5)
    assert [(g.instance_id, g.seq) for g in service.buffer._tasks["default"].ready] == before
    assert service.buffer.buffered_items() == 12


def test_the_check_command_says_sound_damaged_or_repaired_in_its_exit_status(
    open_service: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def check(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exited:
            cli.main(["check", *args])
        out, err = capsys.readouterr()
        return exited.value.code if isinstance(exited.value.code, int) else 1, out + err

    many_groups(open_service(), 20)
    open_service().close()
    data = str(tmp_path / "data")
    assert check(data)[0] == 0
    corrupt_events(tmp_path / "data")
    code, said = check(data)
    assert code == 1
    assert "--repair" in said
    assert check(data, "--repair")[0] == 0
    assert check(data)[0] == 0
    code, said = check(str(tmp_path / "nowhere"))
    assert code == 2
    assert "no such folder" in said


@pytest.mark.parametrize("count", [0, 1, 7, 8, 1500])
def test_rows_inserted_in_multi_row_statements_land_all_in_order(tmp_path: Path, count: int) -> None:
    """The writer inserts a commit's rows in a few statements of a power of two of rows each:
    every row lands, in order, whatever the count (an odd one, more than one statement holds)."""
    db = journal_module.connect(tmp_path / "t.sqlite3")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, header TEXT NOT NULL, payload BLOB NOT NULL)")
    rows = [(i + 1, f'{{"e":"w","i":{i}}}', memoryview(bytes([i % 256]) * (i % 5))) for i in range(count)]
    journal_module.insert(db, "t", rows)
    stored = db.execute("SELECT id, header, payload FROM t ORDER BY id").fetchall()
    assert stored == [(i, header, bytes(payload)) for i, header, payload in rows]
    db.close()
