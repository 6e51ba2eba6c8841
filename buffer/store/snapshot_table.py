"""The snapshot in the database, kept from one compaction to the next: a compaction writes what
changed since the last one (``buffer.core.snapshots``), not the whole state.

    snap(id INTEGER PRIMARY KEY, key TEXT, born INTEGER, died INTEGER, header TEXT, payload BLOB)

A row is one piece of the state (``records.Piece``). ``id`` orders the rows as a restore reads
them: the piece's part in its top bits (``part << 48``), then its place in the part: appended
(the next id of the part) or, for a piece with an ``order`` (a ready group's ``seq``), that
order. ``key`` names an open group's row. The snapshot installed is generation G
(``meta.snapshot_generation``): its rows are those born at or before G and not died at or before
it, read by id.

A compaction stages generation g = G + 1 beside it, in short transactions
(``Staging``): whole (``full``, the first one, or when the buffer cannot say what changed)
into a table of its own, ``snap_next``, renamed over ``snap`` at the install; or as a delta in
``snap`` itself: the rows it replaces or deletes get ``died = g``, every row that is rewritten
each time too (those with neither key nor order), and its new rows ``born = g``. Neither is
visible to a restore until the install, which is O(1) in the writer's transaction: the
generation and ``meta.snapshot_through`` move. The rows died at or before G are then garbage
for the cleaner (``cleanup.step``), deleted a slice at a time through the ``died`` index.

A staging that was never installed (a crash, a failed commit) leaves rows born after G and
marks died after G: ``meta.snapshot_staging`` says where its new rows start in each part, and
the next staging undoes it first (``undo_slice``); a restore never reads them meanwhile.

A folder of the former format keeps its whole snapshot in ``snapshot(id, header, payload)``,
without ``meta.snapshot_generation``: a restore reads it, the first compaction is then whole,
and its install makes the former table garbage.
"""

from __future__ import annotations

import functools
import sqlite3
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from buffer.core.records import PARTS, VOLATILE_PARTS, Piece, split
from buffer.store.schema import discard, insert

if TYPE_CHECKING:
    from buffer.store.cleanup import SideWriter

TABLE = "snap"
STAGING = "snap_next"
#: The whole snapshot of the former format (``FORMAT_VERSION`` 1).
LEGACY = "snapshot"
_SHIFT = 48
_COLUMNS = (
    "(id INTEGER PRIMARY KEY, key TEXT, born INTEGER NOT NULL, died INTEGER, "
    "header TEXT NOT NULL, payload BLOB NOT NULL)"
)
_INSERT = "{table} (id, key, born, header, payload)"
#: Pieces staged by the first transaction, and bytes per transaction at most; the next ones
#: are sized to take about ``STAGING_S`` each under the write lock: the writer waits for one at most.
STAGING_ROWS = 1000
STAGING_BYTES = 2 * 2**20
STAGING_S = 0.010
#: Keys or ids per statement that marks rows died.
_KEYS_PER_STATEMENT = 500


def base(part: int) -> int:
    return part << _SHIFT


def exists(db: sqlite3.Connection, table: str) -> bool:
    query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    return db.execute(query, (table,)).fetchone() is not None


def _meta(db: sqlite3.Connection, key: str) -> str | None:
    row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def generation(db: sqlite3.Connection) -> int | None:
    """The generation installed; None: none yet (a new folder, or the former format's)."""
    value = _meta(db, "snapshot_generation")
    return None if value is None else int(value)


def create(db: sqlite3.Connection, table: str) -> None:
    """An empty snapshot table with its indexes (named afresh: a renamed table keeps its own)."""
    token = uuid.uuid4().hex[:12]
    db.execute(f"CREATE TABLE {table} {_COLUMNS}")
    db.execute(f"CREATE INDEX {TABLE}_key_{token} ON {table} (key) WHERE key IS NOT NULL")
    db.execute(f"CREATE INDEX {TABLE}_died_{token} ON {table} (died) WHERE died IS NOT NULL")


# -- reading -----------------------------------------------------------------------------


def rows(db: sqlite3.Connection, after: int, limit: int) -> list[tuple[int, str, bytes]]:
    """Up to ``limit`` rows of the snapshot installed after id ``after``, in order: (id, header,
    payload). Of the former table where no generation is installed."""
    installed = generation(db)
    if installed is None:
        if not exists(db, LEGACY):
            return []
        query = f"SELECT id, header, payload FROM {LEGACY} WHERE id > ? ORDER BY id LIMIT ?"
        return db.execute(query, (after, limit)).fetchall()
    query = (
        f"SELECT id, header, payload FROM {TABLE} WHERE id > ? AND born <= ? "
        "AND (died IS NULL OR died > ?) ORDER BY id LIMIT ?"
    )
    return db.execute(query, (after, installed, installed, limit)).fetchall()


