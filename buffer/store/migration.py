"""A one-time migration of a data folder written by the former journal files.

    journal/00000007.snapshot     the state as of the start of segment 7
    journal/00000007.log          the changes since (segments 7, 8, ...)
    delivered/2026-11-21T14.jsonl the export, one file an hour

A record there was ``<u32 length><u32 CRC-32>`` and the same body ``buffer.core.records.encode``
makes today, so its events go into the database as they are, in order: the newest snapshot,
then every segment after it; the export lines become rows of ``delivered``. One transaction writes them
all with a ``meta`` row naming the origin; only then are the old folders renamed aside
(``journal.migrated``, ``delivered.migrated``), so a crash at any point either migrates again
from scratch or finds the migration done and finishes the renaming.

A torn record at the end of the last segment (a write a crash cut short, never acknowledged)
is left out, as the old journal did; a bad record anywhere else stops the start-up, naming the
file and offset, rather than silently lose what follows it.

And once, a database made before the journal gave free space back (``auto_vacuum`` off) is
rewritten with ``auto_vacuum=INCREMENTAL`` by a VACUUM (``reclaim_space``).
"""

from __future__ import annotations

import logging
import sqlite3
import struct
import time
import zlib
from pathlib import Path

import orjson

from buffer.core.records import split
from buffer.store.schema import DELIVERED, SCHEMA, JournalCorrupt, connect

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<II")
_INCREMENTAL = 2  # PRAGMA auto_vacuum
_PREFIX = b'{"delivered_at":'
_TRAJECTORY = b',"trajectory":'


def read_records(path: Path) -> tuple[list[bytes], int, int]:
    """The record bodies of one old journal file, the offset where its valid records end,
    and its size."""
    data = path.read_bytes()
    bodies: list[bytes] = []
    offset = 0
    while offset + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, offset)
        body = data[offset + _FRAME.size : offset + _FRAME.size + length]
        if len(body) < length or zlib.crc32(body) != crc or b"\n" not in body:
            break
        bodies.append(body)
        offset += _FRAME.size + length
    return bodies, offset, len(data)


def old_events(folder: Path) -> list[bytes]:
    """Every record the old journal would have restored, in order."""
    snapshots = sorted(folder.glob("*.snapshot"))
    base = int(snapshots[-1].stem) if snapshots else 0
    segments = sorted(p for p in folder.glob("*.log") if int(p.stem) >= base)
    files = snapshots[-1:] + segments
    records: list[bytes] = []
    for index, path in enumerate(files):
        bodies, end, size = read_records(path)
        if end != size:
            if index != len(files) - 1 or path.suffix != ".log":
                raise JournalCorrupt(f"{path}: unreadable record at byte {end} of {size}")
            logger.warning("%s: leaving out %d bytes of a write that never completed", path, size - end)
        records.extend(bodies)
    return records


def old_exports(folder: Path) -> list[tuple[int, float, str, object, str]]:
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        with path.open("rb") as file:
            for line in file:
                if not line.endswith(b"}\n") or not line.startswith(_PREFIX):
                    continue  # the tail of a write a crash cut short
                cut = line.index(_TRAJECTORY)
                head = orjson.loads(line[:cut] + b"}")
                trajectory = line[cut + len(_TRAJECTORY) : -2].decode()
                rows.append(
                    (
                        head["read_id"],
                        head["delivered_at"],
                        head["task_type"],
                        head["instance_id"],
                        trajectory,
                    )
                )
    return rows


def migrate(directory: Path, database: Path) -> bool:
    """Move the old journal's events and export into ``database``; True if it did."""
    old_journal, old_delivered = directory / "journal", directory / "delivered"
    if not old_journal.is_dir() and not old_delivered.is_dir():
        return False
    db = connect(database)
    try:
        db.executescript(SCHEMA)
        done = db.execute("SELECT value FROM meta WHERE key = 'migrated_from'").fetchone()
        if done is None:
            records = old_events(old_journal) if old_journal.is_dir() else []
            exports = old_exports(old_delivered) if old_delivered.is_dir() else []
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO events VALUES (?, ?, ?)",
                ((index, *split(record)) for index, record in enumerate(records, 1)),
            )
            db.executemany(f"INSERT INTO {DELIVERED} VALUES (?, ?, ?, ?, ?)", exports)
            db.execute(
                "INSERT INTO meta VALUES ('migrated_from', 'journal/*.log, *.snapshot, delivered/*.jsonl')"
            )
            db.execute("COMMIT")
            logger.warning(
                "%s: migrated %d journal records and %d export lines into %s",
                directory,
                len(records),
                len(exports),
                database.name,
            )
    finally:
        db.close()
    for old in (old_journal, old_delivered):
        if old.is_dir():
            aside = old.with_name(old.name + ".migrated")
            while aside.exists():  # a folder migrated before, and then an old version ran again
                aside = aside.with_name(aside.name + "-again")
            old.rename(aside)
            logger.warning(
                "%s: kept the former files as %s; delete them when you no longer need them", directory, aside
            )
    return True


def reclaim_space(db: sqlite3.Connection, database: Path) -> bool:
    """Turn on ``auto_vacuum=INCREMENTAL`` in a database made before it was (the journal gives
    the pages a compaction frees back to the file system; without it the file stays at its
    largest). That takes one VACUUM, which rewrites the file (it needs as much free space
    again, and time: about a second per few hundred MB); True if it did. A VACUUM that fails
    (a full disk) leaves the database as it was, and the start-up goes on without it."""
    if db.execute("PRAGMA auto_vacuum").fetchone()[0] == _INCREMENTAL:
        return False
    started = time.monotonic()
    size = database.stat().st_size
    logger.warning("%s: rewriting the database once to give free space back (%.1f MB)", database, size / 1e6)
    try:
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        db.execute("VACUUM")
    except sqlite3.OperationalError as exc:
        logger.warning("%s: cannot rewrite the database (%s); free space is not given back", database, exc)
        return False
    logger.warning(
        "%s: rewritten in %.1f s: %.1f MB now",
        database,
        time.monotonic() - started,
        database.stat().st_size / 1e6,
    )
    return True
