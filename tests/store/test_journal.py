"""The SQLite store (``Journal``): what only a data folder does. What every store does is in
``test_contract.py``, which runs on this backend too.

A restore after a compaction replaces the events table; a torn last commit, a damaged database
(refused at start-up, salvaged by ``check --repair``), a crash between a group's last write and
its outcome; a full disk and any exception in the writer; a compaction racing a queued read, a
SIGKILL in a read's transaction; the migration of the former journal files; bulk inserts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from buffer.errors import StorageFailed
from buffer.service import cli
from buffer.store import check as datacheck
from buffer.store import export, schema
from buffer.store import sqlite as journal_module
from buffer.store.schema import JournalCorrupt
from buffer.store.sqlite import Journal
from tests.support.calls import wait_for
from tests.support.factories import FakeClock, group, trajectory
from tests.support.paths import REPO
from tests.support.stores import Opened, fill, state, tear_last_commit


class Service(Opened):
    """A buffer with its journal in ``directory``, opened and closed as the service does."""

    def __init__(self, directory: Path, clock: FakeClock, **options: Any) -> None:
        super().__init__(Journal(directory, **options), clock)

    @property
    def journal(self) -> Journal:
        assert isinstance(self.store, Journal)
        return self.store


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


def test_a_snapshot_replaces_the_events_it_covers(open_service: Any, clock: FakeClock) -> None:
    first = open_service()
    fill(first.buffer, clock)
    first.journal.compact()
    first.buffer.write(trajectory("after", 1.0, task_type="math"))  # after the snapshot
    first.journal.wait_durable_blocking(60)
    before = state(first.buffer)
    assert first.journal.compactions == 1
    wait_for(lambda: not first.journal.cleanup_pending, 60, "the cleanup after the compaction")
    assert [h["e"] for h in headers(first.journal.database, "events")] == ["nop", "w"]  # the rest replaced
    assert headers(first.journal.database, "snap")
    assert state(open_service().buffer) == before


def headers(database: Path, table: str) -> list[dict[str, Any]]:
    with contextlib.closing(sqlite3.connect(database)) as db:
        return [orjson.loads(row[0]) for row in db.execute(f"SELECT header FROM {table} ORDER BY id")]


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
    first.journal.wait_durable_blocking(60)
    first.buffer.write(trajectory("q2", 1.0))
    first.journal.wait_durable_blocking(60)
    image = crash_image(first.journal, tmp_path / "crashed")
    wal = image / "buffer.sqlite3-wal"
    tear_last_commit(wal)  # the last commit, half on disk
    with opened(image, clock) as second:
        assert second.buffer.stats()["pending_items"] == 0
        assert [g.instance_id for g in second.buffer.read().groups] == ["q1"]
        second.buffer.write(trajectory("q2", 1.0))  # and the journal goes on after it
        second.journal.wait_durable_blocking(60)
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
    (first.journal.database.parent / "buffer.sqlite3-commits").unlink()  # nor was it counted
    assert [g.instance_id for g in open_service().buffer.read().groups] == ["q1"]


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


def exported(service: Service) -> list[tuple[int, str]]:
    lines = b"".join(export.read(service.journal)).splitlines()
    return [(row["read_id"], row["instance_id"]) for row in map(orjson.loads, lines)]


def test_a_full_disk_takes_reads_back_refuses_changes_and_recovers_without_a_restart(
    open_service: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, fast_retry: None
) -> None:
    service = open_service()
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.buffer.write_many(group("q2", [0, 1, 0, 1]))
    service.journal.wait_durable_blocking(60)
    before = state(service.buffer)
    disk = FailingCommits(monkeypatch, sqlite3.OperationalError("database or disk is full"))
    assert [g.instance_id for g in service.buffer.read().groups] == ["q1", "q2"]
    with pytest.raises(StorageFailed, match="No space left on device"):
        service.journal.wait_durable_blocking(60)  # the reader gets a 503...
    assert [g.instance_id for g in service.buffer.peek()] == ["q1", "q2"]  # ...and the groups are back
    assert state(service.buffer) == before  # as if the read had never been
    assert service.buffer.stats()["tasks"]["default"]["delivered_groups"] == 0
    with pytest.raises(StorageFailed):
        service.buffer.write(trajectory("q3", 1.0))  # refused before anything changes
    with pytest.raises(StorageFailed):
        service.buffer.read()
    assert service.buffer.stats()["journal"]["failed"]
    disk.failing.clear()  # space freed: the writer's next try succeeds
    wait_for(lambda: service.journal.failure is None, what="the writer to recover")
    service.buffer.write_many(group("q3", [0, 1, 0, 1]))
    assert [g.instance_id for g in service.buffer.read().groups] == ["q1", "q2", "q3"]
    service.journal.wait_durable_blocking(60)
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
        service.journal.wait_durable_blocking(60)  # never a hang
    bug.failing.clear()
    wait_for(lambda: service.journal.failure is None, what="the writer to recover")
    service.buffer.write(trajectory("q1", 0.0))
    service.journal.wait_durable_blocking(60)
    closing = threading.Thread(target=service.close)
    closing.start()
    closing.join(60)  # the writer stops when asked: at once, or within a busy machine's minute
    assert not closing.is_alive(), "close() hangs"
    assert open_service().buffer.stats()["pending_items"] == 2  # the first write was kept on the retry


def test_compaction_never_makes_durable_a_state_ahead_of_a_queued_read(
    open_service: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    service = open_service()
    service.buffer.write_many(group("q1", [0, 1, 0, 1]))
    service.buffer.write_many(group("q2", [0, 1, 0, 1]))
    service.journal.wait_durable_blocking(60)
    held, holding = threading.Event(), threading.Event()
    commit = Journal._commit

    def held_commit(journal: Journal, batch: list[Any], first: int) -> None:
        if journal is service.journal:
            holding.set()
            held.wait(60)
        commit(journal, batch, first)

    monkeypatch.setattr(Journal, "_commit", held_commit)
    read = service.buffer.read()  # queued behind the held writer
    assert len(read.groups) == 2
    assert holding.wait(60)
    service.journal.compact()  # the state without q1 and q2, staged and queued
    crashed = crash_image(service.journal, tmp_path / "crashed")  # a SIGKILL now
    with opened(crashed, clock) as after_crash:  # the read never answered: its groups are there
        assert [g.instance_id for g in after_crash.buffer.read().groups] == ["q1", "q2"]
    held.set()
    service.journal.wait_durable_blocking(60)
    assert service.journal.compactions == 1
    restarted = open_service()  # the read answered: delivered, exported, never again
    assert restarted.buffer.read().groups == []
    assert exported(restarted) == [(1, "q1")] * 4 + [(1, "q2")] * 4


KILL_DURING_EXPORT = """
import os, signal, sys
from pathlib import Path
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.store import sqlite
from buffer.store.schema import DELIVERED
from tests.support.factories import group

