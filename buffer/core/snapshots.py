"""A task's state as a compaction writes it: whole, or only what changed since the last capture.

A snapshot is a list of pieces (``records.Piece``) in four parts, in the order a restore reads
them (``HEAD``: the tasks' settings; ``READY``: the ready groups by ``seq``; ``TAIL``: the groups
set aside, the counters, the rest; ``OPEN``: the open groups, oldest write first). An open
group's row is keyed by its task and instance (``records.open_key``) and a ready group's by
its ``seq``; every other piece is rewritten by each snapshot.

A delta (``delta=True``) holds only the keyed rows that changed since the previous capture,
which the store holds installed (it asks for a whole snapshot whenever it cannot vouch for
that: the first, and after a compaction that was not installed):

- open groups: the keys put or popped since (``OpenTable.touched``). Those still open are the
  captured table's last ones, in order (a put moves its key to the end, the others keep their
  order), so they are read from its end, O(changes); the others' rows are deleted. The store
  appends the new rows at the end of the part, so its order stays the table's.
- ready groups: those with a ``seq`` above the highest a capture held (``ready_top``: every
  group at or below it has its row, since the queue is kept in ``seq`` order and a group
  given back after a capture voids that capture's install), and the rows of those taken or
  dropped since (``ready_left``, less those given back).

- two lists that grow with the buffer, the uids remembered for deduplication (``UidCapture``)
  and each task's instances written since the last read (its window's), are kept in chunks of
  ``CHUNK`` in the order they came, keyed by their number: a delta rewrites the last chunk and
  the new ones, and deletes those that left (uids past the window; a window closed by a read).

Nothing here is done per unchanged group: the staging's cost and the folder's growth follow
the change, not the state; the rest (settings, counters, the groups set aside, the replay pool)
is small and rewritten each time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import orjson

from buffer.core.records import HEAD, OPEN, READY, TAIL, Piece, encode, open_key
from buffer.core.task import _view

if TYPE_CHECKING:
    from buffer.core.task import InstanceId, TaskBuffer
    from buffer.core.writes import WritePath

#: Items per chunk of the lists kept in chunks (uids, a window's instances).
CHUNK = 4096


def chunk_key(kind: str, *names: Any) -> str:
    return f"{kind}:{orjson.dumps(names).decode()}"


class TaskCapture:
    """One task's state captured under the buffer's lock (``RolloutBuffer.snapshot``): O(1) for
    its open groups, O(new ones) for its ready groups in a delta. Its pieces are made outside
    the lock, part by part."""

    def __init__(self, task: TaskBuffer, wall_of: Callable[[float], float], *, delta: bool) -> None:
        self.task_type = task.task_type
        self.delta = delta
        self.wall_of = wall_of
        self.settings = task.settings_record(current=False)
        self.groups, touched = task._open.capture()
        self.touched = touched if touched is not None else set()
        left = task.ready_left
        if left is not None:
            task.ready_left = set()
        self.left = left if left is not None else set()
        assert not delta or (touched is not None and left is not None), "a delta of what was not tracked"
        top = task.ready_top
        if delta:
            ready = list(itertools.takewhile(lambda group: group.seq > top, reversed(task.ready)))
            ready.reverse()
        else:
            ready = list(task.ready)
        self.ready = ready
        if task.ready:
            task.ready_top = max(top, task.ready[-1].seq)
        self.aside = list(task.set_aside)
        self.window_records, self.window_count = task.window_records, len(task.window_records)
        self.finished, self.finished_count = task.finished_instance_ids, len(task.finished_instance_ids)
        # the window's instances from the first chunk a delta changes (all: O(1) for a list)
        log, count, base = task.window_log, len(task.window_log), task.window_base
        same = delta and base is not None and base[0] == task.window_epoch
        self.first_chunk = base[1] // CHUNK if same and base is not None else 0
        self.window: list[InstanceId] | None = log[self.first_chunk * CHUNK : count]
        self.gone_chunks = range(-(-count // CHUNK), -(-base[1] // CHUNK)) if delta and base else range(0)
        task.window_base = (task.window_epoch, count)
        if same and base is not None and base[1] == count:
            self.window = None  # unchanged
        self.state: dict[str, Any] = {
            "e": "task_state",
            "t": task.task_type,
            "written": task.written,
            "delivered_items": task.delivered_items,
            "delivered_groups": task.delivered_groups,
            "discarded": dict(task.discarded),
            "set_aside_total": task.set_aside_total,
            "rewards": task.rewards.to_json(),
            "window": task.window.to_json(),
            "window_discarded": dict(task.window_discarded),
            "wn": count,
        }

    def head(self) -> Iterator[Piece]:
        yield Piece(HEAD, self.settings)

    def open(self) -> Iterator[Piece]:
        """The open groups' rows: all of them, or (delta) those touched since the last capture,
        the others deleted."""
        groups, task_type = self.groups, self.task_type
        if self.delta:
            touched, present = self.touched, 0
            for key in touched:
                if key in groups:
                    present += 1
                else:
                    yield Piece(OPEN, None, key=open_key(task_type, key))
            keys = list(itertools.islice(reversed(groups), present))
            keys.reverse()
            if not touched.issuperset(keys):  # never: the touched groups are the table's last
                raise RuntimeError(f"task {task_type}: the open groups touched are not the last ones")
            stored: Iterator[Any] = map(groups.__getitem__, keys)
        else:
            stored = iter(groups.values())
        wall_of = self.wall_of
        for group in map(_view, stored):
            header: dict[str, Any] = {
                "e": "open",
                "t": task_type,
                "i": group.instance_id,
                "size": group.size,
                "last": wall_of(group.last_write_s),
                "u": [r.uid for r in group.records],
                "r": [r.reward for r in group.records],
                "h": [r.head for r in group.records],
            }
            record = encode(header, [r.raw for r in group.records])
            yield Piece(OPEN, record, key=open_key(task_type, group.instance_id))

    def ready_pieces(self) -> Iterator[Piece]:
        """The ready groups' rows: all of them, or (delta) the new ones, and the ones taken
        since deleted."""
        if self.delta:
            for seq in sorted(self.left):
                yield Piece(READY, None, order=seq)
        for g in self.ready:
            header = {"e": "ready", "t": self.task_type, "i": g.instance_id, "seq": g.seq}
            yield Piece(READY, encode(header, g.items), order=g.seq)

    def tail(self) -> Iterator[Piece]:
        """The groups set aside and the task's counters, rewritten by every snapshot."""
        for a in self.aside:
            header: dict[str, Any] = {"e": "aside", "t": self.task_type, "i": a.instance_id, "hook": a.hook}
            header.update(error=a.error, tb=a.traceback, at=a.at)
            yield Piece(TAIL, encode(header, a.items))
        task_type = self.task_type
        for chunk in self.gone_chunks:  # a window closed since: its chunks past the new one's
            yield Piece(TAIL, None, key=chunk_key("wi", task_type, chunk))
        if self.window is not None:
            for start in range(0, len(self.window), CHUNK):
                chunk = self.first_chunk + start // CHUNK
                ids = self.window[start : start + CHUNK]
                record = encode({"e": "wi", "t": task_type, "c": chunk, "i": ids})
                yield Piece(TAIL, record, key=chunk_key("wi", task_type, chunk))
        state = self.state
        kept = self.window_records[: self.window_count]
        state["finished"] = self.finished[: self.finished_count]
        state["window_records"] = [[iid, r.uid, r.reward] for iid, r in kept]
        yield Piece(TAIL, encode(state, [r.raw for _, r in kept]))


