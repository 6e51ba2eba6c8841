"""``buffer.py`` with its token lists counted, not checked: for ``hot_path.py --checks free`` only.

``python bench/unchecked_buffer.py [buffer.py's flags]`` runs the service with the checks of the
write routes' ids and logprobs (``buffer.service.token_bytes._ids`` and ``_numbers``) replaced by
a count of their commas: what the rest of the write path costs a token when those checks cost
nothing. Never a way to run the service: it takes ids and logprobs the schema refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from buffer.service import token_bytes  # noqa: E402  (after the checkout is on the path)
from buffer.service.cli import main  # noqa: E402


def _counted(data: bytes) -> int | None:
    """The values of a non-empty flat JSON array, unchecked (the benchmark sends no empty list)."""
    return data.count(b",") + 1 if data[:1] == b"[" else None


token_bytes._ids = token_bytes._numbers = _counted  # type: ignore[assignment]  # (measurement only)

if __name__ == "__main__":
    main()
