"""Encoding the trajectories the buffer stores.

orjson 3.13 returns each encoded object in a buffer of at least 16 KB, whatever its length:
kept as is, a buffered 2 KB trajectory would cost eight times its size. ``dumps`` copies the
result into an exactly sized ``bytes``; the copy costs far less than the encoding.
"""

from __future__ import annotations

from typing import Any

import orjson

loads = orjson.loads


def dumps(obj: Any) -> bytes:
    return bytes(memoryview(orjson.dumps(obj)))
