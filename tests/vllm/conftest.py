"""One real vLLM for the suite (its start is the slow part), a recording proxy per test in front of it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import vllm_engine
from tests.support.recording_proxy import RecordingProxy


@dataclass(frozen=True)
class Engine:
    python: Path
    model: Path
    #: The proxy's URL: where the generators are pointed.
    url: str
    #: vLLM's own URL (pause and resume go straight to it).
    direct_url: str
    proxy: RecordingProxy

    def score(
        self, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0
    ) -> list[list[float]]:
        return vllm_engine.score(self.python, self.model, sequences, temperature)


@pytest.fixture(scope="session")
def served_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[vllm_engine.Served]:
    python = vllm_engine.vllm_python()
    if python is None:
        pytest.skip(vllm_engine.missing_reason())
    folder = tmp_path_factory.mktemp("vllm")
    model = vllm_engine.build_model(folder / "model", python)
    # Tool calls parsed as Qwen3 writes them, so tool_choice="required" can force them (vLLM's
    # structured outputs) from a model that would otherwise never call a tool.
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    # Logprobs after temperature and filters, so a run that declares it (logprobs_mode) hands them
    # to the trainer; one that does not is taken to run vLLM's default (raw) and withholds them.
    # At temperature 1 with no filter the two are the same.
    mode = ("--logprobs-mode", "processed_logprobs")
    with vllm_engine.serving(python, model, folder / "vllm.log", *tools, *mode) as served:
        yield served


@pytest.fixture
def vllm(served_vllm: vllm_engine.Served) -> Iterator[Engine]:
    python = vllm_engine.vllm_python()
    assert python is not None
    proxy = RecordingProxy(served_vllm.url)
    with proxy.serving() as url:
        yield Engine(python, served_vllm.model, url, served_vllm.url, proxy)
