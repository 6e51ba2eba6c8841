"""The SQLite store notices what SQLite's recovery drops silently, and gives space back.

A WAL damaged in the middle (SQLite would end its recovery there and drop every later commit)
or cut short in an acknowledged commit stops the start-up, naming the file and the numbers,
and ``check --repair`` accepts the loss; the commit a crash cut short (never acknowledged) is
dropped as before. A compaction's freed pages go back to the file system, and a database made
before that is rewritten once."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from buffer.store import check as datacheck
from buffer.store import commits, schema, snapshot_table, wal
from buffer.store.schema import JournalCorrupt
from buffer.store.sqlite import Journal
from tests.support.calls import wait_for
from tests.support.factories import FakeClock, group, trajectory
from tests.support.stores import Opened, journal, opened, tear_last_commit

FILES = ("buffer.sqlite3", "buffer.sqlite3-wal", "buffer.sqlite3-commits")


def commit_groups(service: Opened, first: int, count: int) -> None:
    """``count`` groups, each in commits of its own, acknowledged one by one."""
    for i in range(first, first + count):
        service.buffer.write_many(group(f"q{i}", [0, 1, 0, 1]))
        journal(service).wait_durable_blocking(5)


def crash_image(directory: Path, target: Path, names: tuple[str, ...] = FILES) -> Path:
    """The data folder as a SIGKILL would leave it now (the WAL not merged)."""
    target.mkdir()
    for name in names:
        shutil.copyfile(directory / name, target / name)
    return target


def start(directory: Path) -> None:
    """Open the store in ``directory`` as the service's start-up does, and close it."""
    store = Journal(directory)
    try:
        for _ in store.recover():
            pass
    finally:
        store.close()


def frame_offset(wal_path: Path, fraction: float) -> int:
    """The byte inside the page of the frame ``fraction`` of the way through the WAL."""
    page_size = int.from_bytes(wal_path.read_bytes()[8:12], "big")
    frame_size = 24 + page_size
    frames = (wal_path.stat().st_size - 32) // frame_size
    return 32 + int(frames * fraction) * frame_size + 24 + 100


def flip(path: Path, offset: int, count: int = 16) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        data = file.read(count)
        file.seek(offset)
        file.write(bytes(byte ^ 0xFF for byte in data))


def test_a_wal_damaged_in_the_middle_stops_the_start_up_naming_the_file(
    clock: FakeClock, tmp_path: Path
) -> None:
    with opened(tmp_path / "data", clock) as first:
        commit_groups(first, 0, 40)
        image = crash_image(tmp_path / "data", tmp_path / "crashed")
    flip(image / "buffer.sqlite3-wal", frame_offset(image / "buffer.sqlite3-wal", 0.5))
    wal_bytes = (image / "buffer.sqlite3-wal").read_bytes()
    with pytest.raises(JournalCorrupt, match=r"buffer\.sqlite3-wal: frame \d+ of \d+ .* --repair"):
        start(image)
    assert (image / "buffer.sqlite3-wal").read_bytes() == wal_bytes  # left as found, for a salvage

    (image / "buffer.sqlite3-commits").unlink()  # the WAL's own checksums alone say it too
    with pytest.raises(JournalCorrupt, match=r"buffer\.sqlite3-wal"):
        start(image)


def test_the_commit_count_catches_an_acknowledged_commit_cut_off_the_wal(
    clock: FakeClock, tmp_path: Path
) -> None:
    with opened(tmp_path / "data", clock) as first:
        commit_groups(first, 0, 5)
        image = crash_image(tmp_path / "data", tmp_path / "crashed")
    wal_path = image / "buffer.sqlite3-wal"
    tear_last_commit(wal_path)  # that commit was acknowledged
    assert wal.check(wal_path) is None  # a torn tail, as a crash leaves one
    with pytest.raises(JournalCorrupt, match=r"ends at event \d+, but buffer\.sqlite3-commits records"):
        start(image)


def test_a_connection_opened_on_the_store_commits_nothing_of_its_own(
    clock: FakeClock, tmp_path: Path
) -> None:
    """The cleaner and a compaction's staging open connections of their own while the service
    runs. Opening one writes nothing: every commit is the journal's, made under its write lock,
    so the last commit in the WAL is the last one acknowledged."""
    data = tmp_path / "data"
    with opened(data, clock) as first:
        commit_groups(first, 0, 2)
        wait_for(lambda: not journal(first).cleanup_pending)
        before = (data / "buffer.sqlite3-wal").read_bytes()
        side = schema.connect(data / "buffer.sqlite3", sync=False)
        try:
            assert side.execute("SELECT count(*) FROM events").fetchone()[0] > 0
            assert (data / "buffer.sqlite3-wal").read_bytes() == before
        finally:
            side.close()


