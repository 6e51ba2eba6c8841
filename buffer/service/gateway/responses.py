"""OpenAI's Responses API (``POST /v1/responses``) as the chat completion the gateway records.

- ``to_chat(body, previous)``: the request as a chat-completions body, and the conversation it
  continues without its instructions (what ``ResponseStore`` keeps). ``instructions`` is the
  system message (not carried over from a previous response, as OpenAI's is not); ``input`` is a
  string (one user message) or items: messages (``input_text``, ``input_image``, ``output_text``
  parts; ``developer`` as ``system``), ``reasoning`` (its ``reasoning_text`` as the next
  assistant message's ``reasoning_content``), ``function_call`` (a tool call of that assistant
  message, its arguments text as sent) and ``function_call_output`` (a ``tool`` message). The
  previous response's conversation and reply (the engine's own message) come first.
  ``tools`` (function tools), ``tool_choice``, ``max_output_tokens``, ``temperature``,
  ``top_p``, ``parallel_tool_calls``, ``reasoning.effort``, ``text.format`` and ``user`` map to
  their chat fields.
- ``from_chat(answer, body, response_id, created_at)``: the answer as a ``response`` object:
  ``reasoning``, ``message`` (``output_text``) and ``function_call`` items, ``usage``, and
  ``status`` ``incomplete`` (``max_output_tokens``) where the engine stopped at its limit.
- ``stream_events(response)``: that response as the Responses stream (``response.created``,
  each item's added, deltas and done, ``response.completed``), from the whole answer.
- ``ResponseStore``: the responses kept for ``previous_response_id``, per session, bounded.

Built-in tools (web search, file search, computer use), ``item_reference`` items, ``conversation``
and ``background`` are refused with a 422 naming the field.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from buffer.errors import InvalidInput
from buffer.service.gateway.translation import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TOOLS,
    field_name,
    optional_count,
    optional_number,
    reasoning_of,
    require_list,
    require_object,
    require_str,
    sse,
)

#: Responses kept for ``previous_response_id`` in one service (the oldest dropped first).
MAX_STORED_RESPONSES = 4096


@dataclass(frozen=True, slots=True)
class Stored:
    """A response as a later one continues it: the conversation it answered (without
    instructions) and the engine's reply."""

    session_id: str
    messages: list[dict[str, Any]]
    reply: dict[str, Any]


class ResponseStore:
    """The responses of open sessions by id, at most ``limit``, least recently used dropped
    first. A response is found only by the session that made it."""

    def __init__(self, limit: int = MAX_STORED_RESPONSES) -> None:
        self.limit = limit
        self._stored: OrderedDict[str, Stored] = OrderedDict()

    def get(self, session_id: str, response_id: str) -> Stored | None:
        stored = self._stored.get(response_id)
        if stored is None or stored.session_id != session_id:
            return None
        self._stored.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        self._stored[response_id] = stored
        self._stored.move_to_end(response_id)
        while len(self._stored) > self.limit:
            self._stored.popitem(last=False)

    def __len__(self) -> int:
        return len(self._stored)


