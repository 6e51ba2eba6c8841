"""``rollout-buffer check DIR [--repair]``: check a data folder, and salvage a damaged one.

The check runs SQLite's ``integrity_check`` on ``DIR/buffer.sqlite3``, then replays every
event through the buffer, as a start-up would. ``--repair`` (with the service stopped: it
takes the folder's lock) reads every row it can, one by one, replays them skipping the ones
that no longer apply, and writes a new database whose snapshot is the state replayed, with
every export row it could read. The damaged files are kept as ``buffer.sqlite3.damaged``.
It says exactly what was dropped: each unreadable row by table and id, and each event that
could not be replayed, with its kind, task and instance.

A write-ahead log that stops verifying before its end (``wal``) or a database that ends before
the commit count kept beside it (``commits``) lost acknowledged commits that SQLite dropped
silently; the check names them as problems, and ``--repair`` accepts the loss (logs it), keeps
the damaged files and starts the count afresh from the rebuilt database.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from buffer.core.records import PARTS, Event
from buffer.core.rollout_buffer import RolloutBuffer
from buffer.store import commits, snapshot_table, wal
from buffer.store.schema import DATABASE, DELIVERED, JournalCorrupt, connect, last_event, lock_folder
from buffer.store.sqlite import Journal

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Report:
    database: Path
    problems: list[str] = field(default_factory=list)  # integrity_check's findings
    unreadable: list[str] = field(default_factory=list)  # "events 812: database disk image is malformed"
    not_replayed: list[str] = field(default_factory=list)  # "events 813 (fin math q-7): KeyError 'q-7'"
    events: int = 0
    exports: int = 0
    repaired: bool = False

    @property
    def ok(self) -> bool:
        return not (self.problems or self.unreadable or self.not_replayed)

    def lines(self) -> list[str]:
        out = [f"{self.database}: {'ok' if self.ok else 'DAMAGED'}"]
        out += [f"  integrity: {problem}" for problem in self.problems]
        out += [f"  unreadable: {row}" for row in self.unreadable]
        out += [f"  not replayed: {row}" for row in self.not_replayed]
        verb = "kept" if self.repaired else "readable"
        out.append(f"  {self.events} events and {self.exports} export rows {verb}")
        if self.repaired:
            out.append(f"  repaired; the damaged files are kept as {self.database.name}.damaged")
        return out


def _salvage(
    db: sqlite3.Connection, table: str, columns: str, report: Report, *, part: int | None = None
) -> Iterator[tuple[Any, ...]]:
    """Every row of ``table`` that can be read, by id, noting those that cannot; of the
    snapshot (``snap``), the rows of the generation installed in ``part``."""
    span, where, bounds = "", "", ()  # type: tuple[str, str, tuple[int, ...]]
    if part is not None:
        installed = _meta(db, "snapshot_generation", 0)
        span = f" WHERE id >= {snapshot_table.base(part)} AND id < {snapshot_table.base(part + 1)}"
        where, bounds = " AND born <= ? AND (died IS NULL OR died > ?)", (installed, installed)
    try:
        low, high = db.execute(f"SELECT min(id), max(id) FROM {table}{span}").fetchone()
    except sqlite3.DatabaseError as exc:
        report.unreadable.append(f"{table}: the whole {'table' if part is None else f'part {part}'}: {exc}")
        return
    if table == "events":  # ids are dense from the snapshot's end to the last commit's
        low, high = _meta(db, "snapshot_through", 0) + 1, _meta(db, "last_event", high or 0)
    if low is None or high is None:
        return
    problems: dict[int, str] = {}
    for row_id in range(low, high + 1):
        try:
            query = f"SELECT id, {columns} FROM {table} WHERE id = ?{where}"
            row = db.execute(query, (row_id, *bounds)).fetchone()
        except sqlite3.DatabaseError as exc:
            problems[row_id] = str(exc)
            continue
        if row is not None:
            yield row
        elif table == "events":
            problems[row_id] = "missing"
    report.unreadable.extend(_ranges(table, problems))


def _snapshot(db: sqlite3.Connection, report: Report) -> Iterator[tuple[Any, ...]]:
    """The rows of the snapshot installed (``snapshot_table``), or of the former format's."""
    if _meta(db, "snapshot_generation", -1) >= 0:
        for part in range(PARTS):
            yield from _salvage(db, snapshot_table.TABLE, "header, payload", report, part=part)
    elif db.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (snapshot_table.LEGACY,)).fetchone():
        yield from _salvage(db, snapshot_table.LEGACY, "header, payload", report)


def _ranges(table: str, problems: dict[int, str]) -> list[str]:
    """``events 200-208: missing``: consecutive ids with the same problem on one line."""
    lines: list[str] = []
    ids = sorted(problems)
    start = 0
    for end in range(len(ids)):
        last = end + 1 == len(ids)
        if last or ids[end + 1] != ids[end] + 1 or problems[ids[end + 1]] != problems[ids[start]]:
            first_id, last_id = ids[start], ids[end]
            span = f"{first_id}" if first_id == last_id else f"{first_id}-{last_id}"
            lines.append(f"{table} {span}: {problems[first_id]}")
            start = end + 1
    return lines


