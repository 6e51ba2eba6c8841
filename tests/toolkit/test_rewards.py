"""The ready-made rewards: boxed answers, math equivalence, multiple choice, a remote reward model.

The reward model is mocked at the HTTP layer with respx. math-verify runs for real, in
MathReward's worker processes (and once in this process, to check the fast path agrees).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from buffer.toolkit.rewards import (
    MathReward,
    RemoteRewardModel,
    RewardModelError,
    choice_reward,
    extract_boxed,
)
from buffer.toolkit.rewards.answers import decide_fast, normalize_answer
from buffer.toolkit.types import Episode, Sample
from tests.support.paths import REPO

REPO = REPO
URL = "http://reward-model.test/score"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sample(label: Any, instance_id: str | int = "q1") -> Sample:
    row = {"prompt": "Compute it.", "label": label}
    return Sample(instance_id, row, [{"role": "user", "content": "Compute it."}], 0, 0, 7)


def episode(response: str) -> Episode:
    messages = [{"role": "user", "content": "Compute it."}, {"role": "assistant", "content": response}]
    return Episode(messages, "stop")


# -- extract_boxed ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{1}, then \\boxed{2}", "2"),
        ("\\fbox{7}", "7"),
        ("\\boxed {x+1}", "x+1"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{}", ""),
        ("no box at all: 42", None),
        ("\\boxed{1} and then \\boxed{\\frac{1}{2}", None),  # the last answer is cut off
        ("\\boxed{", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


# -- MathReward ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def math_reward() -> Iterator[MathReward]:
    """One pool for the module's comparisons; tests that break pools make their own."""
    with MathReward() as reward:
        yield reward


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("label", "response"),
    [
        ("0.5", "\\boxed{\\frac{1}{2}}"),
        ("1/2", "The answer is $\\boxed{0.5}$."),
        ("\\frac{1}{2}", "\\boxed{1/2}"),
        ("\\dfrac{1}{2}", "\\boxed{\\frac{1}{2}}"),
        (0.5, "\\boxed{1/2}"),
        (42, "\\boxed{42}"),
        ("42", "The answer is 42"),  # no box: math-verify finds the answer
        ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\sqrt{2}/2}"),
        ("2\\pi", "\\boxed{\\pi \\cdot 2}"),
        ("x+1", "\\boxed{1 + x}"),
        ("1/3", "\\boxed{0.3333333}"),  # math-verify's rounding, not the fast path's
        ("3", "\\boxed{2}, no wait: \\boxed{3}"),
    ],
)
async def test_math_reward_accepts_equivalent_answers(
    math_reward: MathReward, label: Any, response: str
) -> None:
    assert await math_reward(sample(label), episode(response)) == 1.0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("label", "response"),
    [
        ("0.5", "\\boxed{0.25}"),
        ("42", "\\boxed{41}"),
        ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\sqrt{3}/2}"),
        ("42", "The answer is 41"),
        ("3", "\\boxed{3}, no wait: \\boxed{2}"),
        ("1/2", "\\boxed{}"),
        ("1/2", ""),
        ("1/2", "  \n"),
        ("42", "I have no idea."),
    ],
)
async def test_math_reward_rejects_wrong_or_missing_answers(
    math_reward: MathReward, label: str, response: str
) -> None:
    assert await math_reward(sample(label), episode(response)) == 0.0


