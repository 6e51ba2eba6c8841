"""Incremental snapshots (``buffer.core.snapshots``, ``buffer.store.snapshot_table``): after the
first, a compaction writes only what changed since the last one, and a restart from any
sequence of them, or from one that was never installed, restores what the buffer held; a
folder of the former format (one whole ``snapshot`` table) still opens."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from buffer.core.records import Piece
from buffer.errors import StorageFailed
from buffer.store import schema, snapshot_table
from buffer.store import sqlite as sqlite_store
from buffer.store.sqlite import Journal
from tests.support.calls import wait_for
from tests.support.factories import FakeClock, trajectory
from tests.support.paths import REPO
from tests.support.stores import Opened, fill, journal, opened, state


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> list[snapshot_table.Staged]:
    """Each compaction's staging, as it was written (whole or a delta, its pieces)."""
    kept: list[snapshot_table.Staged] = []
    stage = snapshot_table.Staging.stage

    def recorded(staging: snapshot_table.Staging, pieces: Iterable[Piece]) -> snapshot_table.Staged:
        kept.append(stage(staging, pieces))
        return kept[-1]

    monkeypatch.setattr(snapshot_table.Staging, "stage", recorded)
    return kept


def compact(service: Opened) -> None:
    store = journal(service)
    store.compact()
    store.wait_durable_blocking(60)


def rows(database: Path) -> dict[str, int]:
    """The snapshot's rows: live, died (garbage), in all."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        installed = snapshot_table.generation(db)
        assert installed is not None
        total = db.execute("SELECT count(*) FROM snap").fetchone()[0]
        live = len(list(snapshot_table.iter_rows(db)))
    return {"live": live, "dead": total - live}


def test_a_compaction_after_the_first_writes_what_changed(
    clock: FakeClock, tmp_path: Path, staged: list[snapshot_table.Staged]
) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as service:
        for i in range(1000):
            service.buffer.write(trajectory(f"q{i}", 0.5))  # 1,000 open groups
        compact(service)
        for i in range(10):  # 10 groups written to again, 5 finished, 5 new ones, 2 read
            service.buffer.write(trajectory(f"q{i}", 1.0))
        for i in range(5):
            service.buffer.write_many([trajectory(f"q{i}", 0.0) for _ in range(2)])
        for i in range(5):
            service.buffer.write(trajectory(f"new{i}", 1.0))
        service.buffer.read(max_items=8)
        compact(service)
        before = state(service.buffer)
        wait_for(lambda: not journal(service).cleanup_pending, 60, "the cleanup")
    assert [s.full for s in staged] == [True, False]
    assert staged[0].pieces > 1000
    # 5 open rows rewritten, 5 deleted (finished), 5 new; 3 ready rows new (2 of the 5 read
    # already: deleted, though they have no row yet); the rows rewritten every time (the
    # task's settings and counters, the buffer's state); the last chunk of the uids (under
    # 4,096: their one chunk); the window's instances' chunk deleted (the read closed it)
    assert staged[1].pieces == 5 + 5 + 5 + 3 + 2 + 3 + 1 + 1
    assert rows(data / "buffer.sqlite3") == {"live": 1 + 1000 + 3 + 3, "dead": 0}
    with opened(data, clock) as restarted:
        assert state(restarted.buffer) == before


@pytest.mark.parametrize("seed", range(12))
def test_any_sequence_of_deltas_and_restarts_restores_the_buffer(
    clock: FakeClock, tmp_path: Path, staged: list[snapshot_table.Staged], seed: int
) -> None:
    rng = random.Random(seed)
    data = tmp_path / "data"
    service = Opened(Journal(data), clock)
    restarts = 0
    try:
        fill(service.buffer, clock)  # several tasks, hooks, jobs, windows
        for step in range(400):
            action = rng.random()
            task = rng.choice(["default", "math", "custom", "eval"])
            reward: Any = {"acc": rng.random()} if task == "math" else rng.random()
            instance = rng.choice([f"i{rng.randrange(30)}", rng.randrange(5)])
            if action < 0.45:
                service.buffer.write(trajectory(instance, reward, task_type=task))
            elif action < 0.55:
                service.buffer.write_many([trajectory(instance, reward, task_type=task) for _ in range(3)])
            elif action < 0.65:
                service.buffer.read(rng.choice([None, task]), max_items=rng.randrange(1, 12))
            elif action < 0.72:
                clock.advance(rng.choice([5.0, 30.0, 70.0]))
                service.buffer.expire()
            elif action < 0.9:
                journal(service).wait_durable_blocking(60)
                compact(service)
            else:
                journal(service).wait_durable_blocking(60)
                before = state(service.buffer)
                service.close()
                service = Opened(Journal(data), clock)
                restarts += 1
                assert state(service.buffer) == before, f"step {step}"
        journal(service).wait_durable_blocking(60)
        compact(service)
        before = state(service.buffer)
    finally:
        service.close()
    with opened(data, clock) as last:
        assert state(last.buffer) == before
    assert restarts > 5
    assert staged[0].full
    assert sum(not s.full for s in staged) >= len(staged) - 2  # a whole one only first


def test_a_delta_never_installed_is_undone_and_never_read(
    clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: list[snapshot_table.Staged]
) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as service:
        for i in range(50):
            service.buffer.write(trajectory(f"q{i}", 0.5))
        compact(service)
        for i in range(20):
            service.buffer.write(trajectory(f"q{i}", 1.0))
        service.buffer.write_many([trajectory("full", 1.0) for _ in range(4)])
        journal(service).wait_durable_blocking(60)
        install = snapshot_table.install
        monkeypatch.setattr(snapshot_table, "install", lambda *args: False)  # as after a failed commit
        compact(service)
        monkeypatch.setattr(snapshot_table, "install", install)
        assert journal(service).compactions == 1
        assert [s.full for s in staged] == [True, False]
        with contextlib.closing(sqlite3.connect(data / "buffer.sqlite3")) as db:
            assert db.execute("SELECT value FROM meta WHERE key = 'snapshot_staging'").fetchone()
            assert db.execute("SELECT count(*) FROM snap WHERE born = 2").fetchone()[0] > 0
        before = state(service.buffer)
    with opened(data, clock) as restarted:  # the staging is there, never read
        assert state(restarted.buffer) == before
        compact(restarted)  # undone first; a delta of the snapshot installed
        assert [s.full for s in staged] == [True, False, False]
        wait_for(lambda: not journal(restarted).cleanup_pending, 60, "the cleanup")
        assert rows(data / "buffer.sqlite3")["dead"] == 0
        restarted.buffer.write(trajectory("q0", 0.0))
        compact(restarted)
        before = state(restarted.buffer)
    with opened(data, clock) as again:
        assert state(again.buffer) == before


def test_after_a_compaction_that_was_not_installed_the_next_is_whole(
    clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: list[snapshot_table.Staged]
) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as service:
        for i in range(10):
            service.buffer.write(trajectory(f"q{i}", 0.5))
        compact(service)
        service.buffer.write(trajectory("q1", 1.0))
        install = snapshot_table.install
        monkeypatch.setattr(snapshot_table, "install", lambda *args: False)
        compact(service)  # its capture took what changed: the next cannot be a delta of it
        monkeypatch.setattr(snapshot_table, "install", install)
        service.buffer.write(trajectory("q2", 1.0))
        compact(service)
        assert [s.full for s in staged] == [True, False, True]
        compact(service)
        assert [s.full for s in staged] == [True, False, True, False]
        before = state(service.buffer)
    with opened(data, clock) as restarted:
        assert state(restarted.buffer) == before


KILL_IN_THE_STAGING = """
import os, signal, sys
from pathlib import Path
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.store import snapshot_table, sqlite
from tests.support.factories import trajectory

