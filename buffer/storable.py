"""What the service can keep: values that survive being written to the journal and read back.

Python's ``json`` (and so FastAPI's body parsing, and pydantic's for untyped fields) accepts
``Infinity`` and ``NaN``, integers of any size, strings with lone surrogates (``"\\ud800"``)
and nesting as deep as its recursion allows. orjson writes the first as ``null`` and refuses
the others, so such a value, once taken, either changes on the way to disk or fails a write
after the service has acted on it. ``problem_at`` finds the first such value in a request
and names where it is, so the request is refused with a 4xx before anything starts.
"""

from __future__ import annotations

import math
from typing import Any

from buffer.encoding import INT64_MAX, INT64_MIN

#: The deepest nesting taken in a request: far beyond any real settings, well within what
#: orjson encodes (254 levels, the journal's own record around it included).
MAX_DEPTH = 64

Path = tuple[str | int, ...]


def problem_at(value: Any, path: Path = (), depth: int = 0) -> tuple[Path, str] | None:
    """The first value in ``value`` the journal cannot keep as it is: its path and why, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"must be a finite number, not {value}")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            return None
        return path, f"must be a 64-bit integer, {INT64_MIN} to {INT64_MAX}"
    if isinstance(value, str):
        return None if _is_unicode(value) else (path, "is not valid Unicode (a lone surrogate)")
    if isinstance(value, dict):
        children: Any = value.items()
    elif isinstance(value, list | tuple):
        children = enumerate(value)
    else:
        return None
    if depth >= MAX_DEPTH:
        return path, f"is nested deeper than {MAX_DEPTH} levels"
    for key, child in children:
        if isinstance(key, str) and not _is_unicode(key):
            return (*path, key), "is a key that is not valid Unicode (a lone surrogate)"
        found = problem_at(child, (*path, key), depth + 1)
        if found is not None:
            return found
    return None


def non_finite_at(value: Any, path: Path = ()) -> Path | None:
    """Where the first ``inf`` or ``nan`` in ``value`` is, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        children: Any = value.items()
    elif isinstance(value, (list, tuple)):
        children = enumerate(value)
    else:
        return None
    for key, child in children:
        found = non_finite_at(child, (*path, key))
        if found is not None:
            return found
    return None


def field_name(path: Path, prefix: str = "") -> str:
    """``messages.2.content``: the path as the 422s of the service name fields."""
    return prefix + ".".join(_printable(part) for part in path) if path else prefix.rstrip(".") or "body"


def _printable(part: str | int) -> str:
    return part.encode("utf-8", "backslashreplace").decode() if isinstance(part, str) else str(part)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
