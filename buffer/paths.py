"""Where the package is, in one place: the folders the service, its workers and the example
run find by their position beside the code."""

from __future__ import annotations

from pathlib import Path

#: The ``buffer`` package itself.
PACKAGE = Path(__file__).resolve().parent
#: The folder holding it, with ``buffer.py``, ``default_func.py`` and ``generator/``: the checkout,
#: or site-packages for an installed copy. Workers get it first on their ``PYTHONPATH``.
ROOT = PACKAGE.parent
#: The generators shipped with the package (``--generator-dir`` by default).
GENERATOR_DIR = ROOT / "generator"
