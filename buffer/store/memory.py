"""The in-memory store: ``base.Store`` kept in the process, for tests and tools.

No folder, no thread but compaction's, nothing survives the process. A record is kept the
moment it is appended, so ``wait_durable`` never waits and nothing ever fails; but the log is
a real one: the records are kept encoded, handed back by ``recover`` through the same decoding
a database's are, compacted into a snapshot as they grow, and a read's record and its export
rows are kept in one step. A restart is ``close`` and then a new buffer restored from the same
object, which rebuilds the state exactly as a restart on a data folder does. The smallest
complete backend: a new one starts by copying this file.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from buffer.core.records import Event, ExportRow, Snapshotter, decode, records_of
from buffer.errors import StorageFailed
from buffer.store.base import Counters, Store

logger = logging.getLogger(__name__)


class MemoryStore(Store):
    """``compact_bytes`` and ``retention_s`` as the SQLite store's: a compaction each time
    the records after the snapshot outgrow both it and ``compact_bytes``, and export rows
    dropped once older than ``retention_s`` (by the wall clock ``wall_clock``)."""

    def __init__(
        self,
        *,
        compact_bytes: int = 256 * 2**20,
        retention_s: float = 7 * 24 * 3600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not math.isfinite(retention_s) or retention_s < 0:
            raise ValueError(
                f"the export retention must be a finite number of seconds >= 0, not {retention_s}"
            )
        self.compact_bytes = compact_bytes
        self.retention_s = retention_s
        self._wall_clock = wall_clock
        self._lock = threading.Lock()  # the store's own; taken after the buffer's, never before
        self._snapshot: list[bytes] = []
        self._events: list[bytes] = []  # the records after the snapshot, in order
        self._covered = 0  # the position of the last record the snapshot replaced
        self._snapshot_bytes = 0
        self._since_snapshot = 0
        self._delivered: deque[ExportRow] = deque()
        self._in_use = False  # between recover (or start) and close: one buffer at a time
        self._life = 0  # bumped by each recover: a compaction of an earlier life is void
        self._failure: OSError | None = None
        self._dropped = 0  # appends after close, which nothing keeps
        self._snapshotter: Snapshotter | None = None
        self._compacting: threading.Thread | None = None
        self._no_compaction = False
        self.bytes_written = 0
        self.commits = 0
        self.compactions = 0

    # -- start-up ----------------------------------------------------------------------

    def recover(self) -> Iterator[Event]:
        """The snapshot's events, then every record kept after it. Starts a new life of the
        store: the buffer restored from it is the only one it serves until ``close``."""
        with self._lock:
            self._open()
            records = [*self._snapshot, *self._events]
        return map(decode, records)

    def _open(self) -> None:
        if self._in_use:
            raise RuntimeError("the store is in use by another rollout buffer: close it first")
        self._in_use = True
        self._life += 1
        self._failure = None
        self._dropped = 0
        self._no_compaction = False

    def start(
        self, snapshotter: Snapshotter | None = None, *, lock: AbstractContextManager[Any] | None = None
    ) -> None:
        """Take appends from now on. ``lock`` is not needed: a read kept at once is never
        taken back."""
        with self._lock:
            if not self._in_use:
                self._open()
            self._snapshotter = snapshotter

    # -- changes (under the buffer's lock) ---------------------------------------------

    def append(self, record: bytes) -> None:
        with self._lock:
            if self._keep(record):
                self._maybe_compact()

    def read(self, record: bytes, rows: Callable[[], Iterable[ExportRow]], undo: Callable[[], None]) -> None:
        """Keep the read's record and its export rows in one step under the store's lock:
        ``recover`` and ``exported`` see both or neither."""
        made = list(rows())
        with self._lock:
            if not self._keep(record):
                return
            self._delivered.extend(made)
            oldest = self._wall_clock() - self.retention_s
            while self._delivered and self._delivered[0][1] < oldest:
                self._delivered.popleft()
            self._maybe_compact()

    def _keep(self, record: bytes) -> bool:
        if not self._in_use:
            self._dropped += 1  # closed: the buffer that appends has been told (``failure``)
            return False
        self._events.append(record)
        self._since_snapshot += len(record)
        self.bytes_written += len(record)
        self.commits += 1
        return True

    def position(self) -> int:
        with self._lock:
            return self._covered + len(self._events)

    # -- waiting -----------------------------------------------------------------------

    async def wait_durable(self) -> None:
        """Returns at once: a record is kept as it is appended (raises only for records
        appended after ``close``, which were not)."""
        self._raise_if_dropped()

    def wait_durable_blocking(self, timeout_s: float | None = None) -> None:
        self._raise_if_dropped()

    def _raise_if_dropped(self) -> None:
        with self._lock:
            if self._dropped and self._failure is not None:
                raise StorageFailed(self._failure)

    @property
    def failure(self) -> OSError | None:
        return self._failure

    @property
    def failing(self) -> OSError | None:
        """Always None: memory never fails, and a closed store does not recover by itself."""
        return None

    def counters(self) -> Counters:
        with self._lock:
            return {
                "data_dir": None,
                "durability": "memory",
                "bytes_written": self.bytes_written,
                "commits": self.commits,
                "compactions": self.compactions,
                "bytes_since_snapshot": self._since_snapshot,
                "failed": None if self._failure is None else str(self._failure.strerror),
            }

    # -- compaction --------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        """Under the store's lock: start a compaction in a thread of its own once the records
        since the snapshot outgrow it (so the work is amortised, O(1) a byte kept)."""
        if self._snapshotter is None or self._no_compaction:
            return
        if self._since_snapshot < max(self.compact_bytes, self._snapshot_bytes):
            return
        if self._compacting is not None and self._compacting.is_alive():
            return
        self._compacting = threading.Thread(
            target=self._compact_safely, name="memory-store-compaction", daemon=True
        )
        self._compacting.start()

    def _compact_safely(self) -> None:
        try:
            self.compact()
        except Exception:
            logger.exception("memory store compaction failed; the log keeps growing until the next try")

    def compact(self) -> None:
        """Capture the state (``snapshotter`` takes the buffer's lock for O(groups)), encode it
        outside every lock, then install it: the snapshot replaces the records up to the
        position it was captured at; those appended since stay after it."""
        if self._snapshotter is None:
            raise RuntimeError("the store was started without a snapshotter: it cannot compact")
        with self._lock:
            life = self._life
        capture = self._snapshotter()  # whole: a list of records is replaced whole
        position, staged = capture.position, list(records_of(capture))
        with self._lock:
            if life != self._life or not self._in_use:
                return  # the buffer it captured has been closed since
            del self._events[: position - self._covered]
            self._covered = position
            self._snapshot = staged
            self._snapshot_bytes = sum(map(len, staged))
            self._since_snapshot = sum(map(len, self._events))
            self.compactions += 1

    # -- the export, shutdown ----------------------------------------------------------

    def exported(
        self, since: float | None = None, until: float | None = None, task_type: str | None = None
    ) -> Iterator[ExportRow]:
        with self._lock:
            rows = list(self._delivered)
        for row in rows:
            at = row[1]
            if since is not None and at < since:
                continue
            if until is not None and at >= until:
                continue
            if task_type is not None and row[2] != task_type:
                continue
            yield row

    def close(self) -> None:
        """Stop compacting (a compaction under way finishes first) and let the next buffer
        ``recover`` what is kept."""
        with self._lock:
            self._no_compaction = True
            compaction = self._compacting
        if compaction is not None:
            compaction.join()
        with self._lock:
            self._in_use = False
            self._snapshotter = None
            self._failure = OSError(errno.ESHUTDOWN, "the service is stopping")
