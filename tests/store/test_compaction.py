"""A compaction's cleanup, off the commit path (``buffer.store.cleanup``): the install is O(1),
the rows it replaced and the events it covers are deleted afterwards a slice at a time, and
neither a write waiting on the writer nor a crash in the middle of it sees the difference."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from buffer.store import cleanup, schema, snapshot_table
from tests.support.calls import wait_for
from tests.support.factories import FakeClock, group, trajectory
from tests.support.paths import REPO
from tests.support.stores import journal, opened, state


def garbage(database: Path) -> tuple[int, int]:
    """Rows of replaced snapshots (tables, and rows a delta replaced), and events the snapshot
    covers, still in the database."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = sum(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in schema.garbage_tables(db))
        installed = snapshot_table.generation(db)
        if installed is not None:
            dead = "SELECT count(*) FROM snap WHERE died <= ?"
            rows += db.execute(dead, (installed,)).fetchone()[0]
        covered = db.execute(
            "SELECT count(*) FROM events WHERE id <= ?", (cleanup.snapshot_through(db),)
        ).fetchone()[0]
    return rows, covered


def test_a_write_is_kept_while_a_large_cleanup_is_pending(
    clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cleanup, "ROWS", 5)  # many slices: the snapshot below is ~60 rows
    monkeypatch.setattr(cleanup, "SLICE_S", 0.0)  # that never grow
    held, holding = threading.Event(), threading.Event()
    clean_slice = cleanup.SideWriter.clean_slice

    def held_after_a_slice(side: cleanup.SideWriter, keep_bytes: int) -> bool:
        more = clean_slice(side, keep_bytes)
        holding.set()
        assert held.wait(60)
        return more

    data = tmp_path / "data"
    with opened(data, clock) as service:
        store = journal(service)
        for i in range(15):
            service.buffer.write_many(group(f"q{i}", [0, 1, 0, 1]))
        store.wait_durable_blocking(60)
        store.compact()  # the first snapshot: the 60 writes it covers are garbage
        store.wait_durable_blocking(60)
        wait_for(lambda: not store.cleanup_pending, 60, "the first cleanup")
        service.buffer.read(max_items=40)  # 10 groups delivered: their rows die at the next
        monkeypatch.setattr(cleanup.SideWriter, "clean_slice", held_after_a_slice)
        store.compact()  # a delta: the rows of the groups read, and the counters, are garbage now
        store.wait_durable_blocking(60)
        assert holding.wait(60), "the cleanup never started"
        service.buffer.write(trajectory("during", 1.0))  # the cleaner is held between two slices
        store.wait_durable_blocking(60)  # and the write is kept all the same
        assert store.cleanup_pending
        assert garbage(store.database) != (0, 0)
        before = state(service.buffer)
        held.set()
        wait_for(lambda: not store.cleanup_pending, 60, "the cleanup")
        assert garbage(store.database) == (0, 0)
    with opened(data, clock) as restarted:
        assert state(restarted.buffer) == before
        assert restarted.buffer.stats()["pending_items"] == 1


KILL_IN_THE_CLEANUP = """
import os, signal, sys, time
from pathlib import Path
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.store import cleanup, sqlite
from tests.support.factories import group

cleanup.ROWS = 2
cleanup.SLICE_S = 0.0  # slices that never grow
journal = sqlite.Journal(Path(sys.argv[1]))
buffer = RolloutBuffer(TaskSettings(group_size=4))
buffer.restore(journal.recover())
buffer.attach(journal)
for i in range(10):
    buffer.write_many(group(f"q{i}", [0.0, 1.0, 0.0, 1.0]))
journal.wait_durable_blocking(60)
journal.compact()  # the first snapshot, cleaned up
journal.wait_durable_blocking(60)
while journal.cleanup_pending:
    time.sleep(0.01)
buffer.read(max_items=8)  # q0 and q1 delivered: the next snapshot holds what is left
journal.wait_durable_blocking(60)
slices = 0
clean_slice = cleanup.SideWriter.clean_slice

def killed_in_the_middle(side, keep_bytes):  # SIGKILL after the first slice of garbage
    global slices
    more = clean_slice(side, keep_bytes)
    slices += 1
    if slices == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return more

cleanup.SideWriter.clean_slice = killed_in_the_middle
journal.compact()
journal.wait_durable_blocking(60)
signal.pause()
"""


def test_a_crash_in_the_middle_of_the_cleanup_restarts_to_the_same_state(
    clock: FakeClock, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_IN_THE_CLEANUP, str(data)], env=env, timeout=120, check=False
    )
    assert killed.returncode == -9
    rows, covered = garbage(data / "buffer.sqlite3")
    assert rows > 0  # the rows the delta replaced: partly deleted
    assert covered > 0  # the events it covers: not yet
    expected = [f"q{i}" for i in range(2, 10)]
    with opened(data, clock) as first:
        before = state(first.buffer)
        assert [g.instance_id for g in first.buffer.peek()] == expected
        wait_for(lambda: not journal(first).cleanup_pending, 60, "the rest of the cleanup")
        assert garbage(journal(first).database) == (0, 0)
    with opened(data, clock) as second:
        assert state(second.buffer) == before
        assert [g.instance_id for g in second.buffer.read().groups] == expected


def test_a_staging_left_by_a_crash_is_garbage(clock: FakeClock, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as service:
        service.buffer.write_many(group("q1", [0, 1, 0, 1]))
        journal(service).wait_durable_blocking(60)
        before = state(service.buffer)
    with contextlib.closing(sqlite3.connect(data / "buffer.sqlite3", isolation_level=None)) as db:
        # a former version's staging, as a SIGKILL leaves it
        db.execute("CREATE TABLE snapshot_next (id INTEGER PRIMARY KEY, header TEXT, payload BLOB)")
        db.execute("INSERT INTO snapshot_next VALUES (1, '{\"e\": \"state\"}', x'')")
    with opened(data, clock) as restarted:
        assert state(restarted.buffer) == before  # never read
        wait_for(lambda: not journal(restarted).cleanup_pending, 60, "the cleanup")
        assert garbage(journal(restarted).database) == (0, 0)
    with contextlib.closing(sqlite3.connect(data / "buffer.sqlite3")) as db:
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "snapshot_next" not in names
