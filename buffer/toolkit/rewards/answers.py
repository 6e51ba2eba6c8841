"""Reading a final answer out of a model's text, and deciding the easy comparisons at once.

``extract_boxed`` finds the answer a model was asked to put in ``\\boxed{...}``.
``normalize_answer`` removes what never changes an answer's meaning (spaces, ``$``, sizing and
spacing commands, a final period). ``decide_fast`` then settles the common cases without
sympy: the same text, or two plain numbers. It answers ``None`` for anything it is not sure
math-verify would judge the same way; those go to the slow path (``math_reward``).
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

# Removed before comparing: LaTeX spacing (\! \, \; \:), delimiter sizing (\left( → "("),
# escaped and plain dollar signs. \right\b keeps \rightarrow.
_NOISE = re.compile(r"\\[!,;:]|\\(?:left|right)\b|\\?\$")
_FRAC_VARIANT = re.compile(r"\\[dt]frac\b")
# Whitespace between two letters may separate words or commands (\pi x, \text{New York}): it
# stays, as one space. Any other whitespace goes: "x + 1" is "x+1".
_SPACE = re.compile(r"(?<=[A-Za-z])(\s+)(?=[A-Za-z])|\s+")

_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_RATIO = re.compile(r"([+-]?\d+)/(\d+)")
_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}")

# math-verify compares a decimal with another number after rounding both to 6 places, on
# sympy floats of 15 significant digits. Two numbers further apart than both bounds can
# never be called equal by it; closer ones are left to it.
_MIN_ABS_GAP = Fraction(1, 10**5)
_MIN_REL_GAP = Fraction(1, 10**9)


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. A box inside a box belongs to the outer
    one. None when there is no box, or when the last one is never closed (a cut-off answer).
    """
    content = None
    position = 0
    while (match := _BOXED.search(text, position)) is not None:
        end = _closing_brace(text, match.end())
        if end is None:
            return None
        content = text[match.end() : end]
        position = end + 1
    return content


def _closing_brace(text: str, start: int) -> int | None:
    """The index of the ``}`` closing the group opened just before ``start``."""
    depth = 1
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":  # an escaped \{ or \} is content, not structure
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return None


def normalize_answer(text: str) -> str:
    """The answer with what never changes its meaning removed (see the module docstring)."""
    text = _NOISE.sub("", text)
    text = _FRAC_VARIANT.sub(r"\\frac", text)
    text = _SPACE.sub(lambda match: " " if match[1] else "", text).strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def plain_number(text: str) -> tuple[Fraction, bool] | None:
    """A normalized answer's exact value and whether it is written as a decimal, or None when
    it is not a plain number: an integer, a decimal, ``a/b`` or ``\\frac{a}{b}``."""
    if _DECIMAL.fullmatch(text):
        return Fraction(text), "." in text
    if match := _RATIO.fullmatch(text):
        numerator, denominator = int(match[1]), int(match[2])
    elif match := _FRAC.fullmatch(text):
        numerator, denominator = int(match[1] + "1") * int(match[2]), int(match[3])
    else:
        return None
    if denominator == 0:
        return None
    return Fraction(numerator, denominator), False


def decide_fast(answer: str, label: str) -> float | None:
    """1.0 or 0.0 when two normalized answers settle it without sympy, else None."""
    if not answer or not label:
        return None
    if answer == label:
        return 1.0
    ours, theirs = plain_number(answer), plain_number(label)
    if ours is None or theirs is None:
        return None
    (value, decimal), (expected, expected_decimal) = ours, theirs
    if value == expected:
        return 1.0
    if not (decimal or expected_decimal):
        return 0.0  # integers and fractions are compared exactly
    gap = abs(value - expected)
    if gap > _MIN_ABS_GAP and gap > _MIN_REL_GAP * max(abs(value), abs(expected)):
        return 0.0
    return None