def test_a_torn_commit_never_acknowledged_is_dropped_as_before(clock: FakeClock, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as first:
        commit_groups(first, 0, 5)
        count = (data / "buffer.sqlite3-commits").read_bytes()  # on disk before the next commit
        first.buffer.write(trajectory("late", 1.0))
        journal(first).wait_durable_blocking(5)
        image = crash_image(data, tmp_path / "crashed", FILES[:2])
    (image / "buffer.sqlite3-commits").write_bytes(count)
    wal_path = image / "buffer.sqlite3-wal"
    tear_last_commit(wal_path)  # the commit being written at the crash
    with opened(image, clock) as second:
        assert [g.instance_id for g in second.buffer.read().groups] == [f"q{i}" for i in range(5)]
        assert second.buffer.stats()["pending_items"] == 0


def test_a_sound_crash_image_starts_and_the_count_follows(clock: FakeClock, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as first:
        commit_groups(first, 0, 30)
        image = crash_image(data, tmp_path / "crashed")
        assert commits.read(data / "buffer.sqlite3-commits") == journal(first).position()
    with opened(image, clock) as second:
        assert len(second.buffer.read().groups) == 30


def test_check_repair_accepts_the_loss_and_resets_the_count(clock: FakeClock, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as first:
        commit_groups(first, 0, 40)
        image = crash_image(data, tmp_path / "crashed")
    flip(image / "buffer.sqlite3-wal", frame_offset(image / "buffer.sqlite3-wal", 0.5))
    found = datacheck.check(image)
    assert not found.ok
    assert any("buffer.sqlite3-wal" in problem for problem in found.problems)
    assert datacheck.check(image, repair=True).repaired
    assert (image / "buffer.sqlite3.damaged-commits").exists()
    assert datacheck.check(image).ok
    with opened(image, clock) as second:
        restored = [g.instance_id for g in second.buffer.read().groups]
    assert restored[:5] == ["q0", "q1", "q2", "q3", "q4"]  # what came before the damage
    assert len(restored) < 40  # the rest is gone, and said so


def held_bytes(database: Path) -> int:
    """The bytes of what the database holds: the log (snapshot and events) and the export."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        events = "SELECT coalesce(sum(length(header) + length(payload)), 0) FROM events"
        log = snapshot_table.live_bytes(db) + db.execute(events).fetchone()[0]
        exported = db.execute("SELECT coalesce(sum(length(trajectory)), 0) FROM delivered").fetchone()[0]
    return int(log + exported)


def big_group(index: int) -> list[dict[str, Any]]:
    answer = " ".join(f"step {index}-{n}: {os.urandom(24).hex()}" for n in range(30))  # ~2 KB
    messages = [{"role": "user", "content": f"problem {index}"}, {"role": "assistant", "content": answer}]
    return group(f"q{index}", [0, 1, 0, 1], messages=messages)


def test_a_compaction_gives_the_freed_space_back(clock: FakeClock, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with opened(data, clock, retention_s=0.0) as service:
        store = journal(service)
        for round_ in range(3):  # most of the snapshot replaced twice: its old pages are freed each time
            for i in range(200):
                service.buffer.write_many(big_group(round_ * 1000 + i))
            store.wait_durable_blocking(30)
            service.buffer.read(max_items=4 * 180)  # most delivered
            store.wait_durable_blocking(30)
            clock.now += 120.0
            store.compact()
            store.wait_durable_blocking(30)
            wait_for(lambda: not store.cleanup_pending, 60, "the cleanup after the compaction")
        assert store.compactions == 3
    size = (data / "buffer.sqlite3").stat().st_size
    held = held_bytes(data / "buffer.sqlite3")
    assert held > 2 * 2**20
    assert size <= 1.5 * held, f"{size} bytes of file for {held} bytes held"


def test_a_database_made_without_auto_vacuum_is_rewritten_once(clock: FakeClock, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as first:
        commit_groups(first, 0, 10)
    with contextlib.closing(sqlite3.connect(data / "buffer.sqlite3", isolation_level=None)) as db:
        db.execute("PRAGMA auto_vacuum = NONE")
        db.execute("VACUUM")
        assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 0  # as an older version made it
    with opened(data, clock) as second:
        assert len(second.buffer.read().groups) == 10
    with contextlib.closing(sqlite3.connect(data / "buffer.sqlite3")) as db:
        assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL
