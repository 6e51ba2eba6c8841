"""The simulator's logprobs are what each engine returns (issue 20, item 2): vLLM's before
temperature and top-p/top-k unless started with ``--logprobs-mode processed_logprobs``, SGLang's
after temperature and before its filters; and the toolkit's token records say which are the
sampling distribution's, so the trainer is handed only those."""

from __future__ import annotations

import logging
import math
from typing import Any

import httpx
import pytest

from buffer.simulator import SimConfig, create_sim_app
from buffer.simulator.sampling import SamplingFields, sampling_logprob, tempered_logprob
from buffer.toolkit.llm import ChatClient
from buffer.toolkit.records import LogprobsJudge, turn_records
from buffer.trainer.samples.turns import samples_from_turns

pytestmark = pytest.mark.anyio

OTHERS = 1000
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]
NEUTRAL = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
NEUTRAL |= {"presence_penalty": 0.0, "frequency_penalty": 0.0}
#: (engine, its logprobs mode) for each simulated engine.
ENGINES = [("vllm", None), ("vllm", "processed_logprobs"), ("sglang", None), ("sglang", "raw_logprobs")]


def test_at_temperature_one_without_filters_every_logprob_is_the_raw_one() -> None:
    assert sampling_logprob(-0.7, OTHERS, SamplingFields()) == pytest.approx(-0.7)
    assert tempered_logprob(-0.7, OTHERS, 1.0) == -0.7


def test_a_lower_temperature_and_filters_make_the_leading_token_likelier() -> None:
    raw = -0.7
    tempered = tempered_logprob(raw, OTHERS, 0.6)
    assert raw < tempered < 0
    assert sampling_logprob(raw, OTHERS, SamplingFields(temperature=0.6)) == pytest.approx(tempered)
    filtered = sampling_logprob(raw, OTHERS, SamplingFields(temperature=0.6, top_k=20))
    assert tempered < filtered < 0
    assert sampling_logprob(raw, OTHERS, SamplingFields(temperature=0.6, top_p=0.1)) == 0.0  # alone in it
    assert sampling_logprob(raw, OTHERS, SamplingFields(temperature=0.0)) == raw  # greedy: the raw one


async def captured(engine: str, mode: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    """One answer of a simulated ``engine`` through the chat client (``engine: auto``), as a turn."""
    app = create_sim_app(SimConfig(engine=engine, logprobs_mode=mode, latency_mean_s=0.0, seed=1))
    async with ChatClient("http://sim", model="sim-model", transport=httpx.ASGITransport(app=app)) as llm:
        completion = await llm.complete(QUESTION, seed=7, max_tokens=64, **fields)
    turns = turn_records([*QUESTION, completion.message()], [completion], LogprobsJudge(mode))
    assert turns is not None
    return turns[0]


@pytest.mark.parametrize(
    "fields",
    [
        {**NEUTRAL, "temperature": 1.0},
        {**NEUTRAL, "temperature": 0.6},
        {**NEUTRAL, "temperature": 0.6, "top_p": 0.8},
        {**NEUTRAL, "temperature": 1.0, "top_k": 5},
    ],
    ids=["neutral", "temperature", "temperature+top_p", "top_k"],
)
async def test_turns_said_to_hold_sampling_logprobs_hold_the_same_ones_whatever_the_engine(
    fields: dict[str, Any],
) -> None:
    turns = {(engine, mode): await captured(engine, mode, fields) for engine, mode in ENGINES}
    assert len({tuple(turn["output_ids"]) for turn in turns.values()}) == 1  # the same sample
    truth = turns["vllm", "processed_logprobs"]  # vLLM's processed logprobs: what it sampled from
    assert truth["logprobs"] == "sampling"
    for key, turn in turns.items():
        same = all(
            math.isclose(a, b, abs_tol=1e-9)
            for a, b in zip(turn["output_logprobs"], truth["output_logprobs"], strict=True)
        )
        if turn["logprobs"] == "sampling":
            assert same, key
        else:
            assert turn["logprobs"] == "raw", key
            assert not same, key  # what the trainer would have been handed: wrong


async def test_vllm_at_temperature_below_one_is_raw_and_the_trainer_gets_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = create_sim_app(SimConfig(engine="vllm", latency_mean_s=0.0, seed=2))
    judge = LogprobsJudge(None, task_type="math")
    trajectories = []
    async with ChatClient("http://sim", model="sim-model", transport=httpx.ASGITransport(app=app)) as llm:
        for seed in range(3):
            completion = await llm.complete(QUESTION, seed=seed, max_tokens=64, **NEUTRAL, temperature=0.6)
            messages = [*QUESTION, completion.message()]
            turns = turn_records(messages, [completion], judge)
            trajectories.append({"instance_id": "q", "messages": messages, "reward": 1.0, "turns": turns})
    assert {t["turns"][0]["logprobs"] for t in trajectories} == {"raw"}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "processed_logprobs" in r.message]
    assert len(warned) == 1  # once for the run
    (sample,) = samples_from_turns(trajectories[0], 1.0, 1.0)
    assert sample.rollout_log_probs is None
    assert sample.log_probs_withheld is not None
    assert '"raw"' in sample.log_probs_withheld