# Decided by the fast path; math-verify's own verdict must be the same on every one.
FAST_PATH_CASES = [
    ("42", "42"),
    ("42", "41"),
    ("-3", "-3"),
    ("+5", "5"),
    ("0.5", "1/2"),
    ("1/2", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "\\dfrac{1}{2}"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\frac{-1}{2}", "-1/2"),
    ("0.5", "0.50"),
    ("5", "5."),
    ("2", "2.0"),
    ("1/3", "0.5"),
    ("1/3", "1/4"),
    ("3.14", "3.15"),
    ("100", "99.5"),
    ("12345678901234567", "12345678901234568"),
    ("1000", "1\\,000"),
    ("x+1", "x + 1"),
    ("\\left(1,2\\right)", "(1, 2)"),
    ("\\sqrt{2}", "\\sqrt{2}"),
    ("10^{3}", "10^{3}"),
    ("\\infty", "\\infty"),
    ("\\text{Monday}", "\\text{Monday}"),
]


@pytest.mark.parametrize(("label", "answer"), FAST_PATH_CASES)
def test_fast_path_agrees_with_math_verify(label: str, answer: str) -> None:
    from math_verify import parse, verify  # type: ignore[import-untyped]

    answer, label = normalize_answer(answer), normalize_answer(label)
    fast = decide_fast(answer, label)
    assert fast is not None, "not a fast-path case"
    # What the slow path would answer. No signal-based timeouts: pytest-timeout owns SIGALRM here.
    gold = parse(f"\\boxed{{{label}}}", parsing_timeout=None)
    prediction = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    assert fast == float(verify(gold, prediction, timeout_seconds=None))


@pytest.mark.parametrize(
    ("label", "answer"), [("1/3", "0.3333333"), ("3.14", "3.1400004"), ("2", "2.0000001")]
)
def test_fast_path_leaves_close_decimals_to_math_verify(label: str, answer: str) -> None:
    assert decide_fast(normalize_answer(answer), normalize_answer(label)) is None


@pytest.mark.anyio
async def test_fast_path_answers_never_start_the_process_pool() -> None:
    async with MathReward() as reward:
        cases = [(str(n), f"So the answer is \\boxed{{{n if n % 3 else n + 1}}}.") for n in range(200)]
        scores = await asyncio.gather(*(reward(sample(label), episode(text)) for label, text in cases))
        assert scores == [0.0 if n % 3 == 0 else 1.0 for n in range(200)]
        assert await reward(sample("1/2"), episode("")) == 0.0
        assert not reward.pool_started


@pytest.mark.anyio
async def test_slow_path_keeps_the_event_loop_running() -> None:
    ticks = 0

    async def tick() -> None:  # counts the loop's turns: none while a comparison blocks it
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    async with MathReward() as reward:
        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        # The first slow comparison also starts the worker and imports sympy there: a second or more.
        score = await reward(sample("\\frac{\\sqrt{2}}{2}"), episode("\\boxed{\\sqrt{2}/2}"))
        elapsed_s = time.monotonic() - started
        ticker.cancel()
        assert score == 1.0
        assert reward.pool_started
    assert elapsed_s > 0.2
    assert ticks > 100  # thousands: the loop turned all along (a blocked one, a few at most)


@pytest.mark.anyio
async def test_a_comparison_that_overruns_scores_zero_and_the_pool_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with MathReward(timeout_s=2.0) as reward:
        with caplog.at_level(logging.WARNING, logger="buffer.toolkit.rewards.math_reward"):
            # sympy computes 9**387420489 in C code, which no alarm interrupts: the worker is killed.
            assert await reward(sample("3"), episode("\\boxed{9^{9^{9}}}")) == 0.0
        assert "took over 2.0 s" in caplog.text
        assert not reward.pool_started
        reward.timeout_s = 60.0  # the next comparison's own time, however loaded the machine
        assert await reward(sample("2\\pi"), episode("\\boxed{\\pi \\cdot 2}")) == 1.0


@pytest.mark.anyio
async def test_math_reward_refuses_a_sample_without_label(math_reward: MathReward) -> None:
    with pytest.raises(ValueError, match="no label"):
        await math_reward(sample(None), episode("\\boxed{1}"))


@pytest.mark.anyio
async def test_a_closed_math_reward_refuses_calls() -> None:
    reward = MathReward()
    await reward.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await reward(sample("1"), episode("\\boxed{1}"))


def test_workers_that_cannot_start_raise_instead_of_scoring_zero(tmp_path: Path) -> None:
    # Without the __main__ guard, each spawned worker runs the script again and dies.
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio
            from buffer.toolkit.rewards import MathReward
            from buffer.toolkit.types import Episode, Sample

            async def main():
                async with MathReward() as reward:
                    sample = Sample("q", {"label": "2\\\\pi"}, [], 0, 0, 0)
                    answer = [{"role": "assistant", "content": "\\\\boxed{\\\\pi \\\\cdot 2}"}]
                    await reward(sample, Episode(answer, "stop"))

            asyncio.run(main())
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=90, check=False
    )
    assert result.returncode != 0
    assert "RuntimeError: math-verify's worker processes do not start" in result.stderr
    assert "__name__ == '__main__'" in result.stderr


