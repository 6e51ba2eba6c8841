"""The gateway tests' engine process: the stand-in of ``tests.support.loopback_engine`` (token ids
in vLLM's shape, and a ``/log`` of what it sampled), one for each test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.gateway import serving


@pytest.fixture(scope="module")
def loopback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(tmp_path_factory, "engine", "-m", "tests.support.loopback_engine") as url:
        yield url
