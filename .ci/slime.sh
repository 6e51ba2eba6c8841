#!/usr/bin/env bash
# slime's own runtime for the test suite (tests/slime): the light runtime slime's code needs on the
# CPU, in a virtual environment of its own, .slime-venv, as ../shared/third_party/README.md
# describes it. The tests run slime's code (from that folder, on PYTHONPATH) with this python, and
# skip, saying so, without it.
#
#   bash .ci/slime.sh          # a few minutes the first time; nothing once installed
#
# Where the package registry cannot be reached it says so loudly and exits 0: the slime tests then
# skip with that reason. An install that succeeds but cannot import slime's runtime fails.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV="${SLIME_VENV:-.slime-venv}"
SGLANG="0.5.23"  # slime's Dockerfile pins 0.5.15.post1, which needs a torchvision that breaks beside the CPU torch
check() { "$VENV/bin/python" -c "import torch, transformers, ray, sglang, sglang_router, yaml, omegaconf, buffer.trainer.client" >/dev/null 2>&1; }

if [ -x "$VENV/bin/python" ] && check; then
    echo "slime: $VENV has slime's runtime"
    exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# torch==2.13.0 is the CPU build that lies on disk; anything else would pull CUDA.
if ! "$VENV/bin/pip" install --quiet "torch==2.13.0" transformers "ray[default]" wandb sglang-router pyyaml \
        requests omegaconf psutil pybase64 triton pillow msgspec pyzmq IPython \
    || ! "$VENV/bin/pip" install --quiet --no-deps "sglang==$SGLANG" \
    || ! "$VENV/bin/pip" install --quiet -e .; then
    echo "!!! slime: installing slime's runtime failed (is the package registry reachable?):" >&2
    echo "!!! the real-slime tests (tests/slime) will be SKIPPED" >&2
    rm -rf "$VENV"
    exit 0
fi
if ! check; then
    echo "slime: installed into $VENV but its runtime fails to import:" >&2
    "$VENV/bin/python" -c "import torch, transformers, ray, sglang, sglang_router, yaml, omegaconf, buffer.trainer.client" >&2
    exit 1
fi
echo "slime: installed slime's runtime into $VENV"
