"""The buffer on disk: a journal of every change, snapshots that compact it, and the export log.

    DATA_DIR/
      LOCK                          flock-ed while a service uses the folder
      journal/00000007.snapshot     the whole state as of the start of segment 7
      journal/00000007.log          the changes since, in order (segments 7, 8, ...)
      delivered/2026-11-21T14.jsonl the trajectories reads delivered, one file an hour

A record is ``<u32 length><u32 CRC-32>`` and a body: the event's JSON header, a newline, and
its payload (trajectories bytes for bytes as the buffer holds them). A start-up replays the
newest snapshot, then the segments after it; a torn record at the end of the last segment
(the write a crash interrupted, never acknowledged) is cut off, a bad record anywhere else
stops the start-up rather than silently lose what follows.

Appends come from the buffer under its lock, so the journal's order is the buffer's order,
and cost a list append. One writer thread writes what has gathered in one ``os.write`` and
one ``fdatasync`` (group commit), then releases everyone waiting on it: ``wait_durable``
for the event loop, ``wait_durable_blocking`` for threads. A write is acknowledged only
after that wait. With ``sync=False`` the writer skips the ``fdatasync``: the data has
reached the OS, which survives a crash of the service, not of the machine.

When the segments since the snapshot outgrow ``compact_bytes`` (and the snapshot itself),
a compaction thread asks the buffer for its state (``Snapshotter``: a rotation to a new
segment and a copy of references, under the buffer's lock), writes it as the next snapshot
and deletes what it replaces. The journal never grows past a few times the live state.

Why not SQLite: the state is a handful of queues and windows that one code path already
maintains; a journal replays through that same code, where tables would need a second
implementation of every rule to stay in step with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from buffer.errors import StorageFailed

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<II")
_SEGMENT_DIGITS = 8


class JournalCorrupt(Exception):
    """A record in the middle of the journal is unreadable: the start-up stops instead of
    dropping everything after it."""


@dataclass(frozen=True, slots=True)
class Event:
    header: dict[str, Any]
    payload: bytes = b""

    def parts(self) -> list[bytes]:
        """The payload parts ``encode`` was given."""
        lengths = self.header.get("n")
        if lengths is None:
            return [self.payload] if self.payload else []
        parts, start = [], 0
        for length in lengths:
            parts.append(self.payload[start : start + length])
            start += length
        return parts


def encode(header: dict[str, Any], parts: Sequence[bytes] = ()) -> bytes:
    """One framed record. With more than one payload part, ``n`` records their lengths."""
    if len(parts) > 1:
        header = {**header, "n": [len(part) for part in parts]}
    body = b"".join((orjson.dumps(header), b"\n", *parts))
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _decode(body: bytes) -> Event:
    newline = body.index(b"\n")
    return Event(orjson.loads(body[:newline]), body[newline + 1 :])


def read_records(path: Path) -> tuple[list[Event], int, int]:
    """The events of one file, the offset where its valid records end, and its size."""
    data = path.read_bytes()
    events: list[Event] = []
    offset = 0
    while offset + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, offset)
        body = data[offset + _FRAME.size : offset + _FRAME.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break
        try:
            events.append(_decode(body))
        except (ValueError, orjson.JSONDecodeError):
            break
        offset += _FRAME.size + length
    return events, offset, len(data)


#: Called by the compaction thread: under the lock every append is made under, calls
#: ``rotate`` and captures the state; returns the new segment's number and the state's
#: records (which may be produced lazily, outside the lock).
Snapshotter = Callable[[], tuple[int, Iterable[bytes]]]


@dataclass(frozen=True, slots=True)
class _Rotate:
    segment: int


@dataclass(frozen=True, slots=True)
class _Delivered:
    at: float
    lines: Callable[[], list[bytes]]


class Journal:
    def __init__(
        self,
        directory: Path,
        *,
        sync: bool = True,
        compact_bytes: int = 256 * 2**20,
        retention_s: float = 7 * 24 * 3600.0,
    ) -> None:
        self.directory = directory
        self.sync = sync
        self.compact_bytes = compact_bytes
        self.retention_s = retention_s
        self._journal_dir = directory / "journal"
        self.delivered_dir = directory / "delivered"
        self._journal_dir.mkdir(parents=True, exist_ok=True)
        self.delivered_dir.mkdir(exist_ok=True)
        self._lock_file = _lock(directory / "LOCK")
        self._cv = threading.Condition(threading.Lock())
        self._pending: list[bytes | _Rotate | _Delivered] = []
        self._appended = 0  # records appended, ever: the position a waiter waits for
        self._durable = 0
        self._waiters: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()
        self._failure: OSError | None = None
        self._closing = False
        self._writer: threading.Thread | None = None
        self._fd = -1
        self._segment = 0
        self._since_snapshot = 0  # bytes in the segments after the snapshot
        self._snapshot_bytes = 0
        self._snapshotter: Snapshotter | None = None
        self._compacting: threading.Thread | None = None
        self._no_compaction = False
        self._delivered_fd = -1
        self._delivered_hour = ""
        self._next_retention_check = 0.0
        self.bytes_written = 0
        self.commits = 0
        self.compactions = 0

    # -- start-up ----------------------------------------------------------------------

    def recover(self) -> Iterator[Event]:
        """The events to restore the buffer from: the newest snapshot, then every segment
        after it. Cuts a torn tail off the last segment. Call once, before ``start``."""
        for partial in self._journal_dir.glob("*.partial"):  # a compaction the stop interrupted
            partial.unlink()
        snapshots = sorted(self._journal_dir.glob("*.snapshot"))
        base = int(snapshots[-1].stem) if snapshots else 0
        segments = sorted(p for p in self._journal_dir.glob("*.log") if int(p.stem) >= base)
        self._segment = int(segments[-1].stem) if segments else base
        if snapshots:
            events, end, size = read_records(snapshots[-1])
            if end != size:
                raise JournalCorrupt(f"{snapshots[-1]}: unreadable record at byte {end} of {size}")
            self._snapshot_bytes = size
            yield from events
        for index, path in enumerate(segments):
            events, end, size = read_records(path)
            if end != size:
                if index != len(segments) - 1:
                    raise JournalCorrupt(f"{path}: unreadable record at byte {end} of {size}")
                logger.warning("%s: cutting off %d bytes of a write that never completed", path, size - end)
                with path.open("r+b") as file:
                    file.truncate(end)
                    os.fsync(file.fileno())
            self._since_snapshot += end
            yield from events

    def start(self, snapshotter: Snapshotter | None = None) -> None:
        """Open a new segment after those recovered and start the writer thread."""
        self._snapshotter = snapshotter
        self._segment += 1
        self._fd = self._open_segment(self._segment)
        self._writer = threading.Thread(target=self._write_forever, name="journal-writer", daemon=True)
        self._writer.start()

    # -- appends (under the buffer's lock) ---------------------------------------------

    def append(self, record: bytes) -> None:
        with self._cv:
            self._pending.append(record)
            self._appended += 1
            self._cv.notify()

    def rotate(self) -> int:
        """Start a new segment at this point of the order; returns its number. The state the
        caller snapshots now is the state as of the start of that segment."""
        with self._cv:
            self._segment += 1
            self._pending.append(_Rotate(self._segment))
            self._appended += 1
            self._cv.notify()
            return self._segment

    def deliver(self, at: float, lines: Callable[[], list[bytes]]) -> None:
        """Add trajectories a read delivered to the export log, made durable with the read.
        ``lines`` makes them, in the writer thread, off the reader's path."""
        with self._cv:
            self._pending.append(_Delivered(at, lines))
            self._appended += 1
            self._cv.notify()

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
            if not self._cv.wait_for(lambda: self._durable >= target or self._failure is not None, timeout_s):
                raise TimeoutError("the journal did not reach the disk in time")
            if self._durable < target and self._failure is not None:
                raise StorageFailed(self._failure)

    # -- the writer thread -------------------------------------------------------------

    def _write_forever(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                batch, self._pending = self._pending, []
                target, closing = self._appended, self._closing
            if batch:
                try:
                    self._commit(batch)
                except OSError as exc:
                    logger.critical(
                        "the journal cannot write to %s: %s; writes now fail", self.directory, exc
                    )
                    self._fail(exc)
                    return
                self._release(target)
                self._maybe_compact()
            if closing and not batch:
                return

    def _commit(self, batch: list[bytes | _Rotate | _Delivered]) -> None:
        chunk: list[bytes] = []
        delivered = False
        for entry in batch:
            if isinstance(entry, bytes):
                chunk.append(entry)
                continue
            self._write(self._fd, chunk)
            chunk = []
            if isinstance(entry, _Rotate):
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = self._open_segment(entry.segment)
            else:
                self._write(self._delivered_file(entry.at), entry.lines())
                delivered = True
        self._write(self._fd, chunk)
        if self.sync:
            os.fdatasync(self._fd)
            if delivered:
                os.fdatasync(self._delivered_fd)
        self.commits += 1
        if time.monotonic() >= self._next_retention_check:
            self._next_retention_check = time.monotonic() + 60.0
            self._drop_expired_exports()

    def _write(self, fd: int, parts: list[bytes]) -> None:
        if not parts:
            return
        data = memoryview(b"".join(parts))
        self.bytes_written += len(data)
        if fd == self._fd:
            self._since_snapshot += len(data)
        while data:
            data = data[os.write(fd, data) :]

    def _release(self, target: int) -> None:
        with self._cv:
            self._durable = target
            self._cv.notify_all()  # threads in wait_durable_blocking
            ready: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
            while self._waiters and self._waiters[0][0] <= target:
                _, loop, future = self._waiters.popleft()
                ready.setdefault(loop, []).append(future)
        for loop, futures in ready.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(_settle, futures, None)

    def _fail(self, exc: OSError) -> None:
        with self._cv:
            self._failure = exc
            self._cv.notify_all()
            waiters, self._waiters = list(self._waiters), deque()
        for _, loop, future in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, [future], StorageFailed(exc))

    @property
    def failure(self) -> OSError | None:
        return self._failure

    def counters(self) -> dict[str, Any]:
        return {
            "data_dir": str(self.directory),
            "durability": "sync" if self.sync else "flush",
            "bytes_written": self.bytes_written,
            "commits": self.commits,
            "compactions": self.compactions,
            "bytes_since_snapshot": self._since_snapshot,
            "failed": None if self._failure is None else str(self._failure),
        }

    # -- files -------------------------------------------------------------------------

    def _open_segment(self, number: int) -> int:
        fd = os.open(
            self._journal_dir / f"{number:0{_SEGMENT_DIGITS}d}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )
        _fsync_dir(self._journal_dir)
        return fd

    def _delivered_file(self, at: float) -> int:
        hour = hour_stem(at)
        if hour != self._delivered_hour:
            if self._delivered_fd >= 0:
                os.fsync(self._delivered_fd)
                os.close(self._delivered_fd)
            path = self.delivered_dir / f"{hour}.jsonl"
            self._delivered_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            _fsync_dir(self.delivered_dir)
            self._delivered_hour = hour
        return self._delivered_fd

    def _drop_expired_exports(self) -> None:
        cutoff = hour_stem(time.time() - self.retention_s)
        for path in self.delivered_dir.glob("*.jsonl"):
            if path.stem < cutoff and path.stem != self._delivered_hour:
                path.unlink(missing_ok=True)
                logger.info("export: dropped %s, past the retention", path.name)

    # -- compaction --------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        if self._snapshotter is None:
            return
        with self._cv:  # against close(): a compaction is either never started or joined
            if self._no_compaction or self._since_snapshot < max(self.compact_bytes, self._snapshot_bytes):
                return
            if self._compacting is not None and self._compacting.is_alive():
                return
            self._compacting = threading.Thread(
                target=self._compact_safely, name="journal-compaction", daemon=True
            )
            self._compacting.start()

    def _compact_safely(self) -> None:
        try:
            self.compact()
        except Exception:
            logger.exception("journal compaction failed; the journal keeps growing until the next try")

    def compact(self) -> None:
        """Write the state as a snapshot and delete the segments and snapshot it replaces."""
        assert self._snapshotter is not None
        started = time.monotonic()
        segment, records = self._snapshotter()
        final = self._journal_dir / f"{segment:0{_SEGMENT_DIGITS}d}.snapshot"
        partial = final.with_suffix(".partial")
        size = 0
        with partial.open("wb") as file:
            for record in records:
                file.write(record)
                size += len(record)
            file.flush()
            os.fsync(file.fileno())
        partial.rename(final)
        _fsync_dir(self._journal_dir)
        with self._cv:
            self._since_snapshot = sum(
                p.stat().st_size for p in self._journal_dir.glob("*.log") if int(p.stem) >= segment
            )
            self._snapshot_bytes = size
        for path in self._journal_dir.iterdir():
            if path.suffix in (".log", ".snapshot") and int(path.stem) < segment:
                path.unlink()
        self.compactions += 1
        logger.info(
            "journal compacted: snapshot %s of %.1f MB in %.1f s",
            final.name,
            size / 1e6,
            time.monotonic() - started,
        )

    # -- shutdown ----------------------------------------------------------------------

    def close(self) -> None:
        """Write and sync everything appended, stop the threads, release the folder. Anything
        appended after (by a straggling generator thread) is refused with ``StorageFailed``."""
        with self._cv:
            self._no_compaction = True
            compaction = self._compacting
        if compaction is not None:
            compaction.join()  # its rotation is then in the queue, which the writer drains
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join()
        for fd in (self._fd, self._delivered_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.fsync(fd)
                os.close(fd)
        self._fd = self._delivered_fd = -1
        self._lock_file.close()
        if self._failure is None:
            self._fail(OSError("the service is stopping"))


def hour_stem(at: float) -> str:
    """The name of the export file that takes deliveries at ``at``: its UTC hour."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H")


def _settle(futures: list[asyncio.Future[None]], error: Exception | None) -> None:
    for future in futures:
        if future.done():  # its request was cancelled
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock(path: Path) -> BinaryIO:
    file = path.open("ab")
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise RuntimeError(f"{path.parent} is in use by another rollout buffer (it holds {path})") from None
    return file