# -- choice_reward ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "response", "expected"),
    [
        ("C", "\\boxed{C}", 1.0),
        ("(C)", "Final: $\\boxed{c}$", 1.0),
        ("C.", "\\boxed{\\text{(C)}}", 1.0),
        ("B", "\\boxed{B: 42}", 1.0),
        ("C", "\\boxed{D}", 0.0),
        ("A", "The answer is (B), I mean \\boxed{A}", 1.0),  # the box comes first
        ("c", "Therefore, the answer is (C).", 1.0),
        ("D", "Answer: D", 1.0),
        ("A", "The correct answer is **A**.", 1.0),
        ("B", "First the answer is (A)? No: the answer is (B).", 1.0),
        ("B", "Answer: I think it is B", 1.0),  # "I" is a word here, not option I
        ("A", "Answer: I think it is B", 0.0),
        ("D", "After ruling out the rest we pick (d)", 1.0),
        ("B", "Hence B.", 1.0),
        ("A", "I cannot decide.", 0.0),
        ("A", "", 0.0),
    ],
)
def test_choice_reward(label: str, response: str, expected: float) -> None:
    assert choice_reward(sample(label), episode(response)) == expected


@pytest.mark.parametrize("label", ["42", "AB", None, ""])
def test_choice_reward_refuses_a_label_that_is_no_letter(label: Any) -> None:
    with pytest.raises(ValueError, match="multiple-choice label"):
        choice_reward(sample(label), episode("\\boxed{A}"))


# -- RemoteRewardModel -----------------------------------------------------------------------


def remote(**options: Any) -> RemoteRewardModel:
    return RemoteRewardModel(URL, backoff_s=0.001, max_backoff_s=0.005, **options)


def score_by_id(request: httpx.Request) -> httpx.Response:
    """A reward model whose reward is the instance id."""
    return httpx.Response(200, json=[float(item["instance_id"]) for item in json.loads(request.content)])


@pytest.mark.anyio
async def test_concurrent_calls_are_sent_in_batches_and_each_gets_its_own_reward() -> None:
    with respx.mock:
        route = respx.post(URL).mock(side_effect=score_by_id)
        async with remote(batch_size=4, max_wait_s=0.05, headers={"authorization": "Bearer t"}) as rm:
            rewards = await asyncio.gather(
                *(rm(sample(f"L{n}", instance_id=n), episode(f"answer {n}")) for n in range(10))
            )
    assert rewards == [float(n) for n in range(10)]
    bodies = [json.loads(call.request.content) for call in route.calls]
    assert [len(body) for body in bodies] == [4, 4, 2]
    assert [item["instance_id"] for body in bodies for item in body] == list(range(10))
    assert bodies[0][1] == {
        "instance_id": 1,
        "prompt": [{"role": "user", "content": "Compute it."}],
        "response": "answer 1",
        "messages": [
            {"role": "user", "content": "Compute it."},
            {"role": "assistant", "content": "answer 1"},
        ],
        "label": "L1",
    }
    assert route.calls[0].request.headers["authorization"] == "Bearer t"


@pytest.mark.anyio
async def test_a_lone_call_leaves_after_max_wait() -> None:
    with respx.mock:
        respx.post(URL).mock(side_effect=score_by_id)
        async with remote(batch_size=32, max_wait_s=0.01) as rm:
            assert await asyncio.wait_for(rm(sample("x", instance_id=3), episode("y")), 5) == 3.0


