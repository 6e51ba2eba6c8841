"""What the gateway's dialect translators share (``anthropic``, ``responses``): reading a
request's fields with a 422 that names each one, a tool call's arguments as an object and back
exactly as the engine wrote them, and the framing of a server-sent event.

A dialect is translated at the route edge: its request becomes the chat-completions body the
gateway records (``Gateway.complete``), and the chat answer becomes the dialect's answer. Tool
arguments are the one thing a round trip could change: a dialect that carries them as an object
(Anthropic's ``tool_use.input``) loses the engine's spelling of the JSON, and the next prompt
would render them differently from what was sampled. So an object sent back is written with the
engine's own text for that call id (``tool_arguments``), when it is the same object.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from buffer.errors import InvalidInput

#: Bounds of a translated request, each refused past its limit with a 422 naming the field.
MAX_MESSAGES = 4096
MAX_PARTS = 1024  # content blocks of one message, or parts of one tool result
MAX_TOOLS = 512
MAX_STOP = 64


def field_name(*path: str | int) -> str:
    return ".".join(str(part) for part in path)


def require_list(value: Any, field: str, max_items: int, *, allow_empty: bool = True) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidInput.one(field, "must be a list")
    if not value and not allow_empty:
        raise InvalidInput.one(field, "must not be empty")
    if len(value) > max_items:
        raise InvalidInput.one(field, f"has {len(value)} items; at most {max_items} are accepted")
    return value


def require_object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput.one(field, "must be an object")
    return value


def require_str(value: Any, field: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise InvalidInput.one(field, "must be a non-empty string" if not allow_empty else "must be a string")
    return value


def optional_number(body: Mapping[str, Any], key: str) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput.one(key, "must be a number")
    return value


def optional_count(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput.one(key, "must be a positive integer")
    return value


def tool_input(arguments: Any) -> dict[str, Any]:
    """A chat tool call's arguments (a JSON text) as the object a dialect carries: ``{}`` where
    the model wrote no JSON object (the agent's tool then says what is wrong)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def arguments_text(call_id: str | None, value: Any, recorded: Mapping[str, str]) -> str:
    """A tool call's input as chat arguments: the engine's own text for ``call_id`` where the
    agent sent back the object it was given, else the object as JSON (``json.dumps``' spacing,
    which is the engines' tool parsers')."""
    original = recorded.get(call_id) if call_id is not None else None
    if original is not None and tool_input(original) == value:
        return original
    return json.dumps(value, ensure_ascii=False)


def tool_arguments(replies: Iterable[Mapping[str, Any]], wanted: set[str]) -> dict[str, str]:
    """The arguments text of each tool call in ``wanted``, from the replies the engine gave
    (the session's recorded calls, latest first: the first found wins)."""
    found: dict[str, str] = {}
    if not wanted:
        return found
    for reply in replies:
        for call in reply.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            call_id = call.get("id")
            arguments = (call.get("function") or {}).get("arguments")
            if call_id in wanted and call_id not in found and isinstance(arguments, str):
                found[call_id] = arguments
        if len(found) == len(wanted):
            break
    return found


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """The reasoning of an engine's message: ``reasoning_content`` (SGLang, older vLLM) or
    ``reasoning`` (newer vLLM)."""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return reasoning if isinstance(reasoning, str) and reasoning else None


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event with a name, as both Anthropic and the Responses API send them."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
