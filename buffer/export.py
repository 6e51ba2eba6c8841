"""The export log: every trajectory a read delivered, one JSON object a line.

    {"delivered_at": 1763733600.12, "read_id": 42, "task_type": "math", "instance_id": "q-7",
     "trajectory": {...the trajectory as the trainer received it...}}

The journal appends a read's lines to ``DATA_DIR/delivered/<UTC hour>.jsonl`` in the same
commit as the read itself, and drops files once they are older than the retention. Each
read has its own ``read_id`` and time, so two reads in one second never overwrite each
other (slime's buffer dumped each batch to a file named by the second).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson

from buffer.journal import hour_stem
from buffer.task import ReadyGroup

_PREFIX = b'{"delivered_at":'
_TRAJECTORY = b',"trajectory":'
_CHUNK_BYTES = 1 << 20


def lines(groups: Iterable[ReadyGroup], at: float, read_id: int) -> list[bytes]:
    """The export lines of a read's groups, spliced around the trajectories' bytes."""
    out: list[bytes] = []
    for group in groups:
        head = {
            "delivered_at": at,
            "read_id": read_id,
            "task_type": group.task_type,
            "instance_id": group.instance_id,
        }
        prefix = orjson.dumps(head)[:-1] + _TRAJECTORY
        out.extend(b"".join((prefix, item, b"}\n")) for item in group.items)
    return out


def read(
    directory: Path, since: float | None = None, until: float | None = None, task_type: str | None = None
) -> Iterator[bytes]:
    """The lines delivered in ``[since, until)`` (Unix seconds), oldest first, in chunks of
    about a megabyte. Blocking file I/O: iterate it in a thread."""
    first_hour = hour_stem(since) if since is not None else ""
    task_field = b'"task_type":' + orjson.dumps(task_type) + b"," if task_type is not None else None
    chunk: list[bytes] = []
    size = 0
    for path in sorted(directory.glob("*.jsonl")):
        if path.stem < first_hour:
            continue
        with path.open("rb") as file:
            for line in file:
                if not line.endswith(b"\n") or not line.startswith(_PREFIX):
                    continue  # the tail of a write a crash cut short
                head = line[: line.find(_TRAJECTORY)]
                at = float(head[len(_PREFIX) : head.index(b",")])
                if (since is not None and at < since) or (until is not None and at >= until):
                    continue
                if task_field is not None and task_field not in head:
                    continue
                chunk.append(line)
                size += len(line)
                if size >= _CHUNK_BYTES:
                    yield b"".join(chunk)
                    chunk, size = [], 0
    if chunk:
        yield b"".join(chunk)
