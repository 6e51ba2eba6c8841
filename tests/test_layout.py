"""The house stays readable: no module of the package past the size docs/layout.md allows."""

from __future__ import annotations

from buffer import paths

MAX_LINES = 700


def test_no_module_of_the_package_is_over_700_lines() -> None:
    sizes = {
        str(path.relative_to(paths.ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in paths.PACKAGE.rglob("*.py")
    }
    assert sizes, "found no modules: the package moved?"
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"split these along the lines docs/layout.md gives (Sizes): {over}"