class UidCapture:
    """The uids remembered for deduplication, captured under the buffer's lock: numbered as
    written (the n-th uid remembered is n; ``WritePath.uids_after``), in chunks of ``CHUNK``
    (chunk c holds c * CHUNK + 1 ... (c + 1) * CHUNK). ``base``: the last number and the first
    chunk the snapshot holds (None: not known, or a whole snapshot); a delta rewrites the chunks
    from the one holding ``last + 1`` and deletes those wholly past the window. A chunk the
    window left in part keeps its older uids: a restore remembers them first and the window
    drops them again. O(uids since the last capture) under the lock for a delta."""

    def __init__(self, writes: WritePath, base: tuple[int, int] | None) -> None:
        after = 0 if base is None else (base[0] // CHUNK) * CHUNK  # rewritten: the chunks above
        first, self.last, self.uids = writes.uids_after(after)
        self.number = self.last - len(self.uids) + 1  # of uids[0]
        self.first_chunk = (first - 1) // CHUNK if self.last >= first else self.last // CHUNK
        self.gone = range(0) if base is None else range(base[1], self.first_chunk)
        self.base = (self.last, self.first_chunk)

    def pieces(self) -> Iterator[Piece]:
        for chunk in self.gone:
            yield Piece(TAIL, None, key=chunk_key("uids", chunk))
        number = self.number
        while number <= self.last:
            chunk = (number - 1) // CHUNK
            end = min((chunk + 1) * CHUNK, self.last)
            uids = self.uids[number - self.number : end - self.number + 1]
            yield Piece(TAIL, encode({"e": "uids", "c": chunk, "u": uids}), key=chunk_key("uids", chunk))
            number = end + 1


def in_order(
    captures: list[TaskCapture],
    uids: UidCapture,
    state: Callable[[], bytes],
    extensions: Iterable[Iterable[bytes]],
) -> Iterator[Piece]:
    """A capture's pieces in the parts' order (``records.PARTS``): the tasks' settings, their
    ready groups, the rest (the tasks' own, the uids, the buffer's ``state`` record, the
    extensions' records), then their open groups."""
    for part in ("head", "ready_pieces", "tail"):
        for capture in captures:
            yield from getattr(capture, part)()
    yield from uids.pieces()
    yield Piece(TAIL, state())
    for extension in extensions:
        for record in extension:
            yield Piece(TAIL, record)
    for capture in captures:
        yield from capture.open()
