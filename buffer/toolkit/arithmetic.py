"""Exact integer arithmetic for a calculator tool: ``+ - * /``, unary minus, parentheses.

The expression is parsed with :mod:`ast` and evaluated by walking the tree, never ``eval``;
names, calls, powers and floats are refused. Division is exact: ``7 / 2`` is ``7/2``.
``calculate`` is what the shipped calculator task gives its model as a tool.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**60

_OPERATIONS = (ast.Add, ast.Sub, ast.Mult, ast.Div)


class NotArithmetic(ValueError):
    """The expression is not integer arithmetic this calculator evaluates."""


def calculate(expression: str) -> str:
    """``expression`` evaluated exactly: ``"3 * (4 + 5)"`` -> ``"27"``, ``"7 / 2"`` -> ``"7/2"``."""
    expression = expression.translate(_SYMBOLS).strip()
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        raise NotArithmetic(f"not an arithmetic expression: {expression!r}")
    try:
        tree = ast.parse(expression, mode="eval")
        value = _evaluate(tree.body)
    except (SyntaxError, ValueError, RecursionError, ZeroDivisionError) as exc:
        raise NotArithmetic(f"not an arithmetic expression: {expression!r} ({exc})") from exc
    return format_number(value)


def format_number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


_SYMBOLS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


def _evaluate(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, _OPERATIONS):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            result = left + right
        elif isinstance(node.op, ast.Sub):
            result = left - right
        elif isinstance(node.op, ast.Mult):
            result = left * right
        else:
            result = left / right
        if abs(result.numerator) > MAX_MAGNITUDE or result.denominator > MAX_MAGNITUDE:
            raise NotArithmetic("too large")
        return result
    raise NotArithmetic(type(node).__name__)
