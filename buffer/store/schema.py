"""The data folder's SQLite database: its tables, how it is opened and locked, bulk inserts.

    DATA_DIR/
      LOCK                 flock-ed while a service uses the folder
      buffer.sqlite3       (with -wal and -shm beside it while open)
        events(id, header, payload)      the changes after meta.snapshot_through, in order, ids dense
                                         (those before it: garbage the cleaner deletes)
        snap(id, key, born, died, header, payload)   the state as of the events it replaced, kept
                                         from one compaction to the next (``snapshot_table``):
                                         the rows of meta.snapshot_generation
        snap_next, snapshot_old_N        a whole snapshot's staging; replaced tables (garbage)
        snapshot(id, header, payload)    the former format's whole snapshot (until the first
                                         compaction replaces it)
        delivered(id, read_id, delivered_at, task_type, instance_id, trajectory)   the export
        meta(key, value)                 the format, the last event id, the snapshot's generation,
                                         what it covers, a staging under way
      buffer.sqlite3-commits  the last event id committed, checked at start-up (``commits``)

What the journal (``sqlite``), the migration of the former journal files (``migration``) and
``rollout-buffer check`` (``check``) share, so that none of them imports another for it.
"""

from __future__ import annotations

import fcntl
import functools
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

DATABASE = "buffer.sqlite3"
#: 2: the snapshot kept from one compaction to the next (``snapshot_table``); 1: rewritten whole.
FORMAT_VERSION = 2
_WAL_LIMIT_BYTES = 64 * 2**20
#: The page size of a new database (an existing one keeps its own). A record (a trajectory,
#: about 2 KB) would take most of a 4 KB page, each written to the WAL by its own syscalls
#: and copied again at each checkpoint; 16 KB pages hold several, which cut the writer's CPU
#: per commit. Larger pages cost more than they save: each commit writes whole pages.
PAGE_SIZE = 16384

LOG_COLUMNS = "(id INTEGER PRIMARY KEY, header TEXT NOT NULL, payload BLOB NOT NULL)"
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events {LOG_COLUMNS};
CREATE TABLE IF NOT EXISTS delivered (
    id INTEGER PRIMARY KEY,
    read_id INTEGER NOT NULL,
    delivered_at REAL NOT NULL,
    task_type TEXT NOT NULL,
    instance_id NOT NULL,
    trajectory TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS delivered_at ON delivered (delivered_at);
"""
#: The export table with the columns an insert fills.
DELIVERED = "delivered (read_id, delivered_at, task_type, instance_id, trajectory)"


class JournalCorrupt(Exception):
    """The data folder is damaged: the start-up stops, naming the file and the problem.
    ``rollout-buffer check DIR --repair`` salvages what can be read."""


def connect(path: Path, *, sync: bool = True, readonly: bool = False) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL, and the
    ``synchronous`` level the durability asks for."""
    if readonly:
        connection = sqlite3.connect(
            f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
        )
    else:
        connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA busy_timeout = 60000")
    if not readonly:
        if connection.execute("PRAGMA page_count").fetchone()[0] == 0:
            # A new database only: on one that exists, setting auto_vacuum commits a write of
            # its first page (even to the value it has), from a connection outside the
            # journal's write lock, after the last commit acknowledged. An older database is
            # VACUUMed into it once (migration.reclaim_space).
            connection.execute(f"PRAGMA page_size = {PAGE_SIZE}")
            connection.execute("PRAGMA auto_vacuum = INCREMENTAL")
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute(f"PRAGMA synchronous = {'FULL' if sync else 'NORMAL'}")
        connection.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT_BYTES}")  # after a big compaction
    return connection


def lock_folder(path: Path) -> BinaryIO:
    """Hold ``path`` (the folder's ``LOCK``) until the file returned is closed: one service
    at a time uses a data folder."""
    file = path.open("ab")
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise RuntimeError(f"{path.parent} is in use by another rollout buffer (it holds {path})") from None
    return file


def last_event(db: sqlite3.Connection) -> int:
    """The id of the last event committed: the events' ids are dense, and a compaction leaves
    the event of its own installation."""
    row = db.execute("SELECT max(id) FROM events").fetchone()
    return int(row[0] or 0)


#: The prefix of the tables a compaction left behind (replaced snapshots, void stagings).
GARBAGE = "snapshot_old_"


def garbage_tables(db: sqlite3.Connection) -> list[str]:
    """The replaced snapshots (and void stagings) not yet deleted, oldest first."""
    rows = db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE ? ESCAPE '\\'",
        (GARBAGE.replace("_", "\\_") + "%",),
    ).fetchall()
    return sorted((row[0] for row in rows), key=lambda name: int(name.removeprefix(GARBAGE)))


def discard(db: sqlite3.Connection, table: str) -> None:
    """Make ``table`` garbage (a rename: O(1) whatever its size), if it exists."""
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone():
        tables = garbage_tables(db)
        number = int(tables[-1].removeprefix(GARBAGE)) + 1 if tables else 1
        db.execute(f"ALTER TABLE {table} RENAME TO {GARBAGE}{number}")


#: Rows per INSERT at most (SQLite allows 32766 values in a statement).
_ROWS_PER_INSERT = 512


def insert(db: sqlite3.Connection, into: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert ``rows`` in a few multi-row statements, not one step per row (``executemany``):
    each step lets go of the GIL and takes it back, a handover with the event loop per row.
    The statements hold a power of two of rows each, so only a few texts are ever prepared
    (and cached)."""
    start = 0
    while start < len(rows):
        count = min(_ROWS_PER_INSERT, 1 << (len(rows) - start).bit_length() - 1)
        chunk = rows[start : start + count]
        db.execute(_insert_sql(into, len(chunk[0]), count), [value for row in chunk for value in row])
        start += count


@functools.cache
def _insert_sql(into: str, width: int, rows: int) -> str:
    one = "(" + ", ".join("?" * width) + ")"
    return f"INSERT INTO {into} VALUES " + ", ".join([one] * rows)
