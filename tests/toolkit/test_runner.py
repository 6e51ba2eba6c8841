"""run_rollouts: the plumbing generators share. LLM mocked with respx; trajectories collected."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from buffer.toolkit.dataset import derive_seed
from buffer.toolkit.llm import ChatClient, RetryPolicy
from buffer.toolkit.runner import run_rollouts
from buffer.toolkit.types import Episode, Sample
from default_func import FAILURE_REWARD
from tests.support.factories import Collected

pytestmark = pytest.mark.anyio

ENGINE = "http://engine.test"
URL = f"{ENGINE}/v1/chat/completions"


@pytest.fixture
async def llm() -> AsyncIterator[ChatClient]:
    """The policy server's client on httpx's own transport, which respx intercepts."""
    retry = RetryPolicy(max_attempts=2, backoff_s=0.001, max_backoff_s=0.01)
    async with ChatClient(ENGINE, retry=retry, transport=httpx.AsyncHTTPTransport()) as client:
        yield client


def data_set(tmp_path: Path, n: int = 3) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(n))
    )
    return str(path)


def payload(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "task_type": "math",
        "input_file": data_set(tmp_path),
        "remote_engine_url": ENGINE,
        "num_repeat_per_sample": 2,
        "num_epoch": 1,
        "num_process": 4,
        "sampling_params": {"max_tokens": 32, "temperature": 1.0},
        "max_attempts": 2,
        **overrides,
    }


def echo_answer(request: httpx.Request) -> httpx.Response:
    """Answers "\\boxed{<the first number of the question + 1>}"."""
    body = json.loads(request.content)
    number = int(body["messages"][-1]["content"].split()[2])
    message = {"role": "assistant", "content": f"\\boxed{{{number + 1}}}"}
    return httpx.Response(
        200,
        json={"choices": [{"message": message, "finish_reason": "stop"}], "usage": {"completion_tokens": 2}},
    )


def exact(sample: Sample, episode: Episode) -> float:
    return 1.0 if episode.response == f"\\boxed{{{sample.label}}}" else 0.0


@respx.mock
async def test_every_sample_becomes_a_trajectory_with_the_metadata_a_trainer_reads(
    tmp_path: Path, llm: ChatClient
) -> None:
    route = respx.post(URL).mock(side_effect=echo_answer)
    sink = Collected()
    progress = await run_rollouts(payload(tmp_path, num_epoch=2), reward=exact, sink=sink, llm=llm)
    written = sink.trajectories
    assert len(written) == progress.completed == progress.total == 3 * 2 * 2
    assert Counter((t["extra_info"]["epoch"], t["instance_id"]) for t in written) == {
        (e, i): 2 for e in (0, 1) for i in range(3)
    }
    assert {t["reward"] for t in written} == {1.0}
    assert len({t["uid"] for t in written}) == len(written)
    info = written[0]["extra_info"]
    assert {
        "prompt",
        "label",
        "finish_reason",
        "round_number",
        "timestamp",
        "sampling_params",
        "seed",
    } <= set(info)
    assert (info["finish_reason"], info["round_number"], info["usage"]) == (
        "stop",
        1,
        {"completion_tokens": 2},
    )
    assert info["sampling_params"] == {"max_tokens": 32, "temperature": 1.0}
    assert written[0]["task_type"] == "math"
    seeds = sorted(json.loads(call.request.content)["seed"] for call in route.calls)
    expected = sorted(derive_seed(0, i, r, e) for i in range(3) for r in range(2) for e in range(2))
    assert seeds == expected  # each request carries its deterministic seed


@respx.mock
async def test_skipped_instances_are_not_run(tmp_path: Path, llm: ChatClient) -> None:
    respx.post(URL).mock(side_effect=echo_answer)
    sink = Collected()
    await run_rollouts(payload(tmp_path, skip_instance_ids=["0", 2]), reward=exact, sink=sink, llm=llm)
    assert {t["instance_id"] for t in sink.trajectories} == {1}


@respx.mock
async def test_a_trajectory_that_fails_is_written_with_the_failure_reward_and_counted(
    tmp_path: Path, llm: ChatClient
) -> None:
    respx.post(URL).mock(return_value=httpx.Response(503, text="down"))
    sink = Collected()
    progress = await run_rollouts(payload(tmp_path), reward=exact, sink=sink, llm=llm)
    assert progress.failed == progress.completed == 6
    for trajectory in sink.trajectories:
        assert trajectory["reward"] == FAILURE_REWARD
        assert trajectory["messages"][-1] == {"role": "assistant", "content": ""}  # never null
        assert trajectory["extra_info"]["finish_reason"] == "error"
        assert "LLMError" in trajectory["extra_info"]["error"]


@respx.mock
async def test_a_run_whose_every_request_fails_logs_why_once(
    tmp_path: Path, llm: ChatClient, caplog: pytest.LogCaptureFixture
) -> None:
    respx.post(URL).mock(return_value=httpx.Response(503, text="engine is down"))
    with caplog.at_level(logging.WARNING, logger="buffer.toolkit.runner"):
        await run_rollouts(payload(tmp_path), reward=exact, sink=Collected(), llm=llm)
    (record,) = [r for r in caplog.records if r.name == "buffer.toolkit.runner" and "failed" in r.message]
    assert "LLMError" in record.getMessage()
    assert "503" in record.getMessage()


@respx.mock
async def test_a_reward_that_raises_fails_its_trajectory_only(tmp_path: Path, llm: ChatClient) -> None:
    respx.post(URL).mock(side_effect=echo_answer)

    async def picky(sample: Sample, episode: Episode) -> float:
        if sample.instance_id == 0:
            raise RuntimeError("grader crashed")
        return 0.5

    sink = Collected()
    await run_rollouts(payload(tmp_path), reward=picky, sink=sink, llm=llm)
    rewards = {t["instance_id"]: t["reward"] for t in sink.trajectories}
    assert rewards == {0: FAILURE_REWARD, 1: 0.5, 2: 0.5}
    failed = next(t for t in sink.trajectories if t["instance_id"] == 0)
    assert failed["messages"][-1]["content"] == "\\boxed{1}"  # the episode is kept for inspection
    assert failed["extra_info"]["error"] == "RuntimeError: grader crashed"


@respx.mock
async def test_a_group_reward_sees_each_prompts_episodes_together(tmp_path: Path, llm: ChatClient) -> None:
    respx.post(URL).mock(side_effect=echo_answer)
    calls: list[list[int]] = []

    def rank(samples: list[Sample], episodes: list[Episode]) -> list[float]:
        calls.append([s.repeat for s in samples])
        assert len({s.instance_id for s in samples}) == 1
        return [float(s.repeat) for s in samples]

    sink = Collected()
    await run_rollouts(payload(tmp_path, num_repeat_per_sample=3), group_reward=rank, sink=sink, llm=llm)
    assert sorted(map(sorted, calls)) == [[0, 1, 2]] * 3
    assert sorted(t["reward"] for t in sink.trajectories) == [0.0] * 3 + [1.0] * 3 + [2.0] * 3


@respx.mock
async def test_no_more_than_num_process_trajectories_are_in_flight(tmp_path: Path, llm: ChatClient) -> None:
    in_flight = 0
    peak = 0

    async def slow(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return echo_answer(request)

    respx.post(URL).mock(side_effect=slow)
    sink = Collected()
    await run_rollouts(
        payload(tmp_path, num_process=3, num_repeat_per_sample=8), reward=exact, sink=sink, llm=llm
    )
    assert len(sink.trajectories) == 24
    assert peak == 3


async def test_exactly_one_reward_kind_is_required(tmp_path: Path, llm: ChatClient) -> None:
    with pytest.raises(TypeError, match="exactly one of reward and group_reward"):
        await run_rollouts(payload(tmp_path), sink=Collected(), llm=llm)


@respx.mock
async def test_a_group_reward_scores_the_part_of_a_group_the_run_was_given(
    tmp_path: Path, llm: ChatClient
) -> None:
    """A resumed job (or a worker taking over a lost one's items) gets only the repeats still
    missing from a group: they are scored together at the run's end, never left unwritten."""
    respx.post(URL).mock(side_effect=echo_answer)
    calls: list[list[int]] = []

    def rank(samples: list[Sample], episodes: list[Episode]) -> list[float]:
        calls.append(sorted(s.repeat for s in samples))
        return [1.0] * len(samples)

    resume = {"finished_groups": [], "open_groups": [[0, [0, 1]]]}  # instance 0 has repeats 0 and 1
    sink = Collected()
    await run_rollouts(
        payload(tmp_path, num_repeat_per_sample=3, resume=resume), group_reward=rank, sink=sink, llm=llm
    )
    assert sorted(calls) == [[0, 1, 2], [0, 1, 2], [2]]
    assert len(sink.trajectories) == 7