snapshot_table.STAGING_ROWS = 10  # many transactions
journal = sqlite.Journal(Path(sys.argv[1]))
buffer = RolloutBuffer(TaskSettings(group_size=4, group_timeout_s=1e9))
buffer.restore(journal.recover())
buffer.attach(journal)
for i in range(100):
    buffer.write(trajectory(f"q{i}", 0.5))
journal.wait_durable_blocking(60)
journal.compact()
journal.wait_durable_blocking(60)
for i in range(60):
    buffer.write(trajectory(f"q{i}", 1.0))  # 60 open rows to replace
buffer.write_many([trajectory("r", float(n % 2)) for n in range(4)])  # ready
journal.wait_durable_blocking(60)
apply = snapshot_table.Staging._apply
chunks = 0

def killed(staging, db, rows):  # SIGKILL after 3 transactions of the delta
    global chunks
    apply(staging, db, rows)
    chunks += 1
    if chunks == 3:
        db.execute("COMMIT")
        os.kill(os.getpid(), signal.SIGKILL)

snapshot_table.STAGING_S = 1e-9  # transactions of 16 pieces
snapshot_table.Staging._apply = killed
journal.compact()
signal.pause()
"""


def test_a_sigkill_in_the_middle_of_a_delta_restarts_to_the_state_kept(
    clock: FakeClock, tmp_path: Path, staged: list[snapshot_table.Staged]
) -> None:
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_IN_THE_STAGING, str(data)], env=env, timeout=120, check=False
    )
    assert killed.returncode == -9
    with contextlib.closing(sqlite3.connect(data / "buffer.sqlite3")) as db:
        assert db.execute("SELECT count(*) FROM snap WHERE born = 2").fetchone()[0] > 0
        assert db.execute("SELECT count(*) FROM snap WHERE died = 2").fetchone()[0] > 0
    with opened(data, clock) as first:
        opened_groups = [g for g in first.buffer._tasks["default"].open.values()]
        assert [g.instance_id for g in opened_groups] == [
            *(f"q{i}" for i in range(60, 100)),
            *(f"q{i}" for i in range(60)),
        ]
        assert all(len(g.records) == 2 for g in opened_groups[40:])
        assert [g.instance_id for g in first.buffer.peek()] == ["r"]
        before = state(first.buffer)
        compact(first)
        assert [s.full for s in staged] == [False]
        wait_for(lambda: not journal(first).cleanup_pending, 60, "the cleanup")
        # the task, its open groups, the ready one, the counters, a chunk of uids, of instances
        assert rows(data / "buffer.sqlite3") == {"live": 1 + 100 + 1 + 2 + 2, "dead": 0}
    with opened(data, clock) as second:
        assert state(second.buffer) == before


def former_format(database: Path) -> None:
    """Turn a database written now into the former format, as an earlier version wrote it:
    the snapshot whole in ``snapshot(id, header, payload)``, ids from 1, no generation."""
    with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as db:
        kept = [(header, payload) for _, header, payload in snapshot_table.iter_rows(db)]
        db.execute("BEGIN")
        db.execute("DROP TABLE snap")
        db.execute("CREATE TABLE snapshot (id INTEGER PRIMARY KEY, header TEXT NOT NULL, payload BLOB)")
        db.executemany("INSERT INTO snapshot (header, payload) VALUES (?, ?)", kept)
        db.execute("DELETE FROM meta WHERE key IN ('snapshot_generation', 'snapshot_staging')")
        db.execute("UPDATE meta SET value = '1' WHERE key = 'format'")
        db.execute("COMMIT")


def test_a_folder_of_the_former_format_opens_and_is_carried_over_at_the_first_compaction(
    clock: FakeClock, tmp_path: Path, staged: list[snapshot_table.Staged]
) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as service:
        fill(service.buffer, clock)
        compact(service)
        service.buffer.write(trajectory("after", 1.0, task_type="math"))  # an event after it
        wait_for(lambda: not journal(service).cleanup_pending, 60, "the cleanup")
        before = state(service.buffer)
    former_format(data / "buffer.sqlite3")
    with opened(data, clock) as first:
        assert state(first.buffer) == before  # read from the former table
        assert "state" in first.kinds()
        first.buffer.write(trajectory("later", 0.0, task_type="math"))
        compact(first)  # whole: the former table becomes garbage
        wait_for(lambda: not journal(first).cleanup_pending, 60, "the cleanup")
        first.buffer.write(trajectory("later", 1.0, task_type="math"))
        compact(first)  # a delta of it
        before = state(first.buffer)
    assert [s.full for s in staged] == [True, True, False]
    with contextlib.closing(sqlite3.connect(data / "buffer.sqlite3")) as db:
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "snapshot" not in names
        assert not schema.garbage_tables(db)
        assert db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()[0] == "2"
    with opened(data, clock) as second:
        assert state(second.buffer) == before


@contextlib.contextmanager
def commits_failing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every commit raises a full disk until the block ends (the writer retries every 50 ms)."""
    failing = [True]
    commit = Journal._commit

    def failing_commit(store: Journal, batch: list[Any], first: int) -> None:
        if failing[0]:
            raise OSError(28, "No space left on device")
        commit(store, batch, first)

    monkeypatch.setattr(sqlite_store, "RETRY_INTERVAL_S", 0.05)
    monkeypatch.setattr(Journal, "_commit", failing_commit)
    try:
        yield
    finally:
        failing[0] = False


