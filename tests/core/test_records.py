"""The record format (``buffer.core.records``): what every store keeps, read back as written."""

from __future__ import annotations

import math

import pytest

from buffer.core.records import NOTHING, decode, encode, export_rows, split
from buffer.core.task import ReadyGroup
from buffer.errors import InvalidInput


def test_a_record_reads_back_as_its_header_and_its_parts() -> None:
    parts = [b'{"uid":"a"}', b"", b'{"uid":"b","text":"x\\ny"}']
    record = encode({"e": "ready", "t": "math", "seq": 3}, parts)
    event = decode(record)
    assert event.header == {"e": "ready", "t": "math", "seq": 3, "n": [11, 0, 25]}
    assert event.parts() == parts
    header, payload = split(record)  # the two columns a table keeps
    assert (header, bytes(payload)) == (record[: record.index(b"\n")].decode(), b"".join(parts))


def test_one_part_or_none_needs_no_lengths() -> None:
    assert decode(encode({"e": "w"}, [b'{"a":1}'])).parts() == [b'{"a":1}']
    assert decode(encode({"e": "dup"})).parts() == []
    assert decode(NOTHING).header == {"e": "nop"}


def test_a_header_that_would_not_read_back_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidInput, match=r"s\.group_timeout_s: must be a finite number"):
        encode({"e": "task", "s": {"group_timeout_s": math.inf, "reward_key": None}})
    assert decode(encode({"e": "task", "s": {"reward_key": None}})).header["s"] == {"reward_key": None}


def test_the_export_rows_of_a_read_are_its_trajectories_as_delivered() -> None:
    groups = [ReadyGroup(0, "math", "q1", [b"a", b"b"]), ReadyGroup(1, "code", 7, [b"c"])]
    assert export_rows(groups, 12.5, 3) == [
        (3, 12.5, "math", "q1", b"a"),
        (3, 12.5, "math", "q1", b"b"),
        (3, 12.5, "code", 7, b"c"),
    ]
