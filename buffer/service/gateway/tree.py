"""Which recorded call continues which: a session's calls form a tree.

An agent's next request normally holds its previous request's messages, then the reply it got,
then what came after (tool results, a user turn). That earlier call is the new one's parent. An
agent that retries a request, or explores two continuations of one reply, makes siblings; one
that starts over makes a new root. Messages are compared by what the engine renders: the role,
the content (``None`` and ``""`` alike), and each tool call's name and arguments (agents and
SDKs re-number tool call ids, add ``refusal: null`` and the like).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence, Set
from typing import Any

import orjson

from buffer.service.gateway.calls import Call


def message_key(message: dict[str, Any]) -> tuple[Any, Any, tuple[Any, ...]]:
    """What of a message the engine renders, hashable: its role, its content (``None`` as ``""``;
    parts and any other value as their JSON, keys sorted) and each tool call's name and arguments."""
    content = message.get("content")
    if content is None:
        content = ""
    elif not isinstance(content, str):
        content = _json(content)
    tool_calls = message.get("tool_calls")
    calls: tuple[Any, ...] = ()
    if tool_calls:
        calls = tuple(
            (
                _plain((call.get("function") or {}).get("name")),
                _plain((call.get("function") or {}).get("arguments")),
            )
            for call in tool_calls
            if isinstance(call, dict)
        )
    return _plain(message.get("role")), content, calls


def _plain(value: Any) -> Any:
    """``value`` when it hashes as itself (a string, a number, None), else its JSON."""
    return value if value is None or isinstance(value, str | int | float) else _json(value)


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def prefix_digests(messages: Sequence[dict[str, Any]], start: int = 0) -> list[int]:
    """A digest of each prefix of ``messages`` (``[i]``: of the first ``i + 1``), chained from
    ``start`` (the digest of what comes before them), so a call's parent is found by lookups,
    not by comparing it with every earlier call.

    The digests are the process's own hashes (keyed per process: nothing outside it can aim at
    a collision), 64 bits, kept in memory only and made again when the sessions are replayed: a
    message costs its key and one hash of it, where a JSON encoding and a cryptographic digest of
    each cost some 2 us (and a 32 KB context some 50 us a call)."""
    digests: list[int] = []
    previous = start
    for message in messages:
        previous = hash((previous, message_key(message)))
        digests.append(previous)
    return digests


def continued(call: Call, parent_digest: int) -> int:
    """The digest of a call's whole messages and its reply (what a call continuing it starts
    with), from ``parent_digest``, its parent's (``0`` for a root)."""
    return prefix_digests([*call.messages, call.reply], parent_digest)[-1]


def parent_of(index: dict[int, int], messages: Sequence[dict[str, Any]]) -> tuple[int | None, int]:
    """The earlier call whose messages and reply begin ``messages`` (the longest such, the
    latest among equals) and how many messages that is; ``(None, 0)`` for a new root.
    ``index`` maps the ``continued`` digest of each earlier call to it (the latest wins)."""
    digests = prefix_digests(messages)
    for length in range(len(digests), 0, -1):
        found = index.get(digests[length - 1])
        if found is not None:
            return found, length
    return None, 0


def whole_messages(calls: Sequence[Call], index: int) -> list[dict[str, Any]]:
    """A call's messages in full: each call keeps only those after its parent's messages and
    reply (the parent's reply stands for the agent's copy of it, equal as the engine renders)."""
    chain = path_to(calls, index)
    messages: list[dict[str, Any]] = []
    for position, step in enumerate(chain):
        if position:
            messages.append(calls[chain[position - 1]].reply)
        messages.extend(calls[step].messages)
    return messages


def path_to(calls: Sequence[Call], end: int) -> list[int]:
    """The calls from the root to ``end``, in order."""
    path = [end]
    while (parent := calls[path[-1]].parent) is not None:
        path.append(parent)
    path.reverse()
    return path


def chains(calls: Sequence[Call], end: int) -> list[list[int]]:
    """The conversations a session holds, each a path from a root: first the one through
    ``end`` (the main chain), then one for each other leaf, in the order they were made.

    A leaf is a call no later call continues. One that a later call of another request repeats
    (the same parent, the same messages: a retry the agent made, its answer abandoned) is no
    conversation of its own; the choices of one request (``n > 1``) are each one."""
    continued_by = {call.parent for call in calls if call.parent is not None}
    latest: dict[tuple[int | None, bytes], int] = {}
    for index, call in enumerate(calls):
        latest[_prompt_key(call)] = index
    leaves = []
    for index, call in enumerate(calls):
        if index == end or index in continued_by:
            continue
        key = _prompt_key(call)
        for other in (latest[key], end):
            if other != index and key == _prompt_key(calls[other]) and not _one_request(calls, index, other):
                break  # retried by a later request, or by the one that ended the session
        else:
            leaves.append(index)
    return [path_to(calls, end), *(path_to(calls, leaf) for leaf in leaves)]


def _one_request(calls: Sequence[Call], first: int, second: int) -> bool:
    """Whether two calls are choices of one request (recorded one after another)."""
    return first - calls[first].choice == second - calls[second].choice


def _prompt_key(call: Call) -> tuple[int | None, Any]:
    if call.completion is not None and call.tokens is not None:  # a legacy completion: its ids
        return call.parent, b"ids" + array("I", call.tokens["prompt_ids"]).tobytes()
    return call.parent, tuple(message_key(message) for message in call.messages)


# -- legacy completions: chained by ids ----------------------------------------------------


def ids_key(ids: Sequence[int] | memoryview) -> bytes:
    """The digest a call's ids (its prompt and output) are looked up by."""
    data = ids if isinstance(ids, memoryview) else array("I", ids).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def text_key(text: bytes | memoryview) -> bytes:
    return hashlib.blake2b(text, digest_size=16).digest()


def continued_by_ids(ends: Mapping[bytes, int], lengths: Set[int], prompt_ids: Sequence[int]) -> int | None:
    """The recorded call whose prompt and output ids begin ``prompt_ids`` (the longest), or None."""
    packed = memoryview(array("I", prompt_ids).tobytes())
    for length in sorted((n for n in lengths if n <= len(prompt_ids)), reverse=True):
        found = ends.get(ids_key(packed[: 4 * length]))
        if found is not None:
            return found
    return None


def continued_by_text(ends: Mapping[bytes, int], lengths: Set[int], prompt: str) -> tuple[int, str] | None:
    """Token mode: the recorded call whose text (prompt and output as its ids decode) begins
    ``prompt`` (the longest), and the rest of ``prompt``; None."""
    data = prompt.encode()
    view = memoryview(data)
    for length in sorted((n for n in lengths if n <= len(data)), reverse=True):
        found = ends.get(text_key(view[:length]))
        if found is not None:
            try:
                return found, data[length:].decode()
            except UnicodeDecodeError:  # the earlier text ends inside a character: no match
                continue
    return None
