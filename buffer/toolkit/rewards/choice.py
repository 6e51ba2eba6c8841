"""``choice_reward``: multiple choice, the label a letter such as ``C``, ``(C)`` or ``C.``."""

from __future__ import annotations

import re
from typing import Any

from buffer.toolkit.rewards.answers import extract_boxed
from buffer.toolkit.types import Episode, Sample

_LABEL = re.compile(r"\s*[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:]?\s*")
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
# In a box any letter counts, followed by nothing or by its option text: "C", "(c)", "C: 42".
_BOXED_LETTER = re.compile(r"[\s(\[]*([A-Za-z])(?:[\s)\].:]|$)")
# "the answer is (C)", "Answer: C", "The correct answer is **B**.", "answer: option D".
# A bare letter is a capital standing alone; not "A" or "I" opening a sentence ("Answer: I think").
_ANSWER_IS = re.compile(
    r"(?i:answer)(?:\s+is)?\s*:?\s*(?i:(?:option|choice)\s*)?[*_]*\s*"
    r"(?:\(\s*([A-Za-z])\s*\)|\[\s*([A-Za-z])\s*\]|(?![AI]\s+[a-z])([A-Z])(?![\w']))"
)
# The response ends with a lone option: "... so we pick (c)." or "... Hence B".
_FINAL_LETTER = re.compile(r"(?:^|[\s:*_])(?:\(([A-Za-z])\)|\[([A-Za-z])\]|([A-Z]))[*_]*[.!]?\s*$")


def choice_reward(sample: Sample, episode: Episode) -> float:
    """1.0 when the letter the model chose is the label's, else 0.0.

    The choice is read from, in this order: the last ``\\boxed{C}``; the last "answer is (C)"
    or "Answer: C"; a lone letter ending the response. A label that is not a letter raises
    ``ValueError`` (the data set is wrong, not the model).
    """
    expected = _label_letter(sample.label)
    chosen = chosen_letter(episode.response)
    return 1.0 if chosen == expected else 0.0


def chosen_letter(response: str) -> str | None:
    """The option letter a response chose, upper case, or None when it chose none."""
    boxed = extract_boxed(response)
    if boxed is not None and (match := _BOXED_LETTER.match(_TEXT_COMMAND.sub(r"\1", boxed))):
        return match[1].upper()
    if matches := list(_ANSWER_IS.finditer(response)):
        return _letter(matches[-1])
    if match := _FINAL_LETTER.search(response):
        return _letter(match)
    return None


def _letter(match: re.Match[str]) -> str:
    return next(group for group in match.groups() if group).upper()


def _label_letter(label: Any) -> str:
    match = _LABEL.fullmatch(label) if isinstance(label, str) else None
    if match is None:
        raise ValueError(f"a multiple-choice label is a letter such as 'C', '(C)' or 'C.', not {label!r}")
    return match[1].upper()
