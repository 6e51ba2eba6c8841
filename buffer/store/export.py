"""The export: every trajectory a read delivered, one JSON object a line.

    {"delivered_at": 1763733600.12, "read_id": 42, "task_type": "math", "instance_id": "q-7",
     "trajectory": {...the trajectory as the trainer received it...}}

The rows live in the data folder's database (table ``delivered``), written in the same
transaction as the read itself, so a read is exported exactly when it counts as delivered;
the journal deletes rows past the retention. Each read has its own ``read_id`` and time, so
two reads in one second never overwrite each other (slime's buffer dumped each batch to a
file named by the second). ``sqlite3 DATA_DIR/buffer.sqlite3 "SELECT ... FROM delivered"``
reads them without the service.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from buffer.core.task import ReadyGroup
from buffer.store.sqlite import ExportRow, connect

_TRAJECTORY = b',"trajectory":'
_CHUNK_BYTES = 1 << 20
_PAGE_ROWS = 2000


def rows(groups: Iterable[ReadyGroup], at: float, read_id: int) -> list[ExportRow]:
    """The export rows of a read's groups: the trajectories' bytes as the trainer got them."""
    return [
        (read_id, at, group.task_type, group.instance_id, item) for group in groups for item in group.items
    ]


def line(read_id: int, at: float, task_type: str, instance_id: Any, trajectory: str) -> bytes:
    head = {"delivered_at": at, "read_id": read_id, "task_type": task_type, "instance_id": instance_id}
    return b"".join((orjson.dumps(head)[:-1], _TRAJECTORY, trajectory.encode(), b"}\n"))


def read(
    database: Path, since: float | None = None, until: float | None = None, task_type: str | None = None
) -> Iterator[bytes]:
    """The lines delivered in ``[since, until)`` (Unix seconds), oldest first, in chunks of
    about a megabyte. Blocking: iterate it in a thread. Reads a page of rows at a time, so
    the writer is never held back by a slow client."""
    where = ["id > ?"]
    bounds: list[Any] = []
    if since is not None:
        where.append("delivered_at >= ?")
        bounds.append(since)
    if until is not None:
        where.append("delivered_at < ?")
        bounds.append(until)
    if task_type is not None:
        where.append("task_type = ?")
        bounds.append(task_type)
    query = (
        "SELECT id, read_id, delivered_at, task_type, instance_id, trajectory FROM delivered "
        f"WHERE {' AND '.join(where)} ORDER BY id LIMIT {_PAGE_ROWS}"
    )
    connection = connect(database, readonly=True)
    try:
        last = 0
        chunk: list[bytes] = []
        size = 0
        while True:
            page = connection.execute(query, (last, *bounds)).fetchall()
            if not page:
                break
            last = page[-1][0]
            for _, *fields in page:
                chunk.append(line(*fields))
                size += len(chunk[-1])
                if size >= _CHUNK_BYTES:
                    yield b"".join(chunk)
                    chunk, size = [], 0
        if chunk:
            yield b"".join(chunk)
    finally:
        connection.close()
