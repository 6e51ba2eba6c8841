"""The export: every trajectory a read delivered, one JSON object a line.

    {"delivered_at": 1763733600.12, "read_id": 42, "task_type": "math", "instance_id": "q-7",
     "trajectory": {...the trajectory as the trainer received it...}}

A store keeps the rows (``Store.exported``) with the read itself, so a read is exported exactly
when it counts as delivered; it drops rows past its retention. Each read has its own
``read_id`` and time, so two reads in one second never overwrite each other (slime's buffer
dumped each batch to a file named by the second). In the data folder they are the table
``delivered``: ``sqlite3 DATA_DIR/buffer.sqlite3 "SELECT ... FROM delivered"`` reads them
without the service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from buffer.core.records import ExportRow
from buffer.store.base import Store
from buffer.store.schema import connect

_TRAJECTORY = b',"trajectory":'
_CHUNK_BYTES = 1 << 20


def line(read_id: int, at: float, task_type: str, instance_id: Any, trajectory: bytes) -> bytes:
    """One export row as a line of JSON: the trajectory spliced in as it is, never re-encoded."""
    head = {"delivered_at": at, "read_id": read_id, "task_type": task_type, "instance_id": instance_id}
    return b"".join((orjson.dumps(head)[:-1], _TRAJECTORY, trajectory, b"}\n"))


def read(
    store: Store, since: float | None = None, until: float | None = None, task_type: str | None = None
) -> Iterator[bytes]:
    """The lines delivered in ``[since, until)`` (Unix seconds), oldest first, in chunks of
    about a megabyte. Blocking: iterate it in a thread."""
    chunk: list[bytes] = []
    size = 0
    for row in store.exported(since, until, task_type):
        chunk.append(line(*row))
        size += len(chunk[-1])
        if size >= _CHUNK_BYTES:
            yield b"".join(chunk)
            chunk, size = [], 0
    if chunk:
        yield b"".join(chunk)


#: Export rows read per query: the writer is never held back by a slow export client.
_EXPORT_PAGE_ROWS = 2000


def from_database(
    database: Path, since: float | None = None, until: float | None = None, task_type: str | None = None
) -> Iterator[ExportRow]:
    """The rows of ``delivered`` in ``database`` in ``[since, until)``, oldest first, from a
    read-only connection of their own, a page of rows per query (``sqlite.Journal.exported``)."""
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
        f"WHERE {' AND '.join(where)} ORDER BY id LIMIT {_EXPORT_PAGE_ROWS}"
    )
    connection = connect(database, readonly=True)
    try:
        last = 0
        while page := connection.execute(query, (last, *bounds)).fetchall():
            last = page[-1][0]
            for _, read_id, at, task, instance_id, trajectory in page:
                yield read_id, at, task, instance_id, trajectory.encode()
    finally:
        connection.close()
