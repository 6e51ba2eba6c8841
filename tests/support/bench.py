"""A script of ``bench/`` loaded as a module, for the tests of a benchmark's own parts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from tests.support.paths import REPO


@contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """``bench/<name>.py`` as a module, with ``bench/`` on the path for its ``import common``;
    both undone on leaving."""
    folder = str(REPO / "bench")
    spec = importlib.util.spec_from_file_location(f"{name}_bench", REPO / "bench" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    sys.modules[spec.name] = module  # a dataclass in it looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(folder)
