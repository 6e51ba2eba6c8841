"""The text path: what the model generated of each generated message, as character spans of the rendering.

From where each message's text lies (`buffer.trainer.samples.rerender.locate_fields`):

1. A generated message's turn starts after its header: where the conversation rendered up to it with
   ``add_generation_prompt=True`` stops (the prompt the engine was given). A reply after the last user
   message must be rendered after exactly that prompt, or it is refused (its tokens would follow a context
   the model never saw); one in the history, where templates write a shorter header (Qwen3 drops
   "<think>\\n"), starts after the last header in the template's own text between the previous message and
   this one. The empty reasoning block a template writes for a reply without reasoning (Qwen3's
   "<think>\\n\\n</think>\\n\\n", GLM's "\\n<think></think>\\n") is skipped: the model did not write it.
2. It ends with the first end-of-turn token after its last field (for a template that closes no reply,
   GLM-4.5, the next message's marker, which its model samples to stop: after the last reply it is
   appended). A reply cut off (finish_reason "length" or "abort") ends with its last field and the
   whitespace it ended with: the template's closing tokens were never generated.
3. What the template writes inside the turn that the model is not known to have written is cut out of
   it (`buffer.trainer.samples.sampled`), and each thing the sample holds that the model did not see is
   noted (``Located.notes``, the sample's ``rerender_notes``).

What the template cannot render faithfully is refused with the reason: a generated reply whose tool calls
or content it drops or rewrites, the reasoning of the last reply dropped, a reply cut off in a tool call,
a reply after the last user message rendered after a prompt other than its own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from buffer.trainer.samples import sampled
from buffer.trainer.samples.rerender import Fields, Span, locate_fields, reasoning_of, text_fields
from buffer.trainer.samples.sample import SampleConversionError
from buffer.trainer.samples.template import ChatTemplateAnalysis, Tools, render_chat, template_errors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class Located:
    """What the model generated of a re-rendered conversation, and what was assumed to find it."""

    spans: list[Span] = field(default_factory=list)  # the characters to train (mask 1), in order
    #: A stop token to append after the text: the marker a template that closes no reply (GLM-4.5)
    #: writes next, which the model sampled to end its last reply.
    stop_marker: str | None = None
    notes: list[str] = field(default_factory=list)  # what the sample holds that the model did not see


def generated_spans(
    tokenizer: PreTrainedTokenizerBase,
    analysis: ChatTemplateAnalysis,
    messages: list[dict[str, Any]],
    text: str,
    *,
    tools: Tools | None,
    generated: Sequence[int],
    last_turn_ended: bool,
    open_reasoning: Collection[int] = (),
    untrained: Collection[int] = (),
) -> Located:
    """The character spans of what the model generated of each generated message, in order.

    ``messages`` are prepared (`prepare_messages`, `sampled.close_open_reasoning`, whose moved messages
    are ``open_reasoning``; those it found sampled inside a reasoning block but could not move are
    ``untrained``) and ``text`` is their rendering.
    """
    fields = locate_fields(tokenizer, messages, text, tools, analysis.template_kwargs)
    locator = _Locator(tokenizer, analysis, messages, text, tools, fields, set(open_reasoning))
    for index in generated:
        if index in untrained:
            locator.located.notes.append(
                f"message {index}: sampled inside the reasoning block its prompt opened (it never wrote "
                "'</think>'), which the template renders closed before it: not trained"
            )
            continue
        last = index == len(messages) - 1
        locator.turn(index, ended=(last_turn_ended or not last) and index not in locator.open_reasoning)
    return locator.located


@dataclass(slots=True)
class _Locator:
    tokenizer: PreTrainedTokenizerBase
    analysis: ChatTemplateAnalysis
    messages: list[dict[str, Any]]
    text: str
    tools: Tools | None
    fields: Fields
    open_reasoning: set[int]
    located: Located = field(default_factory=Located)

    def turn(self, index: int, *, ended: bool) -> None:
        """Add what the model wrote of generated message ``index``, or refuse with the reason."""
        message, text, analysis, fields = self.messages[index], self.text, self.analysis, self.fields
        notes = self.located.notes
        where = f"generated message {index}"
        if index in fields.unwrapped:
            raise SampleConversionError(
                f"{where}: the chat template renders it differently depending on its text"
            )
        if fields.damaged.get(index):
            damaged = ", ".join(sorted(set(fields.damaged[index])))
            raise SampleConversionError(
                f"{where}: the chat template rewrites its {damaged} (drops part of it)"
            )
        own = fields.of(index)
        kinds = {kind for kind, _, _ in own}
        if message.get("tool_calls") and "tool_call" not in kinds:
            raise SampleConversionError(f"{where}: the chat template does not render its tool calls")
        if any(kind == "content" for kind, _ in text_fields(message)) and "content" not in kinds:
            raise SampleConversionError(f"{where}: the chat template does not render its content")
        if reasoning_of(message).strip() and "reasoning" not in kinds:
            if index == len(self.messages) - 1:
                raise SampleConversionError(
                    f"{where}: the chat template does not render the reasoning of the last reply "
                    "(reasoning_content), so it would train the reply without the reasoning the model wrote "
                    "first"
                )
            notes.append(f"message {index}: the template drops its reasoning here; trained without it")
        if not own:
            raise SampleConversionError(
                f"{where}: it has no text (no content, reasoning or tool call) to train on"
            )
        start, stop = min(s for _, s, _ in own), max(e for _, _, e in own)
        everything = [(i, s, e) for i, spans in fields.spans.items() for _, s, e in spans]
        others = [(s, e) for i, s, e in everything if i != index]
        if any(s < stop and e > start for s, e in others):
            raise SampleConversionError(f"{where}: the chat template writes other messages' text inside it")
        previous = max((e for s, e in others if e <= start), default=0)
        following = min((s for s, e in others if s >= stop), default=len(text))

        header = self._header_end(index, previous, start)
        if analysis.reasoning is not None and "reasoning" not in kinds:
            block = analysis.reasoning.empty_block
            if block and text.startswith(block, header) and header + len(block) <= start:
                notes.append(
                    f"message {index}: the template writes an empty reasoning block {block!r} before it, "
                    "masked 0 (the model saw it only if the engine's prompt held it)"
                )
                header += len(block)
        if index in self.open_reasoning:
            notes.append(
                f"message {index}: sampled inside the reasoning block its prompt opened (it never wrote "
                "'</think>'): trained as that reasoning; the template's closing and end of turn after it "
                "masked 0"
            )
        reasoning = next(((s, e) for kind, s, e in own if kind == "reasoning"), None)
        content = next(((s, e) for kind, s, e in own if kind == "content"), None)
        holes = sampled.reasoning_holes(text, analysis.reasoning, reasoning)
        if message.get("tool_calls") and analysis.call_content_wrapper is not None:
            wrapper = sampled.wrapper_holes(text, analysis.call_content_wrapper, header, content)
            if wrapper:
                notes.append(
                    f"message {index}: the template's {' and '.join(analysis.call_content_wrapper)} "
                    "around its content masked 0 (not known to be the model's)"
                )
            holes += wrapper
        if not ended:
            if message.get("tool_calls"):
                raise SampleConversionError(
                    f"{where}: a reply cut off with tool calls (where it was cut cannot be told from the "
                    "text)"
                )
            last_kind = max(own, key=lambda field: field[2])[0]
            value = reasoning_of(message) if last_kind == "reasoning" else _content_text(message)
            end = stop + sampled.kept_tail(text, stop, value)
        else:
            end = self._turn_end(index, stop, following)
        self.located.spans.extend(sampled.subtract((header, end), holes))

    def _turn_end(self, index: int, stop: int, following: int) -> int:
        """Where a reply that ended ends: after its end-of-turn token (or the stop token it sampled)."""
        message, text, analysis = self.messages[index], self.text, self.analysis
        window = text[stop:following]
        found = [(window.find(m), -len(m), m) for m in analysis.end_of_turn if m in window]
        if found:
            at, _, marker = min(found)
            end = stop + at + len(marker)
        elif analysis.reply_ends_with_token:
            raise SampleConversionError(
                f"generated message {index}: the chat template writes no end-of-turn token "
                f"({' or '.join(analysis.end_of_turn)}) after it"
            )
        else:
            end = stop  # a template that closes no reply (GLM-4.5): the reply ends with its text
        stop_marker = analysis.call_stop if message.get("tool_calls") else analysis.reply_stop
        if stop_marker is None:
            return end
        if text.startswith(stop_marker, end):  # the next message's marker: the token it sampled to stop
            return end + len(stop_marker)
        if index == len(self.messages) - 1 and end == len(text.rstrip()):
            self.located.stop_marker = stop_marker
            self.located.notes.append(
                f"message {index}: {stop_marker!r}, the token the template writes next and the model "
                "samples to end its turn, appended"
            )
        return end

    def _header_end(self, index: int, previous: int, start: int) -> int:
        """Where the header of message ``index`` ends: the prompt it was generated from, else (a reply
        in the history, before the last user message) the template's own header."""
        text, analysis = self.text, self.analysis
        try:
            prompt: str | None = render_chat(
                self.tokenizer,
                self.messages[:index],
                tools=self.tools,
                add_generation_prompt=True,
                template_kwargs=analysis.template_kwargs,
            )
        except template_errors():
            prompt = None
        if prompt is not None and text.startswith(prompt) and previous <= len(prompt) <= start:
            # DeepSeek-V3 prompts after tool results with no header, and writes "<｜Assistant｜>" there once
            # the reply follows: that is the template's, not the model's.
            header = next((h for h in analysis.header_prefixes if text.startswith(h, len(prompt))), "")
            if header and len(prompt) + len(header) <= start:
                self.located.notes.append(
                    f"message {index}: the template writes {header!r} between the prompt it was generated "
                    "from and it, masked 0"
                )
                return len(prompt) + len(header)
            return len(prompt)
        last_user = max((i for i, m in enumerate(self.messages) if m.get("role") == "user"), default=-1)
        if not self.fields.unwrapped and index < last_user:
            gap = text[previous:start]
            for header in analysis.header_prefixes:
                at = gap.rfind(header)
                if at >= 0:
                    self.located.notes.append(
                        f"message {index}: in the history, rendered after the template's header "
                        f"{header!r}, not after the prompt it was generated from"
                    )
                    return previous + at + len(header)
        ending = "" if prompt is None else f", which ends {prompt[-40:]!r}"
        raise SampleConversionError(
            f"generated message {index}: the prompt it was generated from (the conversation before it, with "
            f"the generation prompt{ending}) is not how the whole conversation renders it (the template "
            "moves, drops or rewrites it once the reply follows), so its tokens would be trained in a "
            "context the model never saw"
        )


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, Mapping)]
        return next((text for text in reversed(texts) if isinstance(text, str) and text.strip()), "")
    return ""
