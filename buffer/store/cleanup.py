"""What a compaction leaves behind, given back a slice at a time, off the commit path.

A compaction's install (``sqlite``, ``snapshot_table``) is O(1): it moves the snapshot's
generation and ``meta.snapshot_through``, and renames a whole snapshot staged beside it over
the one it replaces (which becomes ``snapshot_old_N``); the rows a delta replaced (``died``)
and the events it covers stay for now. A restore reads only the rows of the generation
installed and the events after ``snapshot_through``, so what is left over is garbage, never
state. The journal's cleaner thread deletes it here (replaced tables, the rows died, the events
covered), then gives the freed pages back to the file system (``incremental_vacuum``), a slice
per transaction from its own connection under the journal's write lock, letting a queued
commit go first after each. A slice is sized by the time it takes (``SLICE_S``), not by a fixed
count: under load each one waits for a commit, and slices of a thousand rows left a million
rows to clean for minutes, holding the next compaction back. A crash in between leaves garbage
that the next start cleans up.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buffer.store import snapshot_table
from buffer.store.schema import connect, garbage_tables

logger = logging.getLogger(__name__)

#: Rows deleted by the first slice; the next ones take about ``SLICE_S`` each.
ROWS = 1000
#: Free space given back by the first slice; the same.
VACUUM_BYTES = 4 * 2**20
#: The work of one cleanup slice, in seconds: what it holds the writer back, at most about.
SLICE_S = 0.015
#: How much a slice may grow over the one before.
_GROWTH = 4.0
#: Rows a staging or cleanup connection changes between its checkpoints (outside the lock).
_CHECKPOINT_CHANGES = 4000


class SideWriter:
    """A connection that writes beside the journal's writer (the staging of a compaction, the
    cleaner): one short transaction at a time under the journal's write lock, so the writer
    waits for one at most. ``synchronous=NORMAL``: nothing waits on these commits, and the
    writer's next commit syncs the WAL they are in. Checkpoints are its own, outside the lock."""

    def __init__(self, database: Path, lock: threading.Lock, let_writer_go: Callable[[], None]) -> None:
        self.db = connect(database, sync=False)
        self.db.execute("PRAGMA wal_autocheckpoint = 0")
        self._lock = lock
        self._let_writer_go = let_writer_go  # returns once a commit queued meanwhile is made
        self._checkpointed = 0
        self._rows = ROWS  # per cleanup slice
        self._vacuum_bytes = VACUUM_BYTES
        self.work_s = 0.0  # how long the last transaction held the write lock

    def transaction(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._lock:
            started = time.monotonic()
            self.db.execute("BEGIN IMMEDIATE")
            try:
                result = work(self.db)
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    self.db.rollback()
                raise
            self.work_s = time.monotonic() - started
        self._after()
        return result

    def clean_slice(self, keep_bytes: int) -> bool:
        """One slice of cleanup: a batch of garbage rows deleted, else free pages given back
        down to ``keep_bytes``; False once there is nothing left to do."""
        if self.transaction(functools.partial(step, rows=self._rows)):
            self._rows = _resized(self._rows, self.work_s)
            return True
        with self._lock:
            started = time.monotonic()
            more = reclaim(self.db, keep_bytes, self._vacuum_bytes)
            self._vacuum_bytes = _resized(self._vacuum_bytes, time.monotonic() - started)
        self._after(checkpoint=True)  # the file is truncated when the checkpoint copies the slice
        return more

    def _after(self, *, checkpoint: bool = False) -> None:
        if checkpoint or self.db.total_changes - self._checkpointed >= _CHECKPOINT_CHANGES:
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # the writer commits on
            self._checkpointed = self.db.total_changes
        self._let_writer_go()

    def close(self) -> None:
        self.db.close()


def _resized(amount: int, took_s: float) -> int:
    """The amount of work for the next slice, from what ``amount`` took: about ``SLICE_S``."""
    scaled = amount * SLICE_S / max(took_s, 1e-4)
    return int(max(amount / _GROWTH, min(amount * _GROWTH, scaled), 1))


def snapshot_through(db: sqlite3.Connection) -> int:
    """The last event the snapshot covers (0: no snapshot)."""
    row = db.execute("SELECT value FROM meta WHERE key = 'snapshot_through'").fetchone()
    return 0 if row is None else int(row[0])


def has_garbage(db: sqlite3.Connection) -> bool:
    """Whether a compaction left anything to delete."""
    low = db.execute("SELECT min(id) FROM events").fetchone()[0]
    return (
        bool(garbage_tables(db))
        or snapshot_table.dead_rows(db)
        or (low is not None and low <= snapshot_through(db))
    )


def step(db: sqlite3.Connection, rows: int = ROWS) -> bool:
    """Delete up to ``rows`` rows of garbage, in the caller's transaction; False once there is
    none."""
    tables = garbage_tables(db)
    if tables:
        table = tables[0]
        deleted = db.execute(
            f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} ORDER BY id LIMIT {rows})"
        ).rowcount
        if deleted == 0:
            db.execute(f"DROP TABLE {table}")  # empty: no pages to free
        return True
    if snapshot_table.delete_dead(db, rows):  # the rows a delta replaced
        return True
    low = db.execute("SELECT min(id) FROM events").fetchone()[0]
    through = snapshot_through(db)
    if low is None or low > through:
        return False
    db.execute("DELETE FROM events WHERE id <= ?", (min(through, low + rows - 1),))
    return True


def reclaim(db: sqlite3.Connection, keep_bytes: int, at_most_bytes: int) -> bool:
    """Give up to ``at_most_bytes`` of the database's free pages back to the file system
    (``auto_vacuum=INCREMENTAL``: the file is truncated), keeping ``keep_bytes`` of them;
    True if more than that is left. Its own transaction (``executescript`` steps the pragma to
    its end: ``execute`` would step it once, one page)."""
    page_size = int(db.execute("PRAGMA page_size").fetchone()[0])
    free = int(db.execute("PRAGMA freelist_count").fetchone()[0])
    extra = free - keep_bytes // page_size
    if extra <= 0:
        return False
    pages = min(extra, max(1, at_most_bytes // page_size))
    started = time.monotonic()
    db.executescript(f"PRAGMA incremental_vacuum({pages})")
    left = int(db.execute("PRAGMA freelist_count").fetchone()[0])
    logger.debug(
        "gave back %.1f MB of free pages in %.3f s",
        (free - left) * page_size / 1e6,
        time.monotonic() - started,
    )
    return left < free and left > keep_bytes // page_size  # a database without auto_vacuum gives none
