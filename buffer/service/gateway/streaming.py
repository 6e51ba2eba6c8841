"""A whole answer sent as OpenAI's stream (chat completions and legacy completions alike): the
fields every chunk carries, one chunk's ``data:`` frame, and the end of the stream (the usage
when ``stream_options.include_usage`` asked for it, then ``[DONE]``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def chunk_base(
    answer: Mapping[str, Any], body: Mapping[str, Any], kind: str, default_id: str
) -> dict[str, Any]:
    """The fields of every chunk of ``answer``'s stream: its id, ``object`` (``kind``), created, model."""
    return {
        "id": answer.get("id", default_id),
        "object": kind,
        "created": answer.get("created", 0),
        "model": answer.get("model", body.get("model", "")),
    }


def chunk(base: Mapping[str, Any], choice: Mapping[str, Any]) -> bytes:
    """One chunk of one choice, framed as a server-sent event."""
    return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"


def stream_end(
    base: Mapping[str, Any], answer: Mapping[str, Any], body: Mapping[str, Any]
) -> Iterator[bytes]:
    """The usage chunk (where the agent asked for it and the answer has one), then ``[DONE]``."""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and answer.get("usage") is not None:
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": answer["usage"]}) + b"\n\n"
    yield DONE