def to_chat(
    body: Mapping[str, Any], previous: Stored | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat-completions body of a Responses request, and its conversation without the
    instructions (kept for a later ``previous_response_id``); ``InvalidInput`` naming a field."""
    for key in ("conversation", "background"):
        if body.get(key):
            raise InvalidInput.one(
                key, "is not supported by the gateway: send the input (or previous_response_id)"
            )
    chat: dict[str, Any] = {"model": require_str(body.get("model"), "model", allow_empty=False)}
    conversation = [] if previous is None else [*previous.messages, previous.reply]
    conversation += _input(body.get("input"))
    if not conversation:
        raise InvalidInput.one("input", "must not be empty")
    if len(conversation) > MAX_MESSAGES:
        raise InvalidInput.one(
            "input", f"makes {len(conversation)} messages; at most {MAX_MESSAGES} are accepted"
        )
    instructions = body.get("instructions")
    system = []
    if instructions is not None and instructions != "":
        system = [{"role": "system", "content": require_str(instructions, "instructions")}]
    chat["messages"] = [*system, *conversation]
    max_tokens = optional_count(body, "max_output_tokens")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    for key in ("temperature", "top_p"):
        value = optional_number(body, key)
        if value is not None:
            chat[key] = value
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise InvalidInput.one("parallel_tool_calls", "must be a boolean")
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    tools = body.get("tools")
    if tools is not None:
        translated = [
            _tool(tool, index) for index, tool in enumerate(require_list(tools, "tools", MAX_TOOLS))
        ]
        if translated:
            chat["tools"] = translated
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if reasoning is not None and require_object(reasoning, "reasoning").get("effort") is not None:
        chat["reasoning_effort"] = require_str(reasoning["effort"], "reasoning.effort")
    text = body.get("text")
    if text is not None:
        response_format = _format(require_object(text, "text").get("format"))
        if response_format is not None:
            chat["response_format"] = response_format
    if body.get("user") is not None:
        chat["user"] = require_str(body["user"], "user")
    return chat, conversation


def _input(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    items = require_list(value, "input", MAX_MESSAGES)
    messages: list[dict[str, Any]] = []
    open_reply: dict[str, Any] | None = None  # the assistant message items are joining

    def reply() -> dict[str, Any]:
        nonlocal open_reply
        if open_reply is None:
            open_reply = {"role": "assistant", "content": None}
            messages.append(open_reply)
        return open_reply

    for index, item in enumerate(items):
        item = require_object(item, field_name("input", index))
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                target = reply()
                if target.get("tool_calls"):  # text after a tool call: a new assistant message
                    open_reply = None
                    target = reply()
                text = _assistant_text(item.get("content"), ("input", index, "content"))
                target["content"] = text if target["content"] is None else target["content"] + text
                continue
            if role not in ("user", "system", "developer"):
                raise InvalidInput.one(
                    field_name("input", index, "role"), "must be 'user', 'assistant', 'system' or 'developer'"
                )
            open_reply = None
            content = _content(item.get("content"), ("input", index, "content"))
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "reasoning":
            if open_reply is not None and (open_reply["content"] is not None or open_reply.get("tool_calls")):
                open_reply = None  # reasoning begins the next reply
            text = _reasoning_text(item, ("input", index))
            target = reply()
            if text:
                target["reasoning_content"] = target.get("reasoning_content", "") + text
        elif kind == "function_call":
            where = ("input", index)
            call_id = require_str(item.get("call_id"), field_name(*where, "call_id"), allow_empty=False)
            name = require_str(item.get("name"), field_name(*where, "name"), allow_empty=False)
            arguments = require_str(item.get("arguments"), field_name(*where, "arguments"))
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            reply().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            open_reply = None
            where = ("input", index)
            call_id = require_str(item.get("call_id"), field_name(*where, "call_id"), allow_empty=False)
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, (*where, "output"))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise InvalidInput.one(
                field_name("input", index, "type"),
                f"{kind!r} is not translated: message, reasoning, function_call and "
                "function_call_output items are",
            )
    return messages


def _content(content: Any, path: tuple[str | int, ...]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(require_list(content, field_name(*path), MAX_PARTS)):
        where = (*path, index)
        part = require_object(part, field_name(*where))
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": require_str(part.get("text"), field_name(*where, "text"))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise InvalidInput.one(
                    field_name(*where, "image_url"), "must be a URL or a data URL (file ids are not kept)"
                )
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise InvalidInput.one(
                field_name(*where, "type"), f"{kind!r} is not translated: input_text and input_image are"
            )
    return parts


def _assistant_text(content: Any, path: tuple[str | int, ...]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(require_list(content, field_name(*path), MAX_PARTS)):
        part = require_object(part, field_name(*path, index))
        if part.get("type") not in ("output_text", "refusal", "input_text", "text"):
            raise InvalidInput.one(field_name(*path, index, "type"), "must be 'output_text' or 'refusal'")
        key = "refusal" if part.get("type") == "refusal" else "text"
        texts.append(require_str(part.get(key), field_name(*path, index, key)))
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], path: tuple[str | int, ...]) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts (a summary is not what was sampled)."""
    content = item.get("content")
    if content is None:
        return ""
    texts = []
    for index, part in enumerate(require_list(content, field_name(*path, "content"), MAX_PARTS)):
        part = require_object(part, field_name(*path, "content", index))
        texts.append(require_str(part.get("text"), field_name(*path, "content", index, "text")))
    return "".join(texts)


def _tool(tool: Any, index: int) -> dict[str, Any]:
    tool = require_object(tool, field_name("tools", index))
    if tool.get("type") != "function":
        raise InvalidInput.one(
            field_name("tools", index, "type"), f"{tool.get('type')!r}: only function tools are translated"
        )
    function: dict[str, Any] = {
        "name": require_str(tool.get("name"), field_name("tools", index, "name"), allow_empty=False)
    }
    if tool.get("description") is not None:
        function["description"] = require_str(tool["description"], field_name("tools", index, "description"))
    if tool.get("parameters") is not None:
        function["parameters"] = require_object(tool["parameters"], field_name("tools", index, "parameters"))
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    choice = require_object(choice, "tool_choice")
    if choice.get("type") == "function":
        name = require_str(choice.get("name"), "tool_choice.name", allow_empty=False)
        return {"type": "function", "function": {"name": name}}
    raise InvalidInput.one("tool_choice", "must be 'auto', 'none', 'required' or a function")


def _format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    value = require_object(value, "text.format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: value[key] for key in ("name", "schema", "strict", "description") if key in value}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidInput.one("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


# -- the answer ----------------------------------------------------------------------------


def from_chat(
    answer: Mapping[str, Any], body: Mapping[str, Any], response_id: str, created_at: float
) -> dict[str, Any]:
    """The engine's chat answer (its first choice) as a ``response`` object."""
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    incomplete = choice.get("finish_reason") == "length"
    status = "incomplete" if incomplete else "completed"
    suffix = response_id.removeprefix("resp_")
    output: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{suffix}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": status,
            }
        )
    if isinstance(message.get("content"), str) and message["content"]:
        text = {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}
        output.append(
            {
                "type": "message",
                "id": f"msg_{suffix}",
                "role": "assistant",
                "status": status,
                "content": [text],
            }
        )
    for position, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{suffix}_{position}",
                "call_id": call.get("id") or f"call_{suffix}_{position}",
                "name": function.get("name") or "",
                "arguments": function.get("arguments") or "",
                "status": "completed",
            }
        )
    usage = answer.get("usage") or {}
    input_tokens = int(usage.get("prompt_tokens") or 0)
    output_tokens = int(usage.get("completion_tokens") or 0)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": answer.get("model") or body.get("model", ""),
        "instructions": body.get("instructions"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True) is not False,
        "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def reply_of(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's assistant message of an answer, as a later request continues it."""
    choice = (answer.get("choices") or [{}])[0]
    message = dict(choice.get("message") or {})
    message["role"] = "assistant"
    return message