def live_bytes(db: sqlite3.Connection) -> int:
    """The bytes of the snapshot installed (a full scan: for tests and benchmarks)."""
    total = 0
    last = -1
    while page := rows(db, last, 10_000):
        total += sum(len(header) + len(payload) for _, header, payload in page)
        last = page[-1][0]
    return total


def dead_rows(db: sqlite3.Connection) -> bool:
    """Whether rows that died at or before the installed generation are left to delete."""
    installed = generation(db)
    if installed is None or not exists(db, TABLE):
        return False
    return db.execute(f"SELECT 1 FROM {TABLE} WHERE died <= ? LIMIT 1", (installed,)).fetchone() is not None


def delete_dead(db: sqlite3.Connection, limit: int) -> bool:
    """Delete up to ``limit`` rows died at or before the installed generation, in the caller's
    transaction; False if there were none."""
    installed = generation(db)
    if installed is None or not exists(db, TABLE):
        return False
    query = f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE} WHERE died <= ? LIMIT ?)"
    return db.execute(query, (installed, limit)).rowcount > 0


# -- a staging never installed -----------------------------------------------------------


def undo_slice(db: sqlite3.Connection, limit: int) -> bool:
    """Undo up to ``limit`` rows of a staging that was never installed (in the caller's
    transaction); False once there is none left (``meta.snapshot_staging`` is then gone)."""
    staging = _meta(db, "snapshot_staging")
    if staging is None:
        return False
    left = orjson.loads(staging)
    if left.get("full"):
        discard(db, STAGING)
    else:
        installed = generation(db) or 0
        among = f"id IN (SELECT id FROM {TABLE} WHERE"
        for part, top in enumerate(left["tops"]):  # its new rows
            query = f"DELETE FROM {TABLE} WHERE {among} id > ? AND id < ? LIMIT ?)"
            if db.execute(query, (top, base(part + 1), limit)).rowcount:
                return True
        query = f"UPDATE {TABLE} SET died = NULL WHERE {among} died > ? LIMIT ?)"  # the rows it replaced
        if db.execute(query, (installed, limit)).rowcount:
            return True
    db.execute("DELETE FROM meta WHERE key = 'snapshot_staging'")
    return False


# -- staging -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Staged:
    """A staged snapshot, for the writer to install: its generation, whole or a delta, and the
    pieces and bytes it wrote."""

    generation: int
    full: bool
    pieces: int
    written: int


