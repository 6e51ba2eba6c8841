"""The text path: where each message's text lies in the conversation the chat template renders.

A trajectory without token records is rendered whole by the chat template, and the sample trains on
that text. Which characters of it each message wrote is found structurally, never by searching the text
for headers that a message could itself contain: the messages are rendered once more with each text
field (content, reasoning, tool-call names) wrapped in sentinels, characters of Unicode's private use
area, which no template or tokenizer gives a meaning. With the sentinels taken out, that rendering must be
the conversation's own, character for character; their positions then say where each message's text
lies, and that nothing else lies there (`locate_fields`). What of each generated message the model wrote,
from there: `buffer.trainer.samples.spans`.

Before rendering, the messages are given to the template as it reads them (`prepare_messages`), and the
generated ones are picked (`generated_messages`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from buffer.trainer.samples.sample import SampleConversionError
from buffer.trainer.samples.template import (
    ChatTemplateAnalysis,
    Tools,
    render_chat,
    template_errors,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Span = tuple[int, int]

_SENTINEL_BASE = 0xF0000  # Supplementary Private Use Area-A
_SENTINEL_COUNT = 0xFFFE  # 0xF0000..0xFFFFD: 32,767 fields per conversation
_SENTINELS = re.compile("[\U000f0000-\U000ffffd]")


def generated_messages(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The indices of the assistant messages the policy generated in this trajectory.

    Those flagged ``generated: true``; if no message carries the flag (slime's own generators), the
    assistant messages after the last user message. Earlier ones (few-shot examples) are prompt.
    """
    if any("generated" in m for m in messages):
        return [
            i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("generated") is True
        ]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    return [i for i, m in enumerate(messages) if i > last_user and m.get("role") == "assistant"]


def prepare_messages(
    messages: Sequence[Mapping[str, Any]], analysis: ChatTemplateAnalysis
) -> list[dict[str, Any]]:
    """The messages as the template should get them (copies; the trajectory is left as it is).

    Tool-call arguments, a JSON string in the OpenAI format, become objects for templates that ``tojson``
    them (else they render as a quoted string the model never wrote). A reply's reasoning goes in under
    both names templates read (``reasoning_content``, gpt-oss's ``thinking``); for a template with a
    reasoning slot, reasoning written inline ("<think>...</think>" in the content) is moved there, as
    the template itself would.
    """
    prepared = []
    for index, message in enumerate(messages):
        copy = dict(message)
        if "content" in copy and copy["content"] is None:  # OpenAI's null content: no text
            copy["content"] = ""
        if copy.get("role") == "assistant":
            if copy.get("tool_calls"):
                copy["tool_calls"] = [_prepare_call(call, analysis, index) for call in copy["tool_calls"]]
            _prepare_reasoning(copy, analysis)
        prepared.append(copy)
    return prepared


def _prepare_call(call: object, analysis: ChatTemplateAnalysis, index: int) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise SampleConversionError(f"messages.{index}.tool_calls: a tool call without a function object")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if analysis.tool_arguments == "object" and isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise SampleConversionError(
                f"messages.{index}.tool_calls: arguments are not JSON ({exc}), so the template cannot "
                "render them as the model wrote them"
            ) from exc
        if not isinstance(arguments, dict):
            raise SampleConversionError(f"messages.{index}.tool_calls: arguments are not a JSON object")
    elif analysis.tool_arguments == "string" and not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    function["arguments"] = arguments
    return {**call, "function": function}


def _prepare_reasoning(message: dict[str, Any], analysis: ChatTemplateAnalysis) -> None:
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str) or not reasoning:
        reasoning = message.get("thinking")
    content = message.get("content")
    if (
        not (isinstance(reasoning, str) and reasoning)
        and analysis.reasoning is not None
        and isinstance(content, str)
        and "</think>" in content
    ):
        before, _, after = content.partition("</think>")
        reasoning = before.split("<think>")[-1].strip("\n")
        message["content"] = after.lstrip("\n")
        message["reasoning_content"] = reasoning  # even empty: the model closed its reasoning
    if isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
        message["thinking"] = reasoning


def reasoning_of(message: Mapping[str, Any]) -> str:
    value = message.get("reasoning_content")
    return value if isinstance(value, str) else ""


@dataclass(slots=True)
class Fields:
    """Where each message's text lies in the rendered conversation."""

    # message -> (kind, start, stop) of each of its fields the template wrote whole
    spans: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)
    damaged: dict[int, list[str]] = field(default_factory=dict)  # message -> kinds the template rewrote
    unwrapped: set[int] = field(default_factory=set)  # messages whose text the template reacts to

    def of(self, message: int) -> list[tuple[str, int, int]]:
        return self.spans.get(message, [])


