#!/usr/bin/env bash
# The main job: a policy server, the rollout buffer with its math generator, and a trainer
# polling the buffer for STEPS steps (default 5). Stops everything it started; Ctrl-C too.
#
#   bash rollout_buffer_example.sh                      # the simulated policy server
#   ENGINE_URL=http://10.0.0.2:30000 bash rollout_buffer_example.sh
#   SGLANG_MODEL_PATH=/models/Qwen3-4B bash rollout_buffer_example.sh   # needs '.[sglang]'
#   STEPS=2 bash rollout_buffer_example.sh --help       # every option
#
# On a fresh machine it first makes .venv and installs the project with its 'sim' extra (no torch).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
    echo "first run: installing the project into .venv (a minute or so, once; no torch)" >&2
    python3 -m venv .venv
    # One line per package as it is fetched, then the summary: progress, not a minute of silence.
    # The sim extra: the simulated policy server's tokenizer.
    .venv/bin/pip install --disable-pip-version-check -e '.[sim]' 2>&1 \
        | grep --line-buffered -E '^(Collecting|Installing collected|Successfully installed|ERROR)' >&2
    PYTHON=.venv/bin/python
fi
exec "$PYTHON" -m buffer.demo "$@"
