"""Anthropic's Messages API (``POST /v1/messages``) as the chat completion the gateway records.

- ``to_chat(body, recorded)``: the request as a chat-completions body. ``system`` (a string or
  text blocks) is the system message; a user message's ``text`` and ``image`` blocks are content
  parts and each ``tool_result`` a ``tool`` message (in the order sent); an assistant message's
  ``thinking`` is ``reasoning_content``, its text the content and each ``tool_use`` a tool call
  (its input as the engine's own arguments text, ``translation.arguments_text``); ``tools``
  (``input_schema``), ``tool_choice``, ``max_tokens``, ``stop_sequences``, ``temperature``,
  ``top_p``, ``top_k``, ``metadata.user_id`` and ``thinking`` (the template's
  ``enable_thinking``) as their chat fields.
- ``from_chat(answer, body)``: the engine's answer as a ``message``: ``thinking`` (with a
  placeholder signature: nothing here signs it), ``text`` and ``tool_use`` blocks, the stop
  reason, the usage.
- ``stream_events(message)``: that message as Anthropic's server-sent events, made from the
  whole answer as the chat stream is (``proxy.stream_chunks``).
- ``error_body(status, message)``: an error in Anthropic's shape.

A ``redacted_thinking`` block is dropped (it cannot be read back into text); a server tool, a
``document`` or a ``search_result`` block is refused with a 422 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from buffer.errors import InvalidInput
from buffer.service.gateway.translation import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_STOP,
    MAX_TOOLS,
    arguments_text,
    field_name,
    optional_count,
    optional_number,
    reasoning_of,
    require_list,
    require_object,
    require_str,
    sse,
    tool_input,
)

#: The ``signature`` of a thinking block the gateway returns: Anthropic's SDKs send it back, and
#: the gateway reads thinking from its text, never from a signature.
SIGNATURE = "rollout-buffer-gateway"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def tool_use_ids(body: Mapping[str, Any]) -> set[str]:
    """The ids of the ``tool_use`` blocks in a request's assistant messages: whose arguments
    text the route looks up among the session's recorded replies."""
    ids: set[str] = set()
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(message, dict) and message.get("role") == "assistant" and isinstance(content, list):
            ids.update(
                block["id"]
                for block in content
                if isinstance(block, dict)
                and block.get("type") == "tool_use"
                and isinstance(block.get("id"), str)
            )
    return ids


def to_chat(body: Mapping[str, Any], recorded: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The chat-completions body of a Messages request; ``InvalidInput`` naming a wrong field.
    ``recorded`` maps a tool call id to the arguments text the engine wrote for it."""
    recorded = recorded or {}
    chat: dict[str, Any] = {"model": require_str(body.get("model"), "model", allow_empty=False)}
    max_tokens = optional_count(body, "max_tokens")
    if max_tokens is None:
        raise InvalidInput.one("max_tokens", "is required: a positive integer")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system(system)})
    for index, message in enumerate(
        require_list(body.get("messages"), "messages", MAX_MESSAGES, allow_empty=False)
    ):
        messages.extend(_message(message, ("messages", index), recorded))
    chat["messages"] = messages
    chat["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "top_k"):
        value = optional_number(body, key)
        if value is not None:
            chat[key] = value
    stop = body.get("stop_sequences")
    if stop is not None:
        stops = require_list(stop, "stop_sequences", MAX_STOP)
        for index, text in enumerate(stops):
            require_str(text, field_name("stop_sequences", index), allow_empty=False)
        if stops:
            chat["stop"] = stops
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = [
            _tool(tool, index) for index, tool in enumerate(require_list(tools, "tools", MAX_TOOLS))
        ]
        if not chat["tools"]:
            del chat["tools"]
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(require_object(body["tool_choice"], "tool_choice")))
    metadata = body.get("metadata")
    if metadata is not None:
        user = require_object(metadata, "metadata").get("user_id")
        if user is not None:
            chat["user"] = require_str(user, "metadata.user_id")
    thinking = body.get("thinking")
    if thinking is not None:
        kind = require_object(thinking, "thinking").get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise InvalidInput.one("thinking.type", "must be 'enabled', 'adaptive' or 'disabled'")
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    return chat


def _system(system: Any) -> str | list[dict[str, Any]]:
    if isinstance(system, str):
        return system
    blocks = require_list(system, "system", MAX_PARTS)
    parts = []
    for index, block in enumerate(blocks):
        block = require_object(block, field_name("system", index))
        if block.get("type") != "text":
            raise InvalidInput.one(field_name("system", index, "type"), "must be 'text'")
        parts.append(
            {"type": "text", "text": require_str(block.get("text"), field_name("system", index, "text"))}
        )
    return parts


def _message(message: Any, path: tuple[str | int, ...], recorded: Mapping[str, str]) -> list[dict[str, Any]]:
    message = require_object(message, field_name(*path))
    role = message.get("role")
    content = message.get("content")
    if not isinstance(content, str):
        content = require_list(content, field_name(*path, "content"), MAX_PARTS)
    if role == "user":
        return _user(content, (*path, "content"))
    if role == "assistant":
        return [_assistant(content, (*path, "content"), recorded)]
    raise InvalidInput.one(field_name(*path, "role"), "must be 'user' or 'assistant'")


def _user(content: str | list[Any], path: tuple[str | int, ...]) -> list[dict[str, Any]]:
    """A user turn: ``tool`` messages for its tool results and a user message for the rest, in
    the order of its blocks."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        where = (*path, index)
        block = require_object(block, field_name(*where))
        if block.get("type") == "tool_result":
            if parts:
                messages.append({"role": "user", "content": parts})
                parts = []
            call_id = require_str(
                block.get("tool_use_id"), field_name(*where, "tool_use_id"), allow_empty=False
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result(block, where)})
        else:
            parts.append(_part(block, where))
    if parts or not messages:
        messages.append({"role": "user", "content": parts})
    return messages


