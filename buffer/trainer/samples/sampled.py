"""The text path's corrections: what of a re-rendered reply the model did not sample is never trained.

A chat template writes its own text around and inside what the model generated. Most of it the model
writes too (headers it was prompted with, the end-of-turn token it samples), but some it cannot be known
to have written, or certainly did not:

- **text it could not decode.** A reply holding U+FFFD, the character a detokeniser writes for bytes that
  are not whole UTF-8 (a character split between tokens, cut off or sampled wrong), has lost the bytes the
  model sampled: no re-rendering gives its tokens back, so the trajectory is refused (`refuse_undecodable`).
- **a reasoning block it never closed.** A template whose generation prompt opens the reasoning (Qwen3's
  thinking models prompt with "<think>\\n") renders a reply without reasoning after an empty block it
  writes itself ("\\n</think>\\n\\n"): the model, which saw "<think>\\n" and never wrote "</think>", sampled
  all of it inside the reasoning. The last reply of the conversation is rendered as the reasoning it is
  (`close_open_reasoning`): its tokens then follow the very prompt the engine gave, and the template's
  closing and the end-of-turn token after it are masked 0 (the model sampled its stop inside the
  reasoning, not after "</think>"). Earlier ones, which every later prompt held as recorded, and tool calls
  sampled there (no template renders them inside reasoning) are not trained.
- **the template's whitespace around reasoning** ("<think>\\n", "\\n</think>\\n\\n"): masked 0, the markers
  themselves trained (`reasoning_holes`).
- **markers around a tool-call message's content** (Llama 4 writes "<|python_start|>...<|python_end|>"
  before every tool call, even around no content): masked 0 (`wrapper_holes`).
- **whitespace at the end of a reply cut off**: the model sampled it, and where the template keeps it, it
  is trained (`kept_tail`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from buffer.trainer.samples.sample import SampleConversionError
from buffer.trainer.samples.template import (
    ChatTemplateAnalysis,
    ReasoningSlot,
    Tools,
    render_chat,
    template_errors,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Span = tuple[int, int]

REPLACEMENT_CHARACTER = "\ufffd"


def refuse_undecodable(messages: Sequence[Mapping[str, Any]], generated: Sequence[int]) -> None:
    """Refuse a generated message whose text holds U+FFFD: the bytes the model sampled are lost."""
    for index in generated:
        message = messages[index]
        texts = [message.get("content"), message.get("reasoning_content"), message.get("thinking")]
        content = message.get("content")
        if isinstance(content, list):
            texts += [part.get("text") for part in content if isinstance(part, Mapping)]
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                texts += [function.get("name"), function.get("arguments")]
        if any(isinstance(text, str) and REPLACEMENT_CHARACTER in text for text in texts):
            raise SampleConversionError(
                f"generated message {index}: its text holds U+FFFD, which a detokeniser writes for bytes "
                "that are not whole UTF-8 characters (one split between tokens): the bytes the model sampled "
                "are lost, so no re-rendering gives its tokens back"
            )


def close_open_reasoning(
    tokenizer: PreTrainedTokenizerBase,
    analysis: ChatTemplateAnalysis,
    messages: list[dict[str, Any]],
    generated: Sequence[int],
    tools: Tools | None,
) -> tuple[set[int], set[int]]:
    """The generated messages sampled wholly inside a reasoning block their prompt opened: the last message
    of the conversation, rendered as that reasoning (``messages`` are the prepared copies, changed in
    place), and the others, which are not trained.

    Only the last is re-rendered: every later prompt held the others as they are recorded, so rendering
    them otherwise would change the context of what follows them.
    """
    if analysis.reasoning is None or analysis.reasoning.opening:
        return set(), set()  # the template has no reasoning slot, or the model opens it itself
    moved, untrained = set(), set()
    for index in generated:
        message = messages[index]
        if isinstance(message.get("reasoning_content"), str) or isinstance(message.get("thinking"), str):
            continue  # its reasoning was recorded (even empty): the model closed it
        content = message.get("content")
        if not message.get("tool_calls") and not (isinstance(content, str) and content.strip()):
            continue
        try:
            prompt = render_chat(
                tokenizer,
                messages[:index],
                tools=tools,
                add_generation_prompt=True,
                template_kwargs=analysis.template_kwargs,
            )
        except template_errors():
            continue
        if not prompt.endswith(analysis.generation_prompt):
            continue
        if index == len(messages) - 1 and not message.get("tool_calls"):
            message["reasoning_content"] = message["thinking"] = content
            message["content"] = ""
            moved.add(index)
        else:
            untrained.add(index)
    return moved, untrained


def reasoning_holes(text: str, slot: ReasoningSlot | None, reasoning: Span | None) -> list[Span]:
    """The whitespace the template writes in the reasoning slot's opening and closing around ``reasoning``."""
    if slot is None or reasoning is None:
        return []
    start, stop = reasoning
    regions = []
    if slot.opening:
        at = text.rfind(slot.opening, 0, start)
        if at >= 0 and not text[at + len(slot.opening) : start].strip():
            regions.append((at, at + len(slot.opening)))
    if slot.closing:
        at = text.find(slot.closing, stop)
        if at >= 0 and not text[stop:at].strip():
            regions.append((at, at + len(slot.closing)))
    return [hole for region in regions for hole in _whitespace(text, region)]


def wrapper_holes(
    text: str, wrapper: tuple[str, str] | None, header: int, content: Span | None
) -> list[Span]:
    """The markers the template writes around a tool-call message's content (from ``header`` on)."""
    if wrapper is None:
        return []
    opening, closing = wrapper
    if not text.startswith(opening, header):
        return []
    holes = [(header, header + len(opening))]
    after = content[1] if content is not None else header + len(opening)
    at = text.find(closing, after)
    if at >= 0 and not text[after:at].strip():
        holes.append((at, at + len(closing)))
    return holes


def kept_tail(text: str, stop: int, value: str) -> int:
    """How much of ``value``'s trailing whitespace the template wrote at ``stop``."""
    tail = value[len(value.rstrip()) :]
    kept = 0
    while kept < len(tail) and text.startswith(tail[kept], stop + kept):
        kept += 1
    return kept


def subtract(span: Span, holes: Sequence[Span]) -> list[Span]:
    """``span`` without the ``holes``: its pieces, in order."""
    pieces = []
    position, end = span
    for start, stop in sorted(holes):
        start, stop = max(start, position), min(stop, end)
        if start >= stop:
            continue
        pieces.append((position, start))
        position = stop
    pieces.append((position, end))
    return [(start, stop) for start, stop in pieces if start < stop]


def _whitespace(text: str, region: Span) -> list[Span]:
    runs = []
    start = None
    for position in range(*region):
        if text[position].isspace():
            if start is None:
                start = position
        elif start is not None:
            runs.append((start, position))
            start = None
    if start is not None:
        runs.append((start, region[1]))
    return runs
