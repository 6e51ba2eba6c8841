"""The simulator's module map (its package docstring) is the order its modules import each other
in: a newcomer reads it bottom-up, and a module that imports one listed below it (the first step
of an import circle) fails here, naming both."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import buffer.simulator

PACKAGE = Path(buffer.simulator.__file__).parent


def test_each_simulator_module_imports_only_modules_listed_above_it() -> None:
    order = re.findall(r"^    (\w+)\.py ", buffer.simulator.__doc__ or "", re.MULTILINE)
    modules = sorted(path.stem for path in PACKAGE.glob("*.py") if not path.stem.startswith("__"))
    assert sorted(order) == modules, "the package docstring lists every module once"
    upward = []
    for position, name in enumerate(order):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("buffer.simulator."):
                imported = (node.module or "").split(".")[2]
                if imported not in order[:position]:
                    upward.append(f"{name} -> {imported}")
    assert upward == []