journal = sqlite.Journal(Path(sys.argv[1]))
buffer = RolloutBuffer(TaskSettings(group_size=2))
buffer.restore(journal.recover())
buffer.attach(journal)
for i in range(3):
    buffer.write_many(group(f"q{i}", [0.0, 1.0]))
journal.wait_durable_blocking(60)
insert = sqlite.insert

def killed_in_the_export(db, into, rows):  # SIGKILL after the read's record, before its export
    if into == DELIVERED:
        os.kill(os.getpid(), signal.SIGKILL)
    insert(db, into, rows)

sqlite.insert = killed_in_the_export
buffer.read()
journal.wait_durable_blocking(60)
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
    first.journal.wait_durable_blocking(60)
    before = state(first.buffer)
    lines = b"".join(export.read(first.journal))
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
    assert b"".join(export.read(second.journal)) == lines
    assert (data / "journal.migrated" / "00000001.log").exists()
    assert not (data / "journal").exists()
    third = open_service()  # once
    assert state(third.buffer) == before
    assert b"".join(export.read(third.journal)) == lines


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
    db = schema.connect(tmp_path / "t.sqlite3")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, header TEXT NOT NULL, payload BLOB NOT NULL)")
    rows = [(i + 1, f'{{"e":"w","i":{i}}}', memoryview(bytes([i % 256]) * (i % 5))) for i in range(count)]
    schema.insert(db, "t", rows)
    stored = db.execute("SELECT id, header, payload FROM t ORDER BY id").fetchall()
    assert stored == [(i, header, bytes(payload)) for i, header, payload in rows]
    db.close()


def test_a_read_after_a_restore_reports_what_it_returns(open_service: Any, clock: FakeClock) -> None:
    """Groups restored ready (from a snapshot or their events) carry no rewards yet: the read's
    ``served`` statistics come from their items, padded copies left out."""
    first = open_service()
    for item in group("q1", [1.0, 0.0, 1.0, 1.0], task_type="math"):
        first.buffer.write(item)
    first.journal.compact()
    first.journal.wait_durable_blocking(60)
    served = open_service().buffer.read(task_type="math").meta_info["served"]
    assert served["total_samples"] == 4
    assert served["avg_reward"] == 0.75
