#!/usr/bin/env bash
# The declared lower bounds, checked: install the base at the LOWEST versions pyproject.toml
# allows for its direct dependencies (uv's --resolution lowest-direct), then import every
# shipped generator and run the tests that need no dev-only package. Not part of .ci/run (it
# downloads old wheels); run it after changing a bound:
#   bash .ci/lowest_versions.sh            # Python 3.11, the lowest one claimed
#   PYTHON=3.12 bash .ci/lowest_versions.sh
#
# Last run (Python 3.11, uv 0.13.9): fastapi 0.115.0, uvicorn 0.29.0, httpx 0.27.0,
# aiohttp 3.10.0, pydantic 2.7.0, pydantic-settings 2.7.0, orjson 3.10.0, msgspec 0.18.0,
# typing-extensions 4.8.0, tenacity 8.3.0, math-verify 0.7.0, prometheus-client 0.20.0:
# the three shipped generators load, 168 tests pass. The bounds it moved: tenacity 8.2 -> 8.3
# (stop_before_delay: every generator failed to import), fastapi 0.110 -> 0.115 (Starlette
# 0.36's test client warns on httpx 0.27), pydantic 2.6 -> 2.7 and typing-extensions
# 4.6 -> 4.8 (the lowest that pydantic-settings 2.7 and pydantic 2.7 accept).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-3.11}"
VENV="${VENV:-/tmp/rollout-buffer-lowest}"
UV="${UV:-uv}"
if ! command -v "$UV" >/dev/null; then
    echo "needs uv (pip install uv)" >&2
    exit 1
fi

rm -rf "$VENV"
"$UV" venv --quiet --python "$PYTHON" "$VENV"
"$UV" pip install --python "$VENV/bin/python" --resolution lowest-direct -e .
echo "--- installed at the lowest allowed versions:"
"$UV" pip freeze --python "$VENV/bin/python" | grep -iE '^(fastapi|uvicorn|httpx|aiohttp|pydantic|pydantic-settings|orjson|typing-extensions|tenacity|math-verify|prometheus-client)=='
# The test runner on top, at current versions, without moving anything already installed.
"$UV" pip install --python "$VENV/bin/python" "pytest>=8,<9" pytest-timeout respx  # anyio 3 (httpx 0.27's lowest) predates pytest 9
# The simulator's extra, for the toolkit's tests against it (a real tokenizer; no torch).
"$UV" pip install --python "$VENV/bin/python" "tokenizers>=0.19" "transformers>=4.45" "jinja2>=3.1"

"$VENV/bin/python" - <<'PY'
import pathlib, sys
from buffer.core.registry import GeneratorRegistry
registry = GeneratorRegistry(pathlib.Path("generator"))
registry.refresh()
for error in registry.errors:
    print("generator not loaded:", error.describe(), file=sys.stderr)
print("generators loaded:", sorted(registry.generators))
sys.exit(1 if registry.errors else 0)
PY
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/core/test_core.py tests/service/test_api.py tests/core/test_registry.py tests/trainer/test_client.py tests/toolkit/test_llm.py
