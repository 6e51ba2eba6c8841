"""Where the assistant turns lie in a rendered conversation, as characters and then as tokens.

The conversation is rendered once, whole, so the text is exactly what the template makes of it, earlier
turns rewritten included (Qwen3 and DeepSeek-R1-distill drop old reasoning). The assistant turns are then
found in that text in order: the next assistant header, and the first end-of-turn token after it. What lies
between the end of the header and the end of the end-of-turn token is what the model generated.

Characters become tokens through the tokenizer's offsets; where it has none, or they do not partition the
text (trimmed offsets), through decoding prefixes of the token ids. A token counts as generated only if it
lies wholly inside a turn: one that straddles the end of a header (say "\\n\\n" after Qwen3's "<think>\\n")
stays 0.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING

from buffer.samples.sample import SampleConversionError
from buffer.samples.template import ChatTemplateAnalysis

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Span = tuple[int, int]


def assistant_spans(
    text: str, analysis: ChatTemplateAnalysis, turns: int, *, last_turn_ended: bool = True
) -> list[Span]:
    """The character span of each of ``turns`` assistant turns' generated part, in order.

    With ``last_turn_ended=False`` (a cut-off reply) the last span stops before its end-of-turn token,
    which the template writes but the model never produced.
    """
    header, end = analysis.search_header, analysis.end_of_turn
    spans: list[Span] = []
    position = 0
    for turn in range(1, turns + 1):
        at = text.find(header, position)
        if at < 0:
            raise SampleConversionError(
                f"assistant turn {turn} of {turns}: the rendered conversation has no assistant header "
                f"{header!r} after character {position} (the template renders it without one)"
            )
        start = at + len(analysis.header_at(text, at))
        end_at = text.find(end, start)
        next_header = text.find(header, start)
        if end_at < 0 or 0 <= next_header < end_at:
            raise SampleConversionError(
                f"assistant turn {turn} of {turns}: the template writes no end-of-turn token {end!r} after it"
            )
        spans.append((start, end_at + len(end)))
        position = end_at + len(end)
    if spans and not last_turn_ended:
        start, stop = spans[-1]
        spans[-1] = (start, stop - len(end))
    return spans


def offsets_partition(offsets: Sequence[tuple[int, int]], text_length: int) -> bool:
    """Whether token offsets cover the text in order, with no gaps.

    Neighbours may overlap (the tokens of one character split into bytes), but neither starts nor stops
    may go back.
    """
    previous_start = covered = 0
    for start, stop in offsets:
        if not previous_start <= start <= covered <= stop <= text_length:
            return False
        previous_start, covered = start, stop
    return covered == text_length


def mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[int]:
    """1 for each token whose characters lie inside a span (for offsets that pass `offsets_partition`)."""
    starts = [start for start, _ in offsets]
    stops = [stop for _, stop in offsets]
    mask = [0] * len(offsets)
    for span_start, span_stop in spans:
        first = bisect_left(starts, span_start)
        after = bisect_right(stops, span_stop)
        if after > first:
            mask[first:after] = [1] * (after - first)
    return mask


def mask_from_decoding(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], text: str, spans: Sequence[Span]
) -> list[int]:
    """The same mask, placing each token by the length of the decoded prefix before it.

    Slower (a binary search of decodes per span boundary) but needs nothing from the tokenizer beyond
    ``decode``; refused if decoding the ids does not give the text back.
    """
    ids = list(ids)
    lengths: dict[int, int] = {}

    def prefix_length(count: int) -> int:
        if count not in lengths:
            decoded = tokenizer.decode(
                ids[:count], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            lengths[count] = len(decoded)
        return lengths[count]

    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if decoded != text:
        raise SampleConversionError(
            "cannot tell which tokens are the assistant's: the tokenizer gives no usable offsets and "
            "decoding the token ids does not give back the rendered conversation"
        )
    lengths[len(ids)] = len(text)

    def fewest(characters: int) -> int:
        """The fewest tokens whose decoded prefix reaches ``characters`` (len(ids) if none does)."""
        low, high = 0, len(ids)
        while low < high:
            middle = (low + high) // 2
            if prefix_length(middle) >= characters:
                high = middle
            else:
                low = middle + 1
        return low

    mask = [0] * len(ids)
    for start, stop in spans:
        first = fewest(start)  # the tokens from here on start at or after the span's start
        after = fewest(stop + 1) - 1 if stop < len(text) else len(ids)  # the ones before it end by its stop
        if after > first:
            mask[first:after] = [1] * (after - first)
    return mask
