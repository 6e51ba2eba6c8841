"""Token in, token out by default: which mode a run takes, and a trajectory saying which made it.

Token mode is the default whenever the served model's tokenizer is known (``tokenizer_path``, which
slime sends); chat mode stays selectable (``token_mode: false``) and is what a run without a tokenizer
gets. The simulator serves both through an ASGI transport; vLLM's missing ``/generate`` is respx's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.tokenizer import build_tokenizer
from buffer.toolkit.llm import ChatClient, ContinuePolicy, RetryPolicy
from buffer.toolkit.runner import RolloutSettings, policy_client, run_rollouts
from buffer.toolkit.tito import TokenClient, TokenRenderer
from buffer.toolkit.types import Episode, Sample
from tests.support.factories import Collected

pytestmark = pytest.mark.anyio

ENGINE = "http://engine.test"
FAST = RetryPolicy(max_attempts=3, backoff_s=0.001, max_backoff_s=0.01)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(str(path))
    return path


def settings(**fields: Any) -> RolloutSettings:
    return RolloutSettings.model_validate({"input_file": "rows.jsonl", "remote_engine_url": ENGINE, **fields})


def test_token_mode_is_the_default_whenever_the_tokenizer_path_loads(tokenizer_dir: Path) -> None:
    assert RolloutSettings.model_fields["token_mode"].default is None
    assert isinstance(policy_client(settings(tokenizer_path=str(tokenizer_dir))), TokenClient)
    assert isinstance(
        policy_client(settings(tokenizer_path=str(tokenizer_dir), token_mode=True)), TokenClient
    )
    assert isinstance(
        policy_client(settings(tokenizer_path=str(tokenizer_dir), token_mode=False)), ChatClient
    )
    assert isinstance(policy_client(settings()), ChatClient)  # no tokenizer known: the chat protocol


def test_a_tokenizer_path_that_does_not_load_is_chat_mode_said_once_unless_token_mode_is_asked_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="buffer.toolkit.tito")
    missing = str(tmp_path / "no-tokenizer-here")
    assert isinstance(policy_client(settings(tokenizer_path=missing)), ChatClient)
    assert f"chat mode: tokenizer_path {missing!r} does not load" in caplog.text
    with pytest.raises(OSError, match="no-tokenizer-here"):
        policy_client(settings(tokenizer_path=missing, token_mode=True))


@pytest.mark.parametrize("token_mode", [None, False], ids=["default", "chat"])
async def test_a_trajectory_says_which_mode_made_it(
    tokenizer_dir: Path, tmp_path: Path, token_mode: bool | None
) -> None:
    app = create_sim_app(SimConfig(latency_mean_s=0.0, abort_rate=0.3, accuracy=1.0, seed=0))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 2?", "label": str(i + 2)}) + "\n" for i in range(4))
    )
    payload = {
        "input_file": str(rows),
        "remote_engine_url": "http://sim",
        "model": "sim-model",
        "tokenizer_path": str(tokenizer_dir),
        "token_mode": token_mode,
        "num_repeat_per_sample": 2,
        "sampling_params": {"max_tokens": 128},
        "abort_retry_delay_s": 0,
    }
    llm = policy_client(RolloutSettings.model_validate(payload), transport=httpx.ASGITransport(app=app))
    sink = Collected()

    def reward(sample: Sample, episode: Episode) -> float:
        return 1.0 if sample.label in episode.response else 0.0

    async with llm:
        progress = await run_rollouts(payload, reward=reward, sink=sink, llm=llm)
    mode = "chat" if token_mode is False else "token"
    assert progress.completed == len(sink.trajectories) == 8
    assert {t["extra_info"]["generation_mode"] for t in sink.trajectories} == {mode}
    infos = [t["extra_info"] for t in sink.trajectories]
    assert all((i["text_continuations"], i["mismatched_continuations"]) == (0, 0) for i in infos)
    assert sum(i["continuations"] for i in infos), "aborted answers were continued"
    assert (progress.text_continuations, progress.mismatched_continuations) == (0, 0)


# engine: auto in token mode: SGLang's /generate, or vLLM's /v1/completions where there is none


def completions_answer(request: httpx.Request, echoed: list[int] | None = None) -> httpx.Response:
    prompt = json.loads(request.content)["prompt"]
    choice = {
        "index": 0,
        "text": "The answer is 5.",
        "logprobs": {"token_logprobs": [-0.5, -0.25]},
        "finish_reason": "stop",
        "prompt_token_ids": prompt if echoed is None else echoed,
        "token_ids": [7, 8],
    }
    return httpx.Response(200, json={"choices": [choice]})


def token_client(**kwargs: Any) -> TokenClient:
    return TokenClient(
        ENGINE,
        TokenRenderer(build_tokenizer()),
        model="served",
        transport=httpx.AsyncHTTPTransport(),
        retry=FAST,
        continuation=ContinuePolicy(delay_s=0),
        **kwargs,
    )


@respx.mock
async def test_engine_auto_in_token_mode_asks_v1_completions_where_generate_is_not_found(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="buffer.toolkit.llm")
    generate = respx.post(f"{ENGINE}/generate").mock(
        return_value=httpx.Response(404, json={"detail": "Not Found"})
    )
    completions = respx.post(f"{ENGINE}/v1/completions").mock(side_effect=completions_answer)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    async with token_client(engine="auto") as llm:
        first = await llm.complete(question, max_tokens=16)
        second = await llm.complete(question, max_tokens=16)
    assert (generate.call_count, completions.call_count) == (1, 2)  # found missing once
    assert json.loads(completions.calls[0].request.content)["model"] == "served"
    assert first.text == second.text == build_tokenizer().decode([7, 8])  # token mode decodes the ids
    assert first.tokens is not None
    assert first.tokens.output_ids == [7, 8]
    assert first.attempts == 2
    assert caplog.text.count("no /generate") == 1


@respx.mock
async def test_a_prompt_the_engine_reports_otherwise_than_sent_is_recorded_as_reported() -> None:
    respx.post(f"{ENGINE}/v1/completions").mock(side_effect=lambda r: completions_answer(r, echoed=[1, 2, 3]))
    async with token_client(engine="vllm") as llm:
        completion = await llm.complete([{"role": "user", "content": "What is 2 + 3?"}], max_tokens=16)
    assert completion.tokens is not None
    assert (completion.tokens.prompt_ids, completion.tokens.output_ids) == ([1, 2, 3], [7, 8])
    assert completion.mismatched_continuations == 1
