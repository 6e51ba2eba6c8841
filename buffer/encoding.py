"""Encoding the trajectories the buffer stores.

orjson 3.13 returns each encoded object in a buffer of at least 16 KB, whatever its length:
kept as is, a buffered 2 KB trajectory would cost eight times its size. ``dumps`` copies the
result into an exactly sized ``bytes``; the copy costs far less than the encoding.

A trajectory is encoded once, in two parts joined (``dumps_parted``): its small fields first
(every key but ``BULKY``: uid, reward, extra_info, ...), then the bulky ones. The default hooks
read and change only the small fields, so a finished group is rewritten by decoding and
encoding those alone (``small_fields``, ``with_small_fields``): messages and token records
are parsed once per trajectory, at the edge, and copied as bytes from then on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

loads = orjson.loads
EncodeError = orjson.JSONEncodeError
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


#: The top-level keys of a trajectory kept after its small fields: those that make its size.
BULKY = ("messages", "turns", "tools")


def dumps(obj: Any) -> bytes:
    return bytes(memoryview(orjson.dumps(obj)))


def dumps_parted(item: Mapping[str, Any]) -> tuple[bytes, int]:
    """``item``'s JSON, its small fields (every key but ``BULKY``) first, and where they end,
    ``head``: ``raw[:head] + b"}"`` is the object of the small fields and ``raw[head:]`` the
    rest of the object, ``}`` or ``,`` and the bulky members (head 0: not parted, as an item
    without small fields). Raises ``EncodeError`` as ``dumps`` does."""
    small = orjson.dumps({key: value for key, value in item.items() if key not in BULKY})
    if len(small) == 2:
        return dumps(item), 0
    bulky = {key: item[key] for key in BULKY if key in item}
    head = len(small) - 1
    if not bulky:
        return bytes(memoryview(small)), head
    rest = orjson.dumps(bulky)
    return b"".join((memoryview(small)[:head], b",", memoryview(rest)[1:])), head


def small_fields(raw: bytes, head: int) -> dict[str, Any]:
    """The small fields of a trajectory ``dumps_parted`` encoded (``head`` > 0)."""
    return orjson.loads(b"".join((memoryview(raw)[:head], b"}")))  # type: ignore[no-any-return]


def with_small_fields(small: dict[str, Any], raw: bytes, head: int) -> bytes:
    """The trajectory ``raw`` (parted at ``head`` > 0) with ``small`` for its small fields."""
    encoded = memoryview(orjson.dumps(small))
    rest = memoryview(raw)[head:]
    if len(encoded) == 2 and rest[:1].tobytes() == b",":  # no small field left: no comma after the "{"
        rest = rest[1:]
    return b"".join((encoded[:-1], rest))


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
