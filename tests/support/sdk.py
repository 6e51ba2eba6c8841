"""What OpenAI-SDK agents do by hand in the tests: put a streamed reply back together."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def streamed_message(chunks: Iterable[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The assistant message a stream of ``ChatCompletionChunk``s makes, as an agent appends it to
    its conversation, and its tool calls (``[]`` for none)."""
    content, calls = "", {}
    for chunk in chunks:
        if not chunk.choices:  # a usage chunk
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    tool_calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message, tool_calls
