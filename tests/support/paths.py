"""Where the tests find the repository and the files they ship."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
#: The checkout: buffer.py, generator/, docs/, bench/.
REPO = SUPPORT.parent.parent
#: The stand-in of slime's types (``import slime``), for the adapter's tests.
SLIME_STUB = SUPPORT / "slime_stub"
