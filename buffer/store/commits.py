"""The commit count beside the database (``buffer.sqlite3-commits``): the last event id the
journal committed, where SQLite's recovery cannot drop it unnoticed.

SQLite ends its recovery at the first WAL frame that fails its checksum, and a WAL cut short
loses its last commits, both silently. The journal writes the id of its last event here after
each commit, before anyone is told the commit is kept; at start-up a database that ends before
it lost acknowledged commits, and the start-up stops, naming both files and the numbers
(``rollout-buffer check --repair`` salvages what is left and resets the count).

16 bytes at offset 0 (a magic, a CRC-32, the id), rewritten in place by one ``pwrite`` to a
file kept open: a single sector, so never torn, and no fsync. The write comes after the
commit has returned (after its fsync, with ``--durability sync``), so on any crash the count on
disk is at most what the database holds: a power loss can leave it behind (less is checked),
never ahead (a false alarm). With ``--durability flush`` neither is synced at a commit, so
after a power loss the count can be ahead: those commits were acknowledged and are lost, as
``flush`` allows, and the start-up says so rather than deliver again what was delivered. A
count that cannot be read (a file created just before a power loss) is noted and checks
nothing.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
import zlib
from pathlib import Path

from buffer.store import wal
from buffer.store.schema import connect, last_event

logger = logging.getLogger(__name__)

_RECORD = struct.Struct("<4sIQ")
_MAGIC = b"RBc1"


def path_for(database: Path) -> Path:
    return database.with_name(database.name + "-commits")


def read(path: Path) -> int | None:
    """The last event id recorded at ``path``, or None (no file, or one that cannot be read)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _RECORD.size:
        logger.warning("%s: %d bytes, not a commit count; not checked", path, len(data))
        return None
    magic, crc, last = _RECORD.unpack_from(data)
    if magic != _MAGIC or zlib.crc32(data[8:16]) != crc:
        logger.warning("%s: not a commit count this version wrote; not checked", path)
        return None
    return int(last)


def _encode(last: int) -> bytes:
    value = struct.pack("<Q", last)
    return _MAGIC + struct.pack("<I", zlib.crc32(value)) + value


class CommitCount:
    """The file, open for the journal's writer: ``record`` after each commit."""

    def __init__(self, path: Path, last: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.pwrite(self._fd, _encode(last), 0)
        os.fsync(self._fd)  # once, at start-up: the file itself survives a power loss

    def record(self, last: int) -> None:
        os.pwrite(self._fd, _encode(last), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)  # a clean stop: the count on disk is exact
            os.close(self._fd)
            self._fd = -1


def lost_commits(database: Path, recorded: int | None, last: int) -> str | None:
    """Why the start-up stops, if the database ends (``last``) before the count ``recorded``."""
    if recorded is None or last >= recorded:
        return None
    return (
        f"{database} ends at event {last}, but {path_for(database).name} records that event "
        f"{recorded} was committed and acknowledged: {recorded - last} events (whole commits) "
        "were lost, most likely to a damaged or truncated write-ahead log "
        f"({database.name}-wal)"
    )


def check_log(database: Path) -> str | None:
    """Why the start-up must stop, if SQLite would silently drop acknowledged commits: the
    WAL's frames are checked before SQLite opens it (``wal``), then the database's last event
    against the count kept beside it, from a read-only connection, which leaves the WAL as it
    found it."""
    damage = wal.check(database.with_name(database.name + "-wal"))
    if damage is not None:
        return str(damage)
    recorded = read(path_for(database))
    if recorded is None or not database.exists():
        return None
    try:
        db = connect(database, readonly=True)
        try:
            last = last_event(db)
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return None  # a damaged database: quick_check says how
    return lost_commits(database, recorded, last)