def _tool_result(block: dict[str, Any], path: tuple[str | int, ...]) -> str | list[dict[str, Any]]:
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    blocks = require_list(content, field_name(*path, "content"), MAX_PARTS)
    return [
        _part(require_object(b, field_name(*path, "content", i)), (*path, "content", i))
        for i, b in enumerate(blocks)
    ]


def _part(block: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
    """A text or image block as a chat content part."""
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": require_str(block.get("text"), field_name(*path, "text"))}
    if kind == "image":
        source = require_object(block.get("source"), field_name(*path, "source"))
        if source.get("type") == "base64":
            media = require_str(
                source.get("media_type"), field_name(*path, "source", "media_type"), allow_empty=False
            )
            data = require_str(source.get("data"), field_name(*path, "source", "data"), allow_empty=False)
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
        if source.get("type") == "url":
            url = require_str(source.get("url"), field_name(*path, "source", "url"), allow_empty=False)
            return {"type": "image_url", "image_url": {"url": url}}
        raise InvalidInput.one(field_name(*path, "source", "type"), "must be 'base64' or 'url'")
    raise InvalidInput.one(
        field_name(*path, "type"), f"{kind!r} is not translated: text, image and tool_result blocks are"
    )


def _assistant(
    content: str | list[Any], path: tuple[str | int, ...], recorded: Mapping[str, str]
) -> dict[str, Any]:
    """An assistant turn as the engine's message: its thinking, its text, its tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        where = (*path, index)
        block = require_object(block, field_name(*where))
        kind = block.get("type")
        if kind == "text":
            texts.append(require_str(block.get("text"), field_name(*where, "text")))
        elif kind == "thinking":
            reasoning.append(require_str(block.get("thinking"), field_name(*where, "thinking")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call_id = require_str(block.get("id"), field_name(*where, "id"), allow_empty=False)
            name = require_str(block.get("name"), field_name(*where, "name"), allow_empty=False)
            arguments = arguments_text(
                call_id, require_object(block.get("input"), field_name(*where, "input")), recorded
            )
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        else:
            raise InvalidInput.one(
                field_name(*where, "type"),
                f"{kind!r} is not translated: text, thinking and tool_use blocks are",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(tool: Any, index: int) -> dict[str, Any]:
    tool = require_object(tool, field_name("tools", index))
    if tool.get("type") not in (None, "custom"):
        raise InvalidInput.one(
            field_name("tools", index, "type"),
            f"{tool.get('type')!r}: only client tools (with input_schema) are",
        )
    function: dict[str, Any] = {
        "name": require_str(tool.get("name"), field_name("tools", index, "name"), allow_empty=False)
    }
    if tool.get("description") is not None:
        function["description"] = require_str(tool["description"], field_name("tools", index, "description"))
    function["parameters"] = require_object(
        tool.get("input_schema"), field_name("tools", index, "input_schema")
    )
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    fields: dict[str, Any]
    if kind == "auto":
        fields = {"tool_choice": "auto"}
    elif kind == "any":
        fields = {"tool_choice": "required"}
    elif kind == "none":
        fields = {"tool_choice": "none"}
    elif kind == "tool":
        name = require_str(choice.get("name"), "tool_choice.name", allow_empty=False)
        fields = {"tool_choice": {"type": "function", "function": {"name": name}}}
    else:
        raise InvalidInput.one("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    if choice.get("disable_parallel_tool_use") is True:
        fields["parallel_tool_calls"] = False
    return fields


# -- the answer ----------------------------------------------------------------------------


def from_chat(answer: Mapping[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's chat answer (its first choice) as an Anthropic ``message``."""
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": SIGNATURE})
    if isinstance(message.get("content"), str) and message["content"]:
        content.append({"type": "text", "text": message["content"]})
    for position, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{answer.get('id', 'gateway')}_{position}",
                "name": function.get("name") or "",
                "input": tool_input(function.get("arguments")),
            }
        )
    stop_reason, stop_sequence = _stop(choice, body, bool(message.get("tool_calls")))
    usage = answer.get("usage") or {}
    return {
        "id": f"msg_{answer.get('id', 'gateway')}",
        "type": "message",
        "role": "assistant",
        "model": answer.get("model") or body.get("model", ""),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
        },
    }


def _stop(choice: Mapping[str, Any], body: Mapping[str, Any], called: bool) -> tuple[str, str | None]:
    """Anthropic's stop reason (and the stop sequence met) for a chat finish reason."""
    finish = choice.get("finish_reason")
    if called or finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    # vLLM says which stop string ended the answer in ``stop_reason``, SGLang in ``matched_stop``.
    matched = choice.get("stop_reason", choice.get("matched_stop"))
    stops = body.get("stop_sequences") or ()
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def stream_events(message: Mapping[str, Any]) -> Iterator[bytes]:
    """A whole ``message`` as Anthropic's stream: ``message_start``, each block's start, delta
    and stop, ``message_delta`` (stop reason, output tokens), ``message_stop``."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": 0}
    yield sse("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        empty: dict[str, Any]
        deltas: list[dict[str, Any]]
        if kind == "thinking":
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "text":
            empty = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        else:  # tool_use: its input as the JSON the SDK assembles
            empty = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [
                {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            ]
        yield sse(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": empty}
        )
        for delta in deltas:
            yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield sse(
        "message_delta",
        {"type": "message_delta", "delta": delta, "usage": {"output_tokens": usage["output_tokens"]}},
    )
    yield sse("message_stop", {"type": "message_stop"})


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
