"""The store contract: what the buffer asks of wherever it keeps its changes.

A store keeps an ordered log of records (``buffer.core.records``) and gives it back at the
next start, so the buffer rebuilds itself by replaying it; it keeps the export of what reads
delivered; and it compacts the log into a snapshot of the state, so a restart replays the state
rather than its whole history. It knows the record format and nothing of the rules that made
the records: a backend is one file implementing ``Store``, and every backend passes the same
tests (``tests/store/test_contract.py``). ``sqlite.Journal`` keeps them in the data folder;
``memory.MemoryStore`` in the process, for tests and tools (nothing survives the process).

The life of a store, as ``RolloutBuffer`` and the service use it::

    store = Journal(folder)                 # or MemoryStore()
    buffer.restore(store.recover())         # the snapshot, then every record after it
    buffer.attach(store)                    # store.start(buffer.snapshot, lock=buffer's lock)
    ...                                     # append / read under that lock; wait_durable after
    store.close()                           # everything appended is kept; nothing after

Whatever the backend, these hold (the contract suite checks each):

- Records come back from ``recover`` in the order they were appended, after a ``close``.
- An append is acknowledged (``wait_durable`` returns) only once it is kept: a record whose
  wait returned is given back by every later ``recover``.
- A read's record and its export rows are kept together or not at all; a read that cannot be
  kept is taken back (its ``undo`` runs, under the buffer's lock) and never exported.
- Compaction keeps the state: replaying the snapshot and the records after it rebuilds what
  replaying every record did.
- While a store cannot keep changes, ``failure`` says why and ``wait_durable`` raises
  ``StorageFailed``; the buffer refuses changes before making them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypedDict

from buffer.core.records import Event, ExportRow, Snapshotter


class Counters(TypedDict):
    """What ``/health`` (``storage``) and ``/metrics`` (``rollout_buffer_journal_*``) show."""

    data_dir: str | None  #: where the store keeps its data (None: in the process)
    durability: str  #: ``sync``, ``flush`` or ``memory``
    bytes_written: int  #: the bytes of the records kept since the store was opened
    commits: int  #: how many times records were kept (a group commit counts once)
    compactions: int  #: snapshots installed since the store was opened
    bytes_since_snapshot: int  #: the bytes a restart replays beyond the snapshot
    failed: str | None  #: why changes cannot be kept now, if they cannot


class Store(Protocol):
    """Where the buffer keeps its changes. ``append``, ``read`` and ``position`` are called
    under the buffer's lock and must cost O(1) there (work beyond it goes to another thread
    or waits for the lock's release); everything else from any thread, without it."""

    # -- start-up ----------------------------------------------------------------------

    def recover(self) -> Iterator[Event]:
        """The events to rebuild the buffer from: the snapshot's, then every record appended
        after it, in order. Called once, before ``start``; raises if what is kept cannot be
        read back, rather than give back part of it."""
        ...

    def start(
        self, snapshotter: Snapshotter | None = None, *, lock: AbstractContextManager[Any] | None = None
    ) -> None:
        """Take appends from now on. ``snapshotter`` captures the state for compaction (none:
        the store never compacts by itself); ``lock`` is the one every append is made under,
        which the store takes to run a read's ``undo``."""
        ...

    # -- changes (under the buffer's lock) ---------------------------------------------

    def append(self, record: bytes) -> None:
        """Keep ``record`` after every record appended before it. Returns at once; the record
        is kept once ``wait_durable`` returns."""
        ...

    def read(self, record: bytes, rows: Callable[[], Iterable[ExportRow]], undo: Callable[[], None]) -> None:
        """Keep a read: its ``record`` and the export rows ``rows`` makes, together or not at all.
        ``rows`` may run later, off the reader's path. If the read cannot be kept, ``undo``
        runs (under the ``start`` lock) and the read is never given back by ``recover``."""
        ...

    def position(self) -> int:
        """How many records were appended (reads included), ever: a snapshot the
        ``snapshotter`` captures now covers up to this position."""
        ...

    # -- waiting -----------------------------------------------------------------------

    async def wait_durable(self) -> None:
        """Return once everything appended so far is kept; raises ``StorageFailed`` if it
        cannot be. Never blocks the event loop."""
        ...

    def wait_durable_blocking(self, timeout_s: float | None = None) -> None:
        """``wait_durable`` for a thread; ``TimeoutError`` past ``timeout_s``."""
        ...

    @property
    def failure(self) -> OSError | None:
        """Why changes cannot be kept now (a failed commit, or the store closed); the buffer
        refuses writes while it is set."""
        ...

    @property
    def failing(self) -> OSError | None:
        """The failure of a store that will recover by itself (None once it has, and once
        closed): the buffer refuses reads while it is set, and ``/health`` reports it."""
        ...

    def counters(self) -> Counters:
        """The store's counters, for ``/health`` and ``/metrics``."""
        ...

    # -- compaction, export, shutdown ----------------------------------------------------

    def compact(self) -> None:
        """Replace the records kept so far by a snapshot of the state, from ``snapshotter``.
        The snapshot is in place once a ``wait_durable`` started after this returns does."""
        ...

    def exported(
        self, since: float | None = None, until: float | None = None, task_type: str | None = None
    ) -> Iterator[ExportRow]:
        """The export rows kept, delivered in ``[since, until)`` (Unix seconds) and of
        ``task_type`` if given, oldest first; as far back as the store's retention. Blocking:
        iterate it in a thread. Works after ``close`` too."""
        ...

    def close(self) -> None:
        """Keep everything appended, stop the store's threads, let another buffer use it.
        Anything appended afterwards is dropped, and ``failure`` says the store is closed."""
        ...
