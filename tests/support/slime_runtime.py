"""Where slime's own code and its runtime are found, for the tests that run them.

slime (at the commit the adapter targets) and the Megatron-LM it pins come from
``../shared/third_party`` beside the checkout (or ``ROLLOUT_BUFFER_THIRD_PARTY``); its runtime
(torch on the CPU, ray, sglang) from ``.slime-venv`` (``bash .ci/slime.sh``, or
``ROLLOUT_BUFFER_SLIME_PYTHON``). Without either, the tests that need them skip, saying which.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

SLIME = "slime-624b824a8"
MEGATRON = "megatron-lm-1dcf0da-slime-patched"


def third_party() -> Path | None:
    candidates = [
        os.environ.get("ROLLOUT_BUFFER_THIRD_PARTY"),
        REPO.parent / "shared" / "third_party",
        "/work/shared/third_party",  # where the project's machines keep it
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / SLIME).is_dir() and (Path(candidate) / MEGATRON).is_dir():
            return Path(candidate)
    return None


def slime_python() -> Path | None:
    configured = os.environ.get("ROLLOUT_BUFFER_SLIME_PYTHON")
    python = Path(configured) if configured else REPO / ".slime-venv" / "bin" / "python"
    return python if python.is_file() else None


@functools.cache
def missing() -> str | None:
    if third_party() is None:
        return (
            f"slime's code ({SLIME}, {MEGATRON}) is not in ../shared/third_party "
            "(or ROLLOUT_BUFFER_THIRD_PARTY)"
        )
    python = slime_python()
    if python is None:
        return (
            "slime's runtime is not installed: run `bash .ci/slime.sh` (or set ROLLOUT_BUFFER_SLIME_PYTHON)"
        )
    probe = subprocess.run(
        [str(python), "-c", "import torch, ray, sglang, sglang_router"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return f"slime's runtime at {python} does not import: {probe.stderr.decode()[-300:]}"
    return None


def pythonpath(folder: Path) -> str:
    """slime's root and Megatron's (both imported as they are), then the checkout."""
    return os.pathsep.join([str(folder / SLIME), str(folder / MEGATRON), str(REPO)])


def require() -> tuple[Path, Path]:
    """(slime's python, the third-party folder), or the calling test skips with the reason."""
    reason = missing()
    python, folder = slime_python(), third_party()
    if reason is not None or python is None or folder is None:
        pytest.skip(reason or "slime's code or runtime is missing")
    return python, folder