def text_fields(message: Mapping[str, Any]) -> list[tuple[str, tuple[Any, ...]]]:
    """(kind, path) of each non-empty text field of a message; a path leads to a string."""
    found: list[tuple[str, tuple[Any, ...]]] = []
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        found.append(("content", ("content",)))
    elif isinstance(content, list):
        for k, part in enumerate(content):
            if isinstance(part, Mapping) and isinstance(part.get("text"), str) and part["text"].strip():
                found.append(("content", ("content", k, "text")))
    for key in ("reasoning_content", "thinking"):
        if isinstance(message.get(key), str) and message[key].strip():
            found.append(("reasoning", (key,)))
    for k, call in enumerate(message.get("tool_calls") or []):
        if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
            name = call["function"].get("name")
            if isinstance(name, str) and name.strip():
                found.append(("tool_call", ("tool_calls", k, "function", "name")))
    return found


def _wrap(value: str, begin: str, end: str) -> str:
    """``value`` with sentinels around its text, inside its surrounding whitespace (templates strip it)."""
    core = value.strip()
    lead = value[: len(value) - len(value.lstrip())]
    return lead + begin + core + end + value[len(lead) + len(core) :]


def _with_value(container: Any, path: tuple[Any, ...], value: str) -> Any:
    """A copy of ``container`` with the string at ``path`` replaced (copies only along the path)."""
    head, *rest = path
    copy: Any = dict(container) if isinstance(container, Mapping) else list(container)
    copy[head] = value if not rest else _with_value(container[head], tuple(rest), value)
    return copy


def _wrapped(
    messages: Sequence[dict[str, Any]], wrap: set[int]
) -> tuple[list[dict[str, Any]], dict[int, tuple[int, str]]]:
    """The messages with the fields of those in ``wrap`` in sentinels; which pair marks which field."""
    out: list[dict[str, Any]] = []
    owners: dict[int, tuple[int, str]] = {}
    pair = 0
    for index, message in enumerate(messages):
        if index in wrap:
            for kind, path in text_fields(message):
                if 2 * pair + 1 >= _SENTINEL_COUNT:
                    raise SampleConversionError("the conversation has too many text fields to locate")
                value: Any = message
                for step in path:
                    value = value[step]
                begin, end = chr(_SENTINEL_BASE + 2 * pair), chr(_SENTINEL_BASE + 2 * pair + 1)
                message = _with_value(message, path, _wrap(value, begin, end))
                owners[pair] = (index, kind)
                pair += 1
        out.append(message)
    return out, owners


def locate_fields(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    text: str,
    tools: Tools | None,
    kwargs: Mapping[str, Any],
) -> Fields:
    """Render with sentinels and read off where each message's fields are.

    A template that reacts to a message's text (Qwen3 asks whether a user message starts with
    "<tool_response>") renders it differently once wrapped; such messages are left unwrapped, found one
    by one. Generated messages must be wrapped.
    """
    if _SENTINELS.search(text):
        raise SampleConversionError(
            "the conversation holds characters of the private use area U+F0000..U+FFFFD, "
            "which the converter uses to mark where each message's text lies"
        )
    wrap = set(range(len(messages)))
    wrapped, owners = _wrapped(messages, wrap)
    rendered = _render(tokenizer, wrapped, tools, kwargs)
    if _SENTINELS.sub("", rendered) != text:
        for index in range(len(messages)):
            alone, _ = _wrapped(messages, {index})
            if _SENTINELS.sub("", _render(tokenizer, alone, tools, kwargs)) != text:
                wrap.discard(index)
        wrapped, owners = _wrapped(messages, wrap)
        rendered = _render(tokenizer, wrapped, tools, kwargs)
        if _SENTINELS.sub("", rendered) != text:
            raise SampleConversionError(
                "the chat template renders the conversation differently when its text is marked, "
                "so where the generated messages lie cannot be told"
            )
    fields = Fields(unwrapped=set(range(len(messages))) - wrap)
    begins: dict[int, int] = {}
    ends: dict[int, int] = {}
    position = 0
    for char in rendered:
        code = ord(char) - _SENTINEL_BASE
        if 0 <= code < _SENTINEL_COUNT:
            pair, is_end = divmod(code, 2)
            if is_end and pair in begins:
                ends.setdefault(pair, position)
            elif not is_end:
                begins.setdefault(pair, position)
        else:
            position += 1
    for pair, (index, kind) in owners.items():
        if pair in begins and pair in ends:
            fields.spans.setdefault(index, []).append((kind, begins[pair], ends[pair]))
        elif chr(_SENTINEL_BASE + 2 * pair) in rendered or chr(_SENTINEL_BASE + 2 * pair + 1) in rendered:
            fields.damaged.setdefault(index, []).append(kind)
    return fields


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    tools: Tools | None,
    template_kwargs: Mapping[str, Any],
) -> str:
    try:
        return render_chat(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
    except template_errors() as exc:
        raise SampleConversionError(f"the chat template cannot render the messages: {exc}") from exc
