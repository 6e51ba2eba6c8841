"""The write routes' reading of a trajectory: its token lists kept as the bytes the client sent.

A trajectory's size is its token records: per turn, thousands of prompt and output ids and a logprob
for each output id. Parsed into Python ints and floats, checked, then encoded again for the store,
they cost about a microsecond for every eight tokens. Here msgspec parses the body once, leaving
``prompt_ids``, ``output_ids`` and ``output_logprobs`` (and ``routed_experts``) undecoded: each is
checked on its bytes (``_ids``, ``_numbers``), a pass or two in C over the array's text with no
Python object per token, and kept as ``orjson.Fragment``, which the store's encoding copies as it is.
So the ids and logprobs are stored, finished and read as the client wrote them, and are decoded only
where a generator's own hooks ask for whole items. Every other field is decoded and checked as
``buffer.service.models.is_trajectory`` checks it.

Whatever these checks are not sure of (a top-level key the schema does not name, an id of ten digits
or more, a logprob with a positive exponent, anything msgspec refuses) goes the way it went before
(``buffer.service.models.read_trajectory``): decoded whole, and refused by the schema naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
from msgspec import UNSET, Raw, UnsetType

from buffer.service import models

#: The turn fields kept as bytes: token ids (``_ids``), logprobs (``_numbers``), and the routed experts
#: of a mixture-of-experts model (``_integers``: kept as they are, an extra field the service never reads).
IDS = frozenset(("prompt_ids", "output_ids"))
LOGPROBS = "output_logprobs"
INTEGERS = frozenset(("routed_experts",))

_DIGITS = b"0123456789"
_WHITESPACE = b" \t\n\r"
_TO_ZEROS = bytes.maketrans(b"123456789", b"000000000")
#: Ten digits: the shortest an id of 2**31 or more can be (JSON has no leading zeros).
_TEN_DIGITS = b"0" * 10
#: A float of 309 integer digits or more, written without an exponent, is beyond a double.
_HUGE_MANTISSA = b"0" * 309
#: 64-bit integers have at most 19 digits.
_INT64_DIGITS = b"0" * 19


class _Trajectory(msgspec.Struct, forbid_unknown_fields=True):
    """The top level as the schema (``models.Trajectory``) names it; another key: not this way."""

    instance_id: Raw = Raw()
    uid: Raw = Raw()
    messages: Raw = Raw()
    reward: Raw = Raw()
    extra_info: Raw = Raw()
    task_type: Raw = Raw()
    tools: Raw = Raw()
    turns: list[dict[str, Raw]] | UnsetType | None = UNSET


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    trajectories: list[_Trajectory]


_ONE = msgspec.json.Decoder(_Trajectory)
_LIST = msgspec.json.Decoder(list[_Trajectory])
_BATCH = msgspec.json.Decoder(_Batch)
_SMALL = ("instance_id", "uid", "messages", "reward", "extra_info", "task_type", "tools")


def read_trajectory(body: bytes) -> dict[str, Any]:
    """One trajectory from a request body, checked as the schema checks it (``InvalidInput`` naming
    the field where it refuses it), its token lists as the client's bytes."""
    try:
        item = _item(_ONE.decode(body))
    except msgspec.DecodeError:
        item = None
    return models.read_trajectory(body) if item is None else item


def read_trajectories(body: bytes, batch: bool) -> list[dict[str, Any]]:
    """The trajectories of a batch body: ``{"trajectories": [...]}`` (``batch``) or a list."""
    try:
        parsed = _BATCH.decode(body).trajectories if batch else _LIST.decode(body)
    except msgspec.DecodeError:
        return models.read_trajectories(body, batch)
    items = []
    for one in parsed:
        item = _item(one)
        if item is None:
            return models.read_trajectories(body, batch)
        items.append(item)
    return items


