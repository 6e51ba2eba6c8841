"""The record format: what the buffer keeps of each change, and what a store hands back.

A record is one change (or, in a snapshot, one piece of the state): a JSON header whose ``e``
names its kind, a newline, then the payload: the trajectories' bytes exactly as the buffer
holds them, one part after another (``n`` in the header lists their lengths when there are
several). The core writes records (``encode``) and replays them (``Event``) through the same
code that made the change; a store keeps them in order and gives them back, and knows nothing
of what they mean. So the format lives here, beside the code that makes and reads it, and every
store backend (``buffer.store``) imports it from here.

The kinds the buffer writes: ``w`` (a write), ``fin`` (a group's outcome), ``read``, ``stale``,
``dup``, ``task`` (a task's settings), ``job``, ``job_end``, ``job_pause``, ``job_resume``,
``nop`` (a position with no change); in a snapshot ``open``, ``ready``, ``aside``,
``task_state``, ``state``, ``uids`` and ``wi`` (chunks of the uids remembered and of a task's
window's instances), each a ``Piece`` of one of its parts; extensions' kinds start with
``x:``. The format is the data folder's: changing it needs a migration
(``buffer.store.migration``).

An export row is what a read delivered, one per trajectory, kept with the read's own record.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import orjson

from buffer import storable
from buffer.errors import InvalidInput

if TYPE_CHECKING:
    from buffer.core.task import ReadyGroup


@dataclass(frozen=True, slots=True)
class Event:
    """A record as a store gives it back: the header parsed, the payload as it was written."""

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
    """One record: the header's JSON, a newline, the payload parts. With more than one part,
    ``n`` records their lengths.

    orjson writes a non-finite float as ``null``, which would read back as something else
    (and stop every later start-up): such a header is refused with ``InvalidInput``."""
    if len(parts) > 1:
        header = {**header, "n": [len(part) for part in parts]}
    head = orjson.dumps(header)
    if b"null" in head:  # cheap: only then look for the float behind it
        refuse_non_finite(header)
    return b"".join((head, b"\n", *parts))


def refuse_non_finite(value: Any, prefix: str = "") -> None:
    """Raise ``InvalidInput`` naming the first float in ``value`` that is inf or nan."""
    where = storable.non_finite_at(value)
    if where is not None:
        field = ".".join(str(part) for part in (*([prefix] if prefix else []), *where))
        raise InvalidInput.one(field, "must be a finite number (the data folder cannot keep inf or nan)")


def split(record: bytes) -> tuple[str, memoryview]:
    """A record's header (as text) and payload: the two columns a table keeps it in."""
    newline = record.index(b"\n")
    return record[:newline].decode(), memoryview(record)[newline + 1 :]


def decode(record: bytes) -> Event:
    """The event of a record ``encode`` made (a store that keeps whole records reads them so)."""
    newline = record.index(b"\n")
    return Event(orjson.loads(record[:newline]), record[newline + 1 :])


#: The record of a position with no change (a read a store took back, a compaction): it
#: replays to nothing, and keeps a store's positions dense.
NOTHING = b'{"e":"nop"}\n'

#: The parts of a snapshot, in the order a restore reads them: the tasks' settings, the ready
#: groups (by ``seq``), the rest (groups set aside, the tasks' and the buffer's counters, the
#: uids remembered, extensions, the replay pool), then the open groups (oldest write first: the
#: part most rows are added to, last, where a store appends them to full pages).
HEAD, READY, TAIL, OPEN = range(4)
PARTS = 4
#: The parts whose pieces have neither key nor order (rewritten by every snapshot).
VOLATILE_PARTS = (HEAD, TAIL)


class Piece(NamedTuple):
    """One row of a snapshot as the buffer captures it. ``key`` names an open group's row
    (``open_key``) and ``order`` a ready group's (its ``seq``, which orders the part): a delta
    replaces or (``record`` None) deletes only the rows it names, and a store keeps the others.
    A piece with neither is rewritten by every snapshot, delta or not."""

    part: int
    record: bytes | None
    key: str | None = None
    order: int | None = None


def open_key(task_type: str, instance_id: Any) -> str:
    """The key of an open group's row: its task and instance (an int and a str stay apart)."""
    return orjson.dumps((task_type, instance_id)).decode()


class Capture(NamedTuple):
    """A snapshot: the store's position it covers, and its pieces (made lazily, outside the
    lock), in restore order. ``delta``: only what changed since the previous capture (every
    piece without a key or an order, and the open and ready groups written, finished or read
    since); else the whole state."""

    position: int
    pieces: Generator[Piece, None, None]
    delta: bool


class Snapshotter(Protocol):
    """Called by a store's compaction: under the lock every append is made under, reads the
    store's ``position`` and captures the state. ``delta`` asks for the changes since the
    previous capture, which the store must then hold installed; the buffer may answer with a
    whole snapshot all the same (``Capture.delta``)."""

    def __call__(self, *, delta: bool = False) -> Capture: ...


def records_of(capture: Capture) -> Iterator[bytes]:
    """The records of a whole snapshot, in restore order (a store that keeps them as a list)."""
    assert not capture.delta, "a delta has no meaning without the snapshot it changes"
    for piece in capture.pieces:
        assert piece.record is not None
        yield piece.record


#: An export row: (read_id, delivered_at, task_type, instance_id, trajectory bytes).
ExportRow = tuple[int, float, str, Any, bytes]


def export_rows(groups: Iterable[ReadyGroup], at: float, read_id: int) -> list[ExportRow]:
    """The export rows of a read's groups: the trajectories' bytes as the trainer got them."""
    return [
        (read_id, at, group.task_type, group.instance_id, item) for group in groups for item in group.items
    ]
