"""The JSON body of an agent's call through the gateway, whatever its dialect: an object, and
one the journal can keep (checked before the engine is asked: the call is journaled with it, and
a value the journal cannot keep, nested past its depth, would fail after the engine answered).

orjson's parse already refuses ``NaN``, ``Infinity``, numbers beyond a double and lone
surrogates; what it takes and the journal does not keep as it is are integers past 64 bits
signed (it reads up to 2**64 - 1) and nesting deeper than ``storable.MAX_DEPTH`` (it reads 1,024
levels). ``_suspect`` looks for those two alone, walking the containers and never a string (a
32 KB conversation: some 5 us, where ``storable.problem_at`` took 60); only a body it suspects
is walked again by ``problem_at``, to name the field.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from buffer import storable
from buffer.encoding import INT64_MAX, INT64_MIN
from buffer.errors import InvalidInput


async def read_call(request: Request) -> tuple[bytes, dict[str, Any]]:
    """The body as sent, and as parsed."""
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput.one("body", f"is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    if _suspect(body):
        found = storable.problem_at(body)
        if found is not None:
            raise InvalidInput.one(storable.field_name(found[0]), found[1])
    return raw, body


def _suspect(body: dict[str, Any]) -> bool:
    """Whether ``body`` (as orjson parsed it) may hold an integer past 64 bits signed or nest
    deeper than ``storable.MAX_DEPTH``."""
    stack: list[tuple[Any, int]] = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if depth >= storable.MAX_DEPTH:
            return True
        for child in value.values() if type(value) is dict else value:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is int and not INT64_MIN <= child <= INT64_MAX:
                return True
    return False