def _meta(db: sqlite3.Connection, key: str, default: int) -> int:
    try:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    except sqlite3.DatabaseError:
        return default
    return default if row is None else int(row[0])


def _describe(header: dict[str, Any]) -> str:
    return " ".join(str(header[key]) for key in ("e", "t", "i") if header.get(key) is not None)


def check(directory: Path, *, repair: bool = False) -> Report:
    """Check (and with ``repair``, salvage) the data folder ``directory``."""
    database = directory / DATABASE
    report = Report(database)
    if not database.exists():
        report.problems.append("no database (nothing to check)")
        return report
    lock = lock_folder(directory / "LOCK")
    try:
        damage = wal.check(database.with_name(database.name + "-wal"))  # before SQLite reads it
        recorded = commits.read(commits.path_for(database))
        db = connect(database, readonly=True)
        try:
            try:
                report.problems = [row[0] for row in db.execute("PRAGMA integrity_check")]
            except sqlite3.DatabaseError as exc:
                report.problems = [str(exc)]
            if report.problems == ["ok"]:
                report.problems = []
            if damage is not None:
                report.problems.append(str(damage))
            with contextlib.suppress(sqlite3.DatabaseError):
                lost = commits.lost_commits(database, recorded, last_event(db))
                if lost is not None:
                    report.problems.append(lost)
            buffer = RolloutBuffer()
            events: list[Event] = []
            for table, rows in (("snapshot", _snapshot(db, report)), ("events", None)):
                rows = rows if rows is not None else _salvage(db, table, "header, payload", report)
                for row_id, header, payload in rows:
                    try:
                        event = Event(orjson.loads(header), bytes(payload))
                    except orjson.JSONDecodeError as exc:
                        report.unreadable.append(f"{table} {row_id}: {exc}")
                        continue
                    try:
                        buffer.restore([event])
                    except Exception as exc:  # an event whose predecessors were lost
                        report.not_replayed.append(f"{table} {row_id} ({_describe(event.header)}): {exc!r}")
                        continue
                    events.append(event)
            exports = list(
                _salvage(db, "delivered", "read_id, delivered_at, task_type, instance_id, trajectory", report)
            )
        finally:
            db.close()
        report.events, report.exports = len(events), len(exports)
        if repair and not report.ok:
            _rebuild(directory, events, [row[1:] for row in exports])
            for problem in report.problems:
                logger.warning("%s: repaired, accepting the loss: %s", database, problem)
            report.repaired = True
    finally:
        lock.close()
    return report


def _rebuild(directory: Path, events: list[Event], exports: list[tuple[Any, ...]]) -> None:
    """A new database holding the state ``events`` replay to, as its snapshot."""
    staging = directory / ".repair"
    shutil.rmtree(staging, ignore_errors=True)
    journal = Journal(staging)
    try:
        for _ in journal.recover():
            pass
        buffer = RolloutBuffer()
        buffer.restore(events)
        buffer.attach(journal)
        journal.compact()
        journal.wait_durable_blocking(600)
        db = connect(journal.database)
        try:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(f"INSERT INTO {DELIVERED} VALUES (?, ?, ?, ?, ?)", exports)
            db.execute("COMMIT")
        finally:
            db.close()
    finally:
        journal.close()
    database = directory / DATABASE
    count = commits.path_for(database)
    for suffix in ("", "-wal", "-shm", count.name.removeprefix(database.name)):
        damaged = database.with_name(database.name + suffix)
        if damaged.exists():
            damaged.rename(database.with_name(f"{database.name}.damaged{suffix}"))
    (staging / DATABASE).rename(database)
    (staging / count.name).rename(count)  # the rebuilt database's own count
    with contextlib.suppress(OSError):
        shutil.rmtree(staging)
    logger.info("%s: rebuilt from what could be read", database)


def run(folder: Path, *, repair: bool = False) -> int:
    """``rollout-buffer check DIR [--repair]``: exit status 0 when the folder is sound (or was
    repaired), 1 when it is damaged or cannot be read, 2 when there is no such folder or it
    holds no buffer (empty, or another folder: nothing to check, nothing damaged)."""
    if not folder.is_dir():
        sys.stderr.write(f"rollout-buffer check: {folder}: no such folder\n")
        return 2
    if not (folder / DATABASE).exists():
        sys.stderr.write(
            f"rollout-buffer check: {folder}: no buffer here ({DATABASE} is absent): nothing to check; "
            f"a service started with --data-dir {folder} makes one\n"
        )
        return 2
    try:
        report = check(folder, repair=repair)
    except (RuntimeError, JournalCorrupt, sqlite3.Error) as exc:
        sys.stdout.write(f"{folder}: {exc}\n")
        return 1
    sys.stdout.write("\n".join(report.lines()) + "\n")
    if not report.ok and not repair:
        sys.stdout.write("run again with --repair to salvage what can be read\n")
    return 0 if report.ok or report.repaired else 1
