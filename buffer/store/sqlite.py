"""The SQLite store (``Journal``): every change in one database in the data folder.

The database's tables are drawn in ``schema``; the records are the core's
(``buffer.core.records``); what a store promises is ``base.Store``.

The buffer replays the events through the same code that made the change
(``RolloutBuffer.restore``): the tables hold a log, never a second copy of the rules.

Appends come from the buffer under its lock, so the log's order is the buffer's order, and
cost a list append. One writer thread commits what has gathered in one transaction (group
commit) and then releases everyone waiting on it: ``wait_durable`` for the event loop,
``wait_durable_blocking`` for threads. A write is acknowledged only after that wait.

``synchronous`` follows the promise made on acknowledgement. ``--durability sync`` (FULL): the
WAL is fsync-ed at each commit, so an acknowledged change survives power loss. ``flush``
(NORMAL): a commit reaches the OS without an fsync (the WAL is synced at checkpoints), which
survives a crash of the service, not of the machine; that is what ``flush`` promises.

A read (``read``) is one entry: its event and its export rows go into the same transaction,
so a read is delivered and exported together or not at all. A commit that fails (a full disk,
an I/O error, any exception) fails every waiter with ``StorageFailed``, takes back every read
not yet committed (``undo``: their groups return to the buffer, never marked delivered), and
is retried until it succeeds; then the journal takes writes again, without a restart.

Compaction writes what changed in the state since the last one (a delta; the whole state the
first time, and after a compaction that was not installed) beside the snapshot, from its own
connection, in short transactions (``snapshot_table``), then hands the writer an ``_Install``
entry. The state is captured at a position of the log (under the buffer's lock) and the writer
installs it in order, so in the same transaction as or a later one than every change before
it: a compaction never makes durable a state whose changes are not. A failure in between voids
the compaction, since the reads it took back are in that state. The install is O(1) (the
snapshot's generation and ``meta.snapshot_through``; a rename for a whole one): the rows it
replaced and the events it covers are deleted afterwards by the cleaner thread, a slice per
short transaction, as the staging is written (``cleanup.SideWriter``): the writer waits for
one slice at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from buffer.core.records import NOTHING, Event, ExportRow, Snapshotter, split
from buffer.errors import StorageFailed
from buffer.store import cleanup, commits, export, migration, snapshot_table
from buffer.store.base import Counters, Store
from buffer.store.schema import (
    DATABASE,
    DELIVERED,
    FORMAT_VERSION,
    SCHEMA,
    JournalCorrupt,
    connect,
    discard,
    insert,
    last_event,
    lock_folder,
)

logger = logging.getLogger(__name__)

#: How long the writer waits before it tries a failed commit again.
RETRY_INTERVAL_S = 1.0
#: Free pages a database keeps between compactions (the export's retention frees some each
#: minute; they are reused by the next writes).
_FREE_BYTES_KEPT = 64 * 2**20
#: The log a delta compaction waits for at least (unless ``compact_bytes`` is smaller).
_DELTA_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class _Read:
    """A read: its event and its export rows (made in the writer thread) in one transaction;
    ``undo`` gives its groups back to the buffer if the commit fails."""

    record: bytes
    rows: Callable[[], Iterable[ExportRow]]
    undo: Callable[[], None]


@dataclass(frozen=True, slots=True)
class _Install:
    position: int
    generation: int  # the failures' (``Journal._generation``) when it was captured
    staged: snapshot_table.Staged
    size: int  # the bytes of the snapshot once installed
    logged: int  # bytes appended up to ``position``: what the snapshot replaces


_Entry = bytes | _Read | _Install | None  # None: a read taken back


class Journal(Store):
    """The store in a data folder (``--data-dir``): ``base.Store`` over one SQLite database,
    with a writer thread that commits what has gathered (group commit)."""

    #: Compactions write what changed (``Snapshotter(delta=True)``): the buffer tracks it.
    incremental = True

    def __init__(
        self,
        directory: Path,
        *,
        sync: bool = True,
        compact_bytes: int = 256 * 2**20,
        retention_s: float = 7 * 24 * 3600.0,
    ) -> None:
        if not math.isfinite(retention_s) or retention_s < 0:
            raise ValueError(
                f"the export retention must be a finite number of seconds >= 0, not {retention_s}"
            )
        self.directory = directory
        self.database = directory / DATABASE
        self.sync = sync
        self.compact_bytes = compact_bytes
        self.retention_s = retention_s
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = lock_folder(directory / "LOCK")
        self._db: sqlite3.Connection | None = None
        self._count: commits.CommitCount | None = None
        state_lock = threading.Lock()
        self._cv = threading.Condition(state_lock)
        self._work = threading.Condition(state_lock)  # the writer's alone: no waiter takes its notify
        self._buffer_lock: AbstractContextManager[Any] = threading.RLock()
        self._pending: list[_Entry] = []
        self._appended = 0  # the position of the last entry appended, ever
        self._durable = 0
        self._waiters: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()
        self._failure: OSError | None = None
        self._last_error = OSError(errno.EIO, "no failure")
        self._generation = 0  # bumped by each failure: a compaction from before it is void
        self._closing = False
        self._writer: threading.Thread | None = None
        self._since_snapshot = 0  # bytes of events since the snapshot
        self._snapshot_bytes = 0
        self._snapshotter: Snapshotter | None = None
        self._compacting: threading.Thread | None = None
        self._install_pending = False  # a compaction staged or queued, not yet installed
        self._snap_generation: int | None = None  # the snapshot installed (None: none, or former)
        self._delta_ok = False  # the last capture is the snapshot installed: the next may be a delta
        self._last_staged = 0  # bytes the last compaction wrote
        self._no_compaction = False
        self._write_lock = threading.Lock()  # one writing transaction of this process at a time
        self._staging = threading.Lock()  # one compaction staged at a time
        self._cleanup: int | None = None  # garbage to delete, then free bytes to give back down to
        self._cleanup_asked = 0  # requests for a cleanup, ever: one made during a slice is not lost
        self._cleaner: threading.Thread | None = None
        self._appended_bytes = 0
        self._captured = (0, 0)  # (position, bytes appended up to it) when a snapshot was taken
        self._next_retention_check = 0.0
        self.bytes_written = 0
        self.commits = 0
        self.compactions = 0
        self.failures = 0

    # -- start-up ----------------------------------------------------------------------

    def recover(self) -> Iterator[Event]:
        """The events to restore the buffer from: the snapshot, then every event after it.
        Migrates a folder of the former journal files first. Call once, before ``start``."""
        self._check_log()
        migration.migrate(self.directory, self.database)
        try:
            self._db = connect(self.database, sync=self.sync)
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise JournalCorrupt(f"{self.database}: {'; '.join(problems[:5])}{self._repair_hint}")
            self._db.executescript(SCHEMA)
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (str(FORMAT_VERSION),))
            migration.reclaim_space(self._db, self.database)
            discard(self._db, "snapshot_next")  # staged by a former version a crash stopped
            if cleanup.has_garbage(self._db):
                self._cleanup = 0
            through = cleanup.snapshot_through(self._db)
            last = last_event(self._db)
            self._snap_generation = snapshot_table.generation(self._db)
        except sqlite3.DatabaseError as exc:
            raise JournalCorrupt(f"{self.database}: {exc}{self._repair_hint}") from exc
        self._delta_ok = self._snap_generation is not None  # the buffer restored from it tracks
        self._appended = self._durable = last
        self._count = commits.CommitCount(commits.path_for(self.database), last)
        for table in ("snapshot", "events"):
            for event_id, header, payload in self._rows(table, through if table == "events" else -1):
                size = len(header) + len(payload)
                if table == "snapshot":
                    self._snapshot_bytes += size
                else:
                    self._since_snapshot += size
                try:
                    yield Event(orjson.loads(header), bytes(payload))
                except orjson.JSONDecodeError as exc:
                    message = f"{self.database}: {table} row {event_id}: {exc}{self._repair_hint}"
                    raise JournalCorrupt(message) from exc

    def _check_log(self) -> None:
        """Stop the start-up if SQLite would silently drop acknowledged commits
        (``commits.check_log``)."""
        problem = commits.check_log(self.database)
        if problem is not None:
            raise JournalCorrupt(f"{problem}{self._repair_hint}")

    @property
    def _repair_hint(self) -> str:
        return f" (`rollout-buffer check {self.directory} --repair` salvages what can be read)"

    def _rows(self, table: str, last: int) -> Iterator[tuple[int, str, bytes]]:
        """The rows of ``table`` after id ``last`` (``snapshot``: of the one installed)."""
        assert self._db is not None
        while True:  # in pages: a cursor over the whole table would hold a read open
            try:
                if table == "snapshot":
                    rows = snapshot_table.rows(self._db, last, 1000)
                else:
                    rows = self._db.execute(
                        f"SELECT id, header, payload FROM {table} WHERE id > ? ORDER BY id LIMIT 1000",
                        (last,),
                    ).fetchall()
            except sqlite3.DatabaseError as exc:
                message = f"{self.database}: {table} after row {last}: {exc}{self._repair_hint}"
                raise JournalCorrupt(message) from exc
            if not rows:
                return
            yield from rows
            last = rows[-1][0]

    def start(
        self, snapshotter: Snapshotter | None = None, *, lock: AbstractContextManager[Any] | None = None
    ) -> None:
        """Start the writer thread. ``lock`` is the one every append is made under: a failed
        commit takes reads back under it."""
        if self._db is None:
            for _ in self.recover():
                pass
        self._snapshotter = snapshotter
        if lock is not None:
            self._buffer_lock = lock
        self._writer = threading.Thread(target=self._write_forever, name="journal-writer", daemon=True)
        self._writer.start()
        self._cleaner = threading.Thread(target=self._clean_forever, name="journal-cleanup", daemon=True)
        self._cleaner.start()

    # -- appends (under the buffer's lock) ---------------------------------------------

    def append(self, record: bytes) -> None:
        with self._cv:
            self._pending.append(record)
            self._appended += 1
            self._appended_bytes += len(record)
            self._work.notify()

    def read(self, record: bytes, rows: Callable[[], Iterable[ExportRow]], undo: Callable[[], None]) -> None:
        """Log a read with its export rows, committed together. ``rows`` makes the rows in the
        writer thread, off the reader's path; ``undo`` takes the read back if the commit fails."""
        with self._cv:
            self._pending.append(_Read(record, rows, undo))
            self._appended += 1
            self._appended_bytes += len(record)
            self._work.notify()

    def position(self) -> int:
        """The position of the last change appended: a snapshot taken now covers up to it."""
        with self._cv:
            self._captured = (self._appended, self._appended_bytes)
            return self._appended

    # -- waiting -----------------------------------------------------------------------

    async def wait_durable(self) -> None:
        """Return once everything appended so far is durable; raises ``StorageFailed``."""
        with self._cv:
            if self._durable >= self._appended:
                return
            if self._failure is not None:
                raise StorageFailed(self._failure)
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((self._appended, loop, future))
        await future

    def wait_durable_blocking(self, timeout_s: float | None = None) -> None:
        """``wait_durable`` for a thread."""
        with self._cv:
            target = self._appended
            failures = self.failures
            if not self._cv.wait_for(
                lambda: self._durable >= target or self.failures != failures or self._failure is not None,
                timeout_s,
            ):
                raise TimeoutError("the journal did not reach the disk in time")
            if self.failures != failures or (self._durable < target and self._failure is not None):
                raise StorageFailed(self._last_error)

    # -- the writer thread -------------------------------------------------------------

    def _write_forever(self) -> None:
        batch: list[_Entry] = []
        first = self._durable + 1  # the position of batch[0]
        while True:
            with self._cv:
                while not self._pending and not batch and not self._closing:
                    self._work.wait()
                first = self._durable + 1 if not batch else first
                batch.extend(self._pending)
                self._pending = []
                target, closing = self._appended, self._closing
            if not batch:
                return  # closing, and everything written
            try:
                self._commit(batch, first)
            except Exception as exc:  # whatever it is: fail the waiters, never die
                self._fail(exc, batch)
                if closing:
                    return
                with self._cv:
                    self._work.wait_for(lambda: self._closing, RETRY_INTERVAL_S)
                continue
            batch = []
            self._release(target)
            self._maybe_compact()

    def _commit(self, batch: list[_Entry], first: int) -> None:
        db = self._db
        assert db is not None
        events: list[tuple[int, str, memoryview]] = []
        exports: list[ExportRow] = []
        installs: list[_Install] = []
        size = 0
        for position, entry in enumerate(batch, first):
            if isinstance(entry, bytes):
                record = entry
            elif isinstance(entry, _Read):
                record = entry.record
                exports.extend(entry.rows())
            else:  # a read taken back, a compaction: a placeholder keeps the ids dense
                record = NOTHING
                if entry is not None:
                    installs.append(entry)
            size += len(record)
            events.append((position, *split(record)))
        retention = time.monotonic() >= self._next_retention_check
        with self._write_lock:
            if db.in_transaction:
                db.rollback()
            db.execute("BEGIN IMMEDIATE")
            try:
                insert(db, "events", events)
                if exports:
                    insert(db, DELIVERED, [(*row[:4], row[4].decode()) for row in exports])
                installed = [self._install(db, install) for install in installs]
                last = str(first + len(batch) - 1)
                db.execute("INSERT OR REPLACE INTO meta VALUES ('last_event', ?)", (last,))
                if retention:
                    cutoff = time.time() - self.retention_s
                    db.execute("DELETE FROM delivered WHERE delivered_at < ?", (cutoff,))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.rollback()
                raise
        self._record(first + len(batch) - 1)
        if retention:  # what the export's retention freed, beyond a margin, is given back
            self._next_retention_check = time.monotonic() + 60.0
            self._clean_up(_FREE_BYTES_KEPT)
        self.bytes_written += size
        for install, ok in zip(installs, installed, strict=True):
            with self._cv:  # resolved: the next compaction may capture (``_compact``)
                self._install_pending = False
                self._delta_ok = ok
                if ok:
                    self._snap_generation = install.staged.generation
        if any(installed):
            done = [install for install, ok in zip(installs, installed, strict=True) if ok][-1]
            self._since_snapshot = max(0, self.bytes_written - done.logged)
            self._snapshot_bytes = done.size
            self.compactions += 1
            self._clean_up(0)  # the rows replaced, the events covered, their pages
        else:
            self._since_snapshot += size
        self.commits += 1

    def _record(self, last: int) -> None:
        """Note the commit beside the database (``commits``), before it is acknowledged. The
        commit is kept whatever happens here: a failure leaves the count behind, which checks
        less, and is logged."""
        if self._count is None:
            return
        try:
            self._count.record(last)
        except OSError as exc:
            logger.warning("%s: cannot record the commit count (%s); not checked", self._count.path, exc)

    def _install(self, db: sqlite3.Connection, install: _Install) -> bool:
        """Make the staged snapshot the one a restore reads, with the events after its
        position: O(1), the rows replaced and the events covered are garbage for the cleaner.
        A staging dropped is undone by the next one (``snapshot_table.undo_slice``)."""
        if install.generation != self._generation:
            logger.warning("compaction dropped: a failed commit since took reads back from its state")
            return False
        return snapshot_table.install(db, install.staged, install.position)

    def _release(self, target: int) -> None:
        with self._cv:
            if self._failure is not None:
                logger.warning("the journal writes to %s again", self.directory)
                self._failure = None
            self._durable = target
            self._cv.notify_all()  # threads in wait_durable_blocking
            ready: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
            while self._waiters and self._waiters[0][0] <= target:
                _, loop, future = self._waiters.popleft()
                ready.setdefault(loop, []).append(future)
        for loop, futures in ready.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(_settle, futures, None)

    def _fail(self, exc: Exception, batch: list[_Entry]) -> None:
        """Every waiter fails; every read not committed is taken back; the batch is kept for
        the next try (the changes in it are in the buffer already)."""
        error = _as_os_error(exc)
        with self._buffer_lock:  # no append runs while reads are taken back
            with self._cv:
                if self._failure is None:
                    logger.critical(
                        "the journal cannot write to %s: %s; writes and reads fail until it can",
                        self.directory,
                        error.strerror,
                        exc_info=exc,
                    )
                self._failure = self._last_error = error
                self.failures += 1
                self._generation += 1
                reads: list[_Read] = []
                for entries in (batch, self._pending):
                    for index, entry in enumerate(entries):
                        if isinstance(entry, _Read):
                            reads.append(entry)
                            entries[index] = None
                self._cv.notify_all()
                waiters, self._waiters = list(self._waiters), deque()
            for read in reversed(reads):
                read.undo()
        for _, loop, future in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, [future], StorageFailed(error))

    @property
    def failure(self) -> OSError | None:
        """Why changes cannot be kept now (a failed commit, or the service stopping)."""
        return self._failure

    @property
    def failing(self) -> OSError | None:
        """The failure of a commit, while the writer tries again (None once it succeeds)."""
        return None if self._closing else self._failure

    def counters(self) -> Counters:
        return {
            "data_dir": str(self.directory),
            "durability": "sync" if self.sync else "flush",
            "bytes_written": self.bytes_written,
            "commits": self.commits,
            "compactions": self.compactions,
            "bytes_since_snapshot": self._since_snapshot,
            "failed": None if self._failure is None else str(self._failure.strerror),
        }

    # -- compaction --------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        if self._snapshotter is None:
            return
        with self._cv:  # against close(): a compaction is either never started or joined
            if self._no_compaction or self._since_snapshot < self._compaction_due():
                return
            if self._cleanup is not None:  # the last one's garbage first: the folder stays small
                return
            if self._install_pending or (self._compacting is not None and self._compacting.is_alive()):
                return
            self._compacting = threading.Thread(
                target=self._compact_safely, name="journal-compaction", daemon=True
            )
            self._compacting.start()

    def _compaction_due(self) -> int:
        """The bytes of log after which a compaction starts. A whole snapshot costs the state:
        the log grows as large first (the work is amortised, O(1) a byte kept). A delta costs
        what changed: the log grows to a sixteenth of the state (the events a compaction covers
        are garbage until the cleaner has deleted them, a few seconds: the folder holds about
        1.06 times the state at most for them), within ``compact_bytes`` and, unless that is
        smaller, at least ``_DELTA_BYTES`` and twice what the last delta wrote."""
        if not self._delta_ok:
            return max(self.compact_bytes, self._snapshot_bytes)
        due = max(_DELTA_BYTES, self._snapshot_bytes // 16, 2 * self._last_staged)
        return min(self.compact_bytes, due)

    def _compact_safely(self) -> None:
        try:
            self.compact()
        except Exception:
            logger.exception("journal compaction failed; the journal keeps growing until the next try")

    def compact(self) -> None:
        """Write the state into the staging table and queue its installation; returns once
        queued (``wait_durable_blocking`` then waits for it to be installed). One at a time."""
        with self._staging:
            self._compact()

    def _compact(self) -> None:
        assert self._snapshotter is not None
        with self._cv:  # the last one installed or dropped first: a delta is of the snapshot installed
            self._cv.wait_for(lambda: not self._install_pending or self._closing)
            if self._closing:
                return
            generation = self._generation
            delta = self._delta_ok and self._snap_generation is not None
            self._install_pending = True
            self._delta_ok = False  # until this one is installed
        started = time.monotonic()
        try:
            capture = self._snapshotter(delta=delta)
        except BaseException:
            with self._cv:
                self._install_pending = False
            raise
        with self._cv:
            captured, logged = self._captured
        side = cleanup.SideWriter(self.database, self._write_lock, self._let_writer_go)
        try:
            staged = snapshot_table.Staging(side, full=not capture.delta).stage(capture.pieces)
            size = staged.written
            if not staged.full:
                size += self._snapshot_bytes - snapshot_table.killed_bytes(side.db, staged.generation)
        except BaseException:
            with self._cv:
                self._install_pending = False
            raise
        finally:
            capture.pieces.close()  # the capture is released, read to its end or not
            side.close()
        self._last_staged = 0 if staged.full else staged.written  # what the next delta amortises
        with self._cv:
            logged = logged if captured == capture.position else 0
            install = _Install(capture.position, generation, staged, size, logged)
            self._pending.append(install)
            self._appended += 1
            self._work.notify()
        logger.info(
            "journal compaction: %s, %d pieces, %.1f MB staged in %.1f s",
            "whole" if staged.full else "delta",
            staged.pieces,
            staged.written / 1e6,
            time.monotonic() - started,
        )

    def _let_writer_go(self) -> None:
        with self._cv:  # a commit queued meanwhile goes first
            if self._pending:
                durable = self._durable
                self._cv.wait_for(lambda: self._durable != durable or self._closing, 0.1)

    # -- cleanup after a compaction ----------------------------------------------------

    def _clean_up(self, keep_bytes: int) -> None:
        """Ask the cleaner to delete what compactions left and give free pages back down to
        ``keep_bytes``."""
        with self._cv:
            self._cleanup = keep_bytes if self._cleanup is None else min(self._cleanup, keep_bytes)
            self._cleanup_asked += 1
            self._cv.notify_all()

    @property
    def cleanup_pending(self) -> bool:
        """Whether a compaction's garbage (or free space) is still being given back."""
        with self._cv:
            return self._cleanup is not None

    def _clean_forever(self) -> None:
        side: cleanup.SideWriter | None = None
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closing or self._cleanup is not None)
                    if self._closing or self._cleanup is None:
                        return
                    keep, asked = self._cleanup, self._cleanup_asked
                try:
                    side = side or cleanup.SideWriter(self.database, self._write_lock, self._let_writer_go)
                    more = side.clean_slice(keep)
                except Exception as exc:  # the garbage waits: a restore never reads it
                    logger.warning("%s: cleanup after a compaction failed: %s", self.database, exc)
                    with self._cv:
                        self._cv.wait_for(lambda: self._closing, RETRY_INTERVAL_S)
                    continue
                if not more:
                    with self._cv:
                        if self._cleanup_asked == asked:
                            self._cleanup = None
                        self._cv.notify_all()
                    self._maybe_compact()  # one the cleanup held back
        finally:
            if side is not None:
                side.close()

    # -- the export --------------------------------------------------------------------

    def exported(
        self, since: float | None = None, until: float | None = None, task_type: str | None = None
    ) -> Iterator[ExportRow]:
        """The rows of ``delivered`` in ``[since, until)``, oldest first, from a read-only
        connection of their own, a page of rows per query, so the writer is never held back by
        a slow client (``sqlite3 DATA_DIR/buffer.sqlite3`` reads them without the service)."""
        return export.from_database(self.database, since, until, task_type)

    # -- shutdown ----------------------------------------------------------------------

    def close(self) -> None:
        """Write everything appended, stop the threads, release the folder. Anything appended
        after (by a straggling generator thread) is refused with ``StorageFailed``."""
        with self._cv:
            self._no_compaction = True
            compaction = self._compacting
        if compaction is not None:
            compaction.join()  # its installation is then in the queue, which the writer drains
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            self._work.notify_all()
        if self._writer is not None:
            self._writer.join()
        if self._cleaner is not None:
            self._cleaner.join()  # between two slices: the rest waits for the next start
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                if self._db.in_transaction:
                    self._db.rollback()
                self._db.close()
            self._db = None
        if self._count is not None:
            with contextlib.suppress(OSError):
                self._count.close()
            self._count = None
        self._lock_file.close()
        with self._cv:
            stopped = self._failure is None
            if stopped:
                self._failure = OSError(errno.ESHUTDOWN, "the service is stopping")
                self._cv.notify_all()
                waiters, self._waiters = list(self._waiters), deque()
        if stopped:
            for _, loop, future in waiters:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, [future], StorageFailed(self._failure))  # type: ignore[arg-type]


def _as_os_error(exc: Exception) -> OSError:
    """What ``StorageFailed`` reports: the OS's error, or SQLite's, or the exception's."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc):
        return OSError(errno.ENOSPC, f"No space left on device ({exc})")
    return OSError(errno.EIO, f"{type(exc).__name__}: {exc}")


def _settle(futures: list[asyncio.Future[None]], error: Exception | None) -> None:
    for future in futures:
        if future.done():  # its request was cancelled
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