def stream_events(response: Mapping[str, Any]) -> Iterator[bytes]:
    """A whole ``response`` as the Responses stream, each event numbered."""
    number = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        data = {"type": kind, "sequence_number": number, **fields}
        number += 1
        return sse(kind, data)

    running = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=running)
    yield event("response.in_progress", response=running)
    for index, item in enumerate(response["output"]):
        kind = item["type"]
        if kind == "message":
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            for part_index, part in enumerate(item["content"]):
                place = {"item_id": item["id"], "output_index": index, "content_index": part_index}
                yield event("response.content_part.added", **place, part={**part, "text": ""})
                yield event("response.output_text.delta", **place, delta=part["text"], logprobs=[])
                yield event("response.output_text.done", **place, text=part["text"], logprobs=[])
                yield event("response.content_part.done", **place, part=part)
        elif kind == "function_call":
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            place = {"item_id": item["id"], "output_index": index}
            yield event("response.function_call_arguments.delta", **place, delta=item["arguments"])
            yield event(
                "response.function_call_arguments.done",
                **place,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:  # reasoning
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            for part_index, part in enumerate(item["content"]):
                place = {"item_id": item["id"], "output_index": index, "content_index": part_index}
                yield event("response.reasoning_text.delta", **place, delta=part["text"])
                yield event("response.reasoning_text.done", **place, text=part["text"])
        yield event("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(final, response=response)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