class Staging:
    """Writes a capture's pieces through ``side`` (``cleanup.SideWriter``), a few MB per
    transaction: whole into ``snap_next``, or as a delta of the generation installed."""

    def __init__(self, side: SideWriter, *, full: bool) -> None:
        self.side = side
        self.full = full
        self.installed = 0
        self.generation = 0
        self.next_ids: list[int] = []
        self.tops: list[int] = []

    def stage(self, pieces: Iterable[Piece]) -> Staged:
        side = self.side
        while side.transaction(functools.partial(undo_slice, limit=STAGING_ROWS)):
            pass  # what a staging never installed left
        side.transaction(self._begin)
        count = size = 0
        rows = STAGING_ROWS  # per transaction: sized to take about STAGING_S
        chunk: list[Piece] = []
        chunk_bytes = 0
        for piece in pieces:
            count += 1
            chunk.append(piece)
            if piece.record is not None:
                size += len(piece.record)
                chunk_bytes += len(piece.record)
            if len(chunk) >= rows or chunk_bytes >= STAGING_BYTES:
                side.transaction(functools.partial(self._apply, rows=self._prepare(chunk)))
                rows = max(16, min(4 * rows, int(rows * STAGING_S / max(side.work_s, 1e-4))))
                chunk, chunk_bytes = [], 0
        side.transaction(functools.partial(self._apply, rows=self._prepare(chunk)))
        return Staged(self.generation, self.full, count, size)

    def _begin(self, db: sqlite3.Connection) -> None:
        """Where the new rows go, noted in ``meta.snapshot_staging`` (what undoes them), and
        (delta) every row rewritten each time marked died."""
        installed = generation(db)
        if not self.full and (installed is None or not exists(db, TABLE)):
            raise RuntimeError("a delta of a snapshot the database does not hold")
        self.installed = installed or 0
        self.generation = self.installed + 1
        table = STAGING if self.full else TABLE
        if self.full:
            discard(db, STAGING)
            create(db, STAGING)
        self.tops = []
        for part in range(PARTS):
            query = f"SELECT max(id) FROM {table} WHERE id >= ? AND id < ?"
            top = db.execute(query, (base(part), base(part + 1))).fetchone()[0]
            self.tops.append(base(part) - 1 if top is None else int(top))
        self.next_ids = [top + 1 for top in self.tops]
        staging = {"generation": self.generation, "full": self.full, "tops": self.tops}
        note = orjson.dumps(staging).decode()
        db.execute("INSERT OR REPLACE INTO meta VALUES ('snapshot_staging', ?)", (note,))
        if not self.full:  # the rows every snapshot rewrites: a few, in their own parts
            for part in VOLATILE_PARTS:
                db.execute(
                    f"UPDATE {TABLE} SET died = ? WHERE id >= ? AND id <= ? AND key IS NULL "
                    "AND died IS NULL AND born <= ?",
                    (self.generation, base(part), self.tops[part], self.installed),
                )

    def _prepare(self, pieces: list[Piece]) -> _Rows:
        """The rows of ``pieces`` and those they replace or delete: outside the write lock."""
        keys: list[str] = []
        ids: list[int] = []
        new: list[tuple[int, str | None, int, str, memoryview]] = []
        for piece in pieces:
            if piece.order is not None:
                row_id = base(piece.part) + piece.order
                if piece.record is not None and row_id <= self.tops[piece.part]:
                    raise ValueError(f"snapshot row {row_id} ordered at or before the rows kept")
                ids.append(row_id)
            else:
                if piece.key is not None:
                    keys.append(piece.key)
                elif piece.record is None or piece.part not in VOLATILE_PARTS:
                    raise ValueError(f"a piece of part {piece.part} with neither key nor order")
                row_id = self.next_ids[piece.part]
                self.next_ids[piece.part] += 1
            if piece.record is not None:
                new.append((row_id, piece.key, self.generation, *split(piece.record)))
        return _Rows(keys, ids, new)

    def _apply(self, db: sqlite3.Connection, rows: _Rows) -> None:
        """One transaction of the staging: the rows replaced or deleted marked died (a delta),
        the new ones inserted."""
        if not self.full:
            for column, values in (("key", rows.keys), ("id", rows.ids)):
                for start in range(0, len(values), _KEYS_PER_STATEMENT):
                    batch = values[start : start + _KEYS_PER_STATEMENT]
                    db.execute(
                        f"UPDATE {TABLE} SET died = ? WHERE {column} IN ({', '.join('?' * len(batch))}) "
                        "AND died IS NULL AND born <= ?",
                        (self.generation, *batch, self.installed),
                    )
        if rows.new:
            insert(db, _INSERT.format(table=STAGING if self.full else TABLE), rows.new)


@dataclass(frozen=True, slots=True)
class _Rows:
    keys: list[str]  # the keys and ids of the rows replaced or deleted
    ids: list[int]
    new: list[tuple[int, str | None, int, str, memoryview]]


def killed_bytes(db: sqlite3.Connection, generation_: int) -> int:
    """The bytes of the rows a delta of ``generation_`` replaced or deleted."""
    query = f"SELECT coalesce(sum(length(header) + length(payload)), 0) FROM {TABLE} WHERE died = ?"
    return int(db.execute(query, (generation_,)).fetchone()[0])


def install(db: sqlite3.Connection, staged: Staged, position: int) -> bool:
    """Make ``staged`` the snapshot a restore reads, covering the events up to ``position``:
    O(1), in the writer's transaction. False if it is not the staging the database holds."""
    staging = _meta(db, "snapshot_staging")
    if staging is None or orjson.loads(staging)["generation"] != staged.generation:
        return False
    if staged.full:
        if not exists(db, STAGING):
            return False
        discard(db, TABLE)
        discard(db, LEGACY)
        db.execute(f"ALTER TABLE {STAGING} RENAME TO {TABLE}")
    db.execute("DELETE FROM meta WHERE key = 'snapshot_staging'")
    db.execute("INSERT OR REPLACE INTO meta VALUES ('snapshot_generation', ?)", (str(staged.generation),))
    db.execute("INSERT OR REPLACE INTO meta VALUES ('snapshot_through', ?)", (str(position),))
    db.execute("INSERT OR REPLACE INTO meta VALUES ('format', '2')")
    return True


def iter_rows(db: sqlite3.Connection, page: int = 1000) -> Iterator[tuple[int, str, bytes]]:
    """Every row of the snapshot installed, in order, a page per query."""
    last = -1
    while batch := rows(db, last, page):
        yield from batch
        last = batch[-1][0]