def test_reads_taken_back_leave_their_rows_and_a_compaction_under_way_is_dropped(
    clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: list[snapshot_table.Staged]
) -> None:
    data = tmp_path / "data"
    with opened(data, clock) as service:
        store = journal(service)
        for i in range(6):
            service.buffer.write_many([trajectory(f"q{i}", float(n % 2)) for n in range(4)])
        compact(service)  # whole: q0..q5 ready, each its row
        with commits_failing(monkeypatch):
            result = service.buffer.read(max_items=8)  # q0, q1 taken, then given back
            with pytest.raises(StorageFailed):
                store.wait_durable_blocking(5)
            wait_for(lambda: store.failure is not None, 10, "the failed commit")
        wait_for(lambda: store.failure is None, 10, "the commit again")
        assert [g.instance_id for g in result.groups] == ["q0", "q1"]
        assert [g.instance_id for g in service.buffer.peek()][:2] == ["q0", "q1"]  # given back
        service.buffer.write(trajectory("open", 1.0))
        compact(service)  # a delta: q0 and q1 keep their rows
        assert [s.full for s in staged] == [True, False]
        held, go = threading.Event(), threading.Event()
        commit = Journal._commit

        def held_then_failing(store_: Journal, batch: list[Any], first: int) -> None:
            if not go.is_set():
                held.set()
                assert go.wait(30)
                raise OSError(28, "No space left on device")
            commit(store_, batch, first)

        monkeypatch.setattr(sqlite_store, "RETRY_INTERVAL_S", 0.05)
        monkeypatch.setattr(Journal, "_commit", held_then_failing)
        service.buffer.read(max_items=4)  # q0 taken; its commit held, then failing
        assert held.wait(30)
        store.compact()  # captured with q0 taken: void once the read is given back
        failures = store.failures
        go.set()
        wait_for(lambda: store.failures > failures and store.failure is None, 10, "the commit again")
        service.buffer.write(trajectory("open", 0.0))
        store.wait_durable_blocking(30)
        assert store.compactions == 2  # the one captured before the failure was dropped
        compact(service)
        assert [s.full for s in staged] == [True, False, False, True]
        before = state(service.buffer)
        assert [g.instance_id for g in service.buffer.peek()] == [f"q{i}" for i in range(6)]
    with opened(data, clock) as restarted:
        assert state(restarted.buffer) == before
