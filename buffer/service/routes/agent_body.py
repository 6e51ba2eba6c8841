"""The JSON body of an agent's call through the gateway, whatever its dialect: an object, and
one the journal can keep (checked before the engine is asked: the call is journaled with it, and
a value the journal cannot keep, nested past its depth, would fail after the engine answered)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from buffer import storable
from buffer.errors import InvalidInput


async def read_call_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise InvalidInput.one("body", f"is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    found = storable.problem_at(body)
    if found is not None:
        raise InvalidInput.one(storable.field_name(found[0]), found[1])
    return body
