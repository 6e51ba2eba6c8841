"""Reading a training sample back as text, for the tests of the conversion."""

from __future__ import annotations

from typing import Any


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def trained_runs(tokenizer: Any, sample: Any) -> list[str]:
    """The decoded runs of response tokens under mask 1, in order."""
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(sample.tokens[sample.prompt_length :], sample.loss_mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return [decode(tokenizer, run) for run in runs]
