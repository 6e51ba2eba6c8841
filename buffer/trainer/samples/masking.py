"""The loss mask over a rendered conversation's tokens, from the character spans the model generated.

The spans come from `buffer.trainer.samples.rerender`. Characters become tokens through the tokenizer's
offsets;
where it has none, or they do not partition the text (trimmed offsets), through decoding prefixes of the
token ids. A token counts as generated only if it lies wholly inside a turn: one that straddles the end of a
header (say "\\n\\n" after Qwen3's "<think>\\n") stays 0.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING

from buffer.trainer.samples.sample import SampleConversionError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Span = tuple[int, int]


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
