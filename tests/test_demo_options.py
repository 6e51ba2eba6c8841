"""The example run's options and what it says when no batch comes (``buffer/demo.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.paths import REPO


def run_demo(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "buffer.demo", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_help_shows_each_default_and_the_model_option() -> None:
    done = run_demo("--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "--model NAME" in text
    assert "--steps N trainer steps (STEPS) (default: 5)" in text
    assert "--step-timeout-s SECONDS" in text
    assert "(default: 120.0)" in text
    assert "(default: None)" not in text  # an option without a default says nothing of one


@pytest.mark.e2e
def test_a_model_the_engine_does_not_serve_is_named_at_once(
    process: Callable[..., str], tmp_path: Path
) -> None:
    """vLLM answers 404 to a model name it does not serve: the job fails, and the run says so
    (and what the engine serves) instead of only that no batch came."""
    engine = process("-m", "buffer.simulator", "--engine", "vllm", "--served-model-name", "qwen", name="vllm")
    done = run_demo(
        "--engine-url", engine, "--model", "wrong", "--steps", "1", env={"LOG_DIR": str(tmp_path / "logs")}
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the job job-1 is failed" in done.stderr
    assert "The model `wrong` does not exist" in done.stderr
    assert "the engine serves qwen, not 'wrong': give --model" in done.stderr


@pytest.mark.e2e
def test_without_model_an_engine_of_one_model_is_asked_for_it(
    process: Callable[..., str], tmp_path: Path
) -> None:
    engine = process("-m", "buffer.simulator", "--engine", "vllm", "--served-model-name", "qwen", name="vllm")
    done = run_demo(
        "--engine-url",
        engine,
        "--steps",
        "1",
        "--groups-per-step",
        "2",
        "--group-size",
        "2",
        env={"LOG_DIR": str(tmp_path / "logs")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "model: qwen (the only one the engine serves" in done.stdout
    assert "step 1: 2 groups" in done.stdout