@pytest.mark.anyio
async def test_a_cancelled_call_is_not_sent_and_does_not_hold_up_the_others() -> None:
    with respx.mock:
        route = respx.post(URL).mock(side_effect=score_by_id)
        async with remote(batch_size=32, max_wait_s=0.05) as rm:
            gone = asyncio.create_task(rm(sample("a", instance_id=1), episode("a")))
            kept = asyncio.create_task(rm(sample("b", instance_id=2), episode("b")))
            await asyncio.sleep(0)
            gone.cancel()
            assert await asyncio.wait_for(kept, 5) == 2.0
    assert gone.cancelled()
    assert [item["instance_id"] for item in json.loads(route.calls[0].request.content)] == [2]


@pytest.mark.anyio
async def test_rewards_may_come_wrapped() -> None:
    with respx.mock:
        respx.post(URL).mock(return_value=httpx.Response(200, json={"rewards": [0.25, 1]}))
        async with remote(batch_size=2) as rm:
            rewards = await asyncio.gather(rm(sample("a"), episode("a")), rm(sample("b"), episode("b")))
    assert list(rewards) == [0.25, 1.0]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "failure",
    [
        httpx.Response(503, text="overloaded"),
        httpx.Response(429, text="slow down"),
        httpx.Response(500),
        httpx.ConnectError("connection refused"),
        httpx.ReadTimeout("no answer"),
    ],
)
async def test_transient_failures_are_retried(failure: httpx.Response | Exception) -> None:
    with respx.mock:
        route = respx.post(URL).mock(side_effect=[failure, failure, httpx.Response(200, json=[0.75])])
        async with remote(batch_size=1, max_retries=3) as rm:
            assert await rm(sample("a"), episode("a")) == 0.75
    assert route.call_count == 3


@pytest.mark.anyio
async def test_retries_give_up_with_an_error_for_every_caller() -> None:
    with respx.mock:
        route = respx.post(URL).mock(return_value=httpx.Response(503, text="overloaded"))
        async with remote(batch_size=2, max_retries=2) as rm:
            outcomes = await asyncio.gather(
                rm(sample("a"), episode("a")), rm(sample("b"), episode("b")), return_exceptions=True
            )
    assert route.call_count == 3
    assert all(isinstance(outcome, RewardModelError) for outcome in outcomes)
    assert "3 attempts" in str(outcomes[0])
    assert "503" in str(outcomes[0])


@pytest.mark.anyio
async def test_a_refused_request_is_not_retried() -> None:
    with respx.mock:
        route = respx.post(URL).mock(return_value=httpx.Response(400, text="bad prompt field"))
        async with remote(batch_size=1) as rm:
            with pytest.raises(RewardModelError, match=r"HTTP 400.*bad prompt field"):
                await rm(sample("a"), episode("a"))
    assert route.call_count == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([1.0], "sent 2 responses to score, got 1"),
        ({"rewards": [1.0, 2.0, 3.0]}, "sent 2 responses to score, got 3"),
        ([1.0, "high"], "reward 1 is not a finite number"),
        ([True, 1.0], "reward 0 is not a finite number"),
        ({"scores": [1.0, 1.0]}, "expected a list of rewards"),
    ],
)
async def test_an_unusable_answer_fails_every_caller(answer: Any, message: str) -> None:
    with respx.mock:
        route = respx.post(URL).mock(return_value=httpx.Response(200, json=answer))
        async with remote(batch_size=2) as rm:
            outcomes = await asyncio.gather(
                rm(sample("a"), episode("a")), rm(sample("b"), episode("b")), return_exceptions=True
            )
    assert route.call_count == 1
    for outcome in outcomes:
        assert isinstance(outcome, RewardModelError)
        assert message in str(outcome)


@pytest.mark.anyio
async def test_aclose_closes_only_the_client_it_made() -> None:
    with respx.mock:
        respx.post(URL).mock(side_effect=score_by_id)
        async with httpx.AsyncClient() as client:
            rm = RemoteRewardModel(URL, client=client)
            assert await rm(sample("a", instance_id=1), episode("a")) == 1.0
            await rm.aclose()
            assert not client.is_closed
        own = RemoteRewardModel(URL)
        await own.aclose()
        assert own._client.is_closed
