"""A sample's routed experts (MoE routing replay) from its turns' segments.

Each turn of a trajectory written with ``return_routed_experts`` holds the engine's routed
experts per request (``routed_experts: [{"start", "rows", "data"}, ...]``): ``data`` is base64 of
int32, ``rows`` rows of ``layers * topk`` for the tokens ``start .. start + rows`` of that
request's sequence (its prompt and output). Every turn's full prompt starts at the sample's first
token, so each segment lands at its ``start`` in the sample; a later one (a continuation, a later
turn) covers the rows an earlier one held with the same tokens. slime wants one row per token but
the last (``len(tokens) - 1``); a sample whose rows are not all covered has none.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

INT32 = 4


def segments(turn: Mapping[str, Any]) -> list[tuple[int, int, bytes]]:
    """A turn's segments as (start, rows, int32 bytes); malformed ones are skipped."""
    found = []
    for segment in turn.get("routed_experts") or ():
        if not isinstance(segment, Mapping):
            continue
        start, rows, data = segment.get("start"), segment.get("rows"), segment.get("data")
        if (
            type(start) is not int
            or type(rows) is not int
            or start < 0
            or rows <= 0
            or not isinstance(data, str)
        ):
            continue
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            continue
        found.append((start, rows, raw))
    return found


def layout(parts: Sequence[tuple[int, int, bytes]], rows: int) -> bytes | None:
    """The sample's experts as int32 bytes of ``rows`` rows, or None when a row is missing or the
    segments disagree on the row's width."""
    if not parts or rows <= 0:
        return None
    width = len(parts[0][2]) // parts[0][1]
    if width <= 0 or width % INT32:
        return None
    table = bytearray(rows * width)
    covered = bytearray(rows)
    for start, count, raw in parts:
        if len(raw) != count * width:
            return None
        count = min(count, rows - start)
        if count <= 0:
            continue
        table[start * width : (start + count) * width] = raw[: count * width]
        covered[start : start + count] = b"\x01" * count
    return bytes(table) if all(covered) else None
