"""slime's own code against the service (``tests.support.slime_runtime`` finds it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import slime_runtime


@pytest.fixture(scope="session")
def slime() -> tuple[Path, Path]:
    """(slime's python, the third-party folder), or the test skips with the reason."""
    return slime_runtime.require()