def _item(parsed: _Trajectory) -> dict[str, Any] | None:
    """The trajectory as the buffer keeps it, or None where the quick checks are not sure of it."""
    try:
        item = {name: orjson.loads(memoryview(raw)) for name in _SMALL if len(raw := getattr(parsed, name))}
    except orjson.JSONDecodeError:  # what msgspec takes and orjson does not (a lone surrogate)
        return None
    if not models.is_trajectory(item):  # without its turns, which follow
        return None
    turns = parsed.turns
    if turns is UNSET:
        return item
    if turns is None:
        item["turns"] = None
        return item
    kept: list[dict[str, Any]] = []
    counted: list[Any] = []  # turns with a range for each token list: what turn_errors reads
    for raw_turn in turns:
        pair = _turn(raw_turn)
        if pair is None:
            return None
        kept.append(pair[0])
        counted.append(pair[1])
    if models.turn_errors(item["messages"], counted, ids_checked=True):
        return None
    item["turns"] = kept
    return item


def _turn(raw_turn: dict[str, Raw]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A turn with its token lists as ``orjson.Fragment``s, and the same turn with each list a
    ``range`` of its length, for the checks that need only lengths (``models.turn_errors``)."""
    turn: dict[str, Any] = {}
    counted: dict[str, Any] = {}
    for key, raw in raw_turn.items():
        if key in IDS or key == LOGPROBS:
            data = bytes(raw)  # out of the request body, which is not kept
            if key == LOGPROBS and data == b"null":
                turn[key] = counted[key] = None
                continue
            count = _ids(data) if key in IDS else _numbers(data)
            if count is None:
                return None
            turn[key], counted[key] = orjson.Fragment(data), range(count)
        elif key in INTEGERS and _integers(data := bytes(raw)):
            turn[key] = counted[key] = orjson.Fragment(data)
        else:  # decoded, and checked as any other field
            try:
                turn[key] = counted[key] = orjson.loads(memoryview(raw))
            except orjson.JSONDecodeError:
                return None
    if not (counted.keys() >= IDS and models.turn_fields_ok(counted)):
        return None
    return turn, counted


def _ids(data: bytes) -> int | None:
    """How many ids the JSON array ``data`` holds, if each is an integer in [0, 2**31).

    msgspec has checked that ``data`` is JSON: an array whose text is digits, commas and spaces holds
    non-negative integers (a sign, a dot, a quote, a letter or a bracket would be something else)."""
    if data[:1] != b"[":
        return None
    marks = data.translate(None, _DIGITS)
    count = _commas(marks, len(marks) < len(data))
    if count and data.translate(_TO_ZEROS).find(_TEN_DIGITS) >= 0:  # an id of ten digits or more
        return count if all(value < models.TOKEN_ID_LIMIT for value in orjson.loads(data)) else None
    return count


def _numbers(data: bytes) -> int | None:
    """How many numbers the JSON array ``data`` holds, if each is a finite one (a logprob).

    Beyond a double (which JSON's text can write, and a reader would take as infinity) are only a
    number with a positive exponent or one of 309 digits or more: neither is taken here."""
    if data[:1] != b"[":
        return None
    marks = data.translate(None, b"0123456789.")
    any_value = len(marks) < len(data)
    if b"e" in marks or b"E" in marks:
        marks = marks.replace(b"e-", b"").replace(b"E-", b"")  # negative exponents: small numbers
        if b"e" in marks or b"E" in marks:
            return None
    if len(data) - len(marks) >= len(_HUGE_MANTISSA) and data.translate(_TO_ZEROS).find(_HUGE_MANTISSA) >= 0:
        return None
    return _commas(marks.translate(None, b"-"), any_value)


def _integers(data: bytes) -> bool:
    """Whether the JSON value ``data`` is (nested) arrays of 64-bit integers."""
    if data[:1] != b"[" or data.translate(None, b"0123456789,[]- \t\n\r"):
        return False
    return data.translate(_TO_ZEROS).find(_INT64_DIGITS) < 0


def _commas(marks: bytes, any_value: bool) -> int | None:
    """The number of values of a flat array whose text, values deleted, is ``marks``: ``[``, commas
    and whitespace, ``]`` (anything else: not such an array)."""
    inner = marks[1:-1]
    commas = inner.count(b",")
    if commas != len(inner) or marks[-1:] != b"]":
        inner = inner.translate(None, _WHITESPACE)
        commas = inner.count(b",")
        if commas != len(inner) or marks[-1:] != b"]":
            return None
    return commas + 1 if any_value else 0
