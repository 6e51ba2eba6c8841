"""Which recorded call continues which: a session's calls form a tree.

An agent's next request normally holds its previous request's messages, then the reply it got,
then what came after (tool results, a user turn). That earlier call is the new one's parent. An
agent that retries a request, or explores two continuations of one reply, makes siblings; one
that starts over makes a new root. Messages are compared by what the engine renders: the role,
the content (``None`` and ``""`` alike), and each tool call's name and arguments (agents and
SDKs re-number tool call ids, add ``refusal: null`` and the like).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from buffer.gateway.sessions import Call


def message_key(message: dict[str, Any]) -> bytes:
    content = message.get("content")
    if content is None:
        content = ""
    calls = [
        (
            (call.get("function") or {}).get("name"),
            (call.get("function") or {}).get("arguments"),
        )
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict)
    ]
    return orjson.dumps([message.get("role"), content, calls], option=orjson.OPT_SORT_KEYS)


def parent_of(calls: Sequence[Call], messages: Sequence[dict[str, Any]]) -> int | None:
    """The earlier call whose messages and reply begin ``messages``: the longest such (the
    latest among equals), or ``None`` for a new root."""
    keys: list[bytes] | None = None
    best: int | None = None
    best_length = -1
    for index in range(len(calls) - 1, -1, -1):
        call = calls[index]
        length = len(call.messages) + 1
        if length > len(messages) or length <= best_length:
            continue
        if keys is None:
            keys = [message_key(message) for message in messages]
        if message_key(call.reply) != keys[len(call.messages)]:
            continue
        if all(message_key(m) == keys[i] for i, m in enumerate(call.messages)):
            best, best_length = index, length
    return best


def path_to(calls: Sequence[Call], end: int) -> list[int]:
    """The calls from the root to ``end``, in order."""
    path = [end]
    while (parent := calls[path[-1]].parent) is not None:
        path.append(parent)
    path.reverse()
    return path
