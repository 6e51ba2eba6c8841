"""Finding the arithmetic question in a prompt and solving it step by step.

Integers, ``+ - * /``, unary minus and parentheses; ``×``, ``÷`` and ``−`` are read as ``*``, ``/``
and ``-``. Expressions are parsed with :mod:`ast` and evaluated by walking the tree, never ``eval``;
anything else (names, calls, powers, floats) is not arithmetic. Division is exact: ``7 / 2`` is ``7/2``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**60

_CANDIDATE = re.compile(r"[\d\s()+\-*/]+")
_SYMBOLS = str.maketrans({"×": "*", "÷": "/", "−": "-"})
_OPERATORS: dict[type[ast.operator], str] = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass(frozen=True, slots=True)
class Solution:
    expression: str
    value: Fraction
    steps: tuple[str, ...]  # one "a op b = c" per operation, innermost first


class _NotArithmetic(Exception):
    pass


def format_number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def find_question(text: str) -> Solution | None:
    """The longest arithmetic expression in ``text`` that has an operation, solved; else ``None``."""
    best: Solution | None = None
    for match in _CANDIDATE.finditer(text.translate(_SYMBOLS)):
        candidate = match.group().strip()
        solution = solve(candidate) or solve(candidate.strip("() "))
        if solution is not None and (best is None or len(solution.expression) > len(best.expression)):
            best = solution
    return best


def solve(expression: str) -> Solution | None:
    """``expression`` evaluated with its steps, or ``None`` if it is no arithmetic with an operation."""
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    steps: list[str] = []
    try:
        value = _evaluate(tree.body, steps)
    except (_NotArithmetic, ZeroDivisionError, RecursionError):
        return None
    if not steps:
        return None
    return Solution(expression, value, tuple(steps))


def _evaluate(node: ast.expr, steps: list[str]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate(node.operand, steps)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, steps)
        right = _evaluate(node.right, steps)
        result = _apply(node.op, left, right)
        if abs(result.numerator) > MAX_MAGNITUDE or result.denominator > MAX_MAGNITUDE:
            raise _NotArithmetic("too large")
        symbol = _OPERATORS[type(node.op)]
        steps.append(f"{format_number(left)} {symbol} {format_number(right)} = {format_number(result)}")
        return result
    raise _NotArithmetic(type(node).__name__)


def _apply(operator: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(operator, ast.Add):
        return left + right
    if isinstance(operator, ast.Sub):
        return left - right
    if isinstance(operator, ast.Mult):
        return left * right
    return left / right
