"""Encoding the trajectories the buffer stores.

orjson 3.13 returns each encoded object in a buffer of at least 16 KB, whatever its length:
kept as is, a buffered 2 KB trajectory would cost eight times its size. ``dumps`` copies the
result into an exactly sized ``bytes``; the copy costs far less than the encoding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

loads = orjson.loads
EncodeError = orjson.JSONEncodeError
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def dumps(obj: Any) -> bytes:
    return bytes(memoryview(orjson.dumps(obj)))


def huge_integer_at(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where the first integer beyond 64 bits (which orjson cannot encode) is, or None."""
    if isinstance(value, int):
        return None if INT64_MIN <= value <= INT64_MAX else path
    if isinstance(value, dict):
        children: Iterable[tuple[str | int, Any]] = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    else:
        return None
    for key, child in children:
        found = huge_integer_at(child, (*path, key))
        if found is not None:
            return found
    return None
