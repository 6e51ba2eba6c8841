"""Admission sized by the trainer's batch, stale work cancelled in flight, pause aborts free.

Issue 24: admission took its floor from ``num_process`` (a third of the engines' time went to
groups discarded as stale), stale generations in flight were never cancelled, a pause's abort
spent an answer's ``max_continuations``, and a job resumed after a restart had no admission.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from buffer.policy import Admission, Policy
from buffer.policy.state import set_current_policy
from buffer.toolkit.llm import LLMStats
from buffer.toolkit.runner import run_rollouts
from buffer.toolkit.types import Episode
from tests.policy.test_policy import versioned
from tests.service.test_jobs import RECORDER, service
from tests.support.calls import wait_for
from tests.support.factories import Collected
from tests.toolkit.test_continuation import CHAT, COMPLETIONS, PROMPT, client, completions, vllm_chat

pytestmark = pytest.mark.anyio


# -- admission by demand --------------------------------------------------------------------


def test_capacity_comes_from_the_declared_batch_not_num_process() -> None:
    policy = Policy()
    data = {"num_process": 64, "num_repeat_per_sample": 2, "max_staleness": 1, "rollout_batch_size": 3}
    admission = policy.start_job_admission("math", data, lambda: 0)
    assert (admission.batch_groups, admission.capacity, admission.declared) == (3, 6, True)
    admission.saw_read(8)  # a declared batch stays what the trainer said
    assert admission.capacity == 6


def test_without_a_declared_batch_the_first_read_replaces_the_guess() -> None:
    policy = Policy()
    admission = policy.start_job_admission(
        "math", {"num_process": 64, "num_repeat_per_sample": 2, "max_staleness": 1}, lambda: 0
    )
    assert admission.batch_groups == 32  # a guess, until the trainer reads
    admission.saw_read(4)
    assert admission.capacity == 8
    policy.declare_batch(2)  # POST /policy rollout_batch_size
    assert admission.capacity == 4


def test_what_the_trainer_served_at_this_version_counts_until_the_version_changes() -> None:
    """S = 1, batches of 2: after the trainer took its batch at version 0, the groups still
    pending are the next step's; admitting more now would make groups served at version 2."""
    policy = Policy()
    policy.set_version(0)
    consumed = [0]
    admission = policy.start_admission("math", 1, 2, lambda: consumed[0])
    assert [admission.try_admit() for _ in range(5)] == [True, True, True, True, False]
    for _ in range(2):  # the trainer reads its batch
        policy.served("math", 2, 0)
        consumed[0] += 1
    assert not admission.try_admit()  # the sliding bound alone would admit two more here
    policy.set_version(1)
    assert [admission.try_admit() for _ in range(3)] == [True, True, False]


def test_a_cancelled_group_frees_its_place() -> None:
    admission = Admission(max_staleness=0, batch_groups=1, consumed=lambda: 0)
    assert admission.try_admit()
    assert not admission.try_admit()
    admission.report_cancelled("worker-a", 1)
    admission.report_cancelled("worker-a", 1)  # said again: counted once
    assert admission.try_admit()
    assert admission.snapshot()["cancelled_stale"] == 1


# -- stale work cancelled in flight ---------------------------------------------------------


class FakeLLM:
    gate = None
    mode = None

    def __init__(self) -> None:
        self.stats = LLMStats()

    async def aclose(self) -> None:
        return None


async def test_a_stale_sample_in_flight_is_cancelled_counted_and_not_written(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"instance_id": i, "prompt": "2+2", "label": "4"}) + "\n" for i in "ab")
    )
    policy = Policy()
    policy.set_version(0)
    set_current_policy(policy)
    admission = policy.start_job_admission(
        "math", {"num_repeat_per_sample": 1, "max_staleness": 1}, lambda: 0
    )
    held, release = asyncio.Event(), asyncio.Event()

    async def rollout(llm: Any, sample: Any, **sampling: Any) -> Episode:
        await policy.gate.enter()  # as an engine client does
        try:
            if sample.instance_id == "a":
                held.set()
                await release.wait()  # in flight at the engine
        finally:
            policy.gate.leave()
        return Episode([*sample.messages, {"role": "assistant", "content": "4"}], "stop")

    sink = Collected()
    data = {"task_type": "math", "input_file": str(rows), "remote_engine_url": "http://engine.test"}
    data |= {"max_staleness": 1, "num_process": 2, "shuffle": False}
    run = asyncio.ensure_future(
        run_rollouts(data, reward=lambda s, e: 1.0, rollout=rollout, sink=sink, llm=FakeLLM())
    )
    await asyncio.wait_for(held.wait(), 10)
    policy.set_version(2)  # "a" started at 0: past 0 + S, it can no longer be served
    try:
        progress = await asyncio.wait_for(asyncio.shield(run), 10)
    finally:
        release.set()  # without the cancellation "a" finishes, and is written
        await asyncio.wait_for(run, 10)
    assert [t["instance_id"] for t in sink.trajectories] == ["b"]
    assert (progress.cancelled_stale, progress.completed, progress.failed, progress.in_flight) == (1, 1, 0, 0)
    assert admission.cancelled_stale == 1


async def test_a_request_of_a_stale_group_is_stopped_at_the_gate(tmp_path: Path) -> None:
    """A continuation waiting at the closed gate resumes under a version that leaves its group
    unservable: nothing reaches the engine."""
    from buffer.policy.gate import StaleWork
    from buffer.policy.stale import StaleGroups

    policy = Policy()
    policy.set_version(0)
    stale = StaleGroups(policy.gate, 1, 1)
    sent: list[int | None] = []

    async def sample() -> None:
        with stale.sample(("epoch", "a")) as kept:
            sent.append(await policy.gate.enter())
            policy.gate.leave()
            policy.pause("abort")
            policy.resume(3)
            sent.append(await policy.gate.enter())  # raises StaleWork: taken back by ``sample``
        assert not kept

    await asyncio.wait_for(sample(), 10)
    assert sent == [0]
    assert (stale.groups, policy.gate.in_flight) == (1, 0)
    assert issubclass(StaleWork, asyncio.CancelledError)


# -- a pause's abort spends no continuation -------------------------------------------------


@respx.mock
async def test_an_answer_a_pause_aborted_is_continued_whatever_max_continuations() -> None:
    from buffer.policy.gate import Gate
    from buffer.toolkit.llm import ContinuePolicy

    gate = Gate()

    def aborted_by_a_pause(request: httpx.Request) -> httpx.Response:
        gate.pause()  # the trainer pauses, the engine aborts what is in flight
        asyncio.get_running_loop().call_later(0.05, gate.resume, 1)
        return vllm_chat([1, 2, 3], [10, 11], "abort", content="One")

    respx.post(CHAT).mock(side_effect=aborted_by_a_pause)
    respx.post(COMPLETIONS).mock(side_effect=completions([12], "stop", " two."))
    async with client(engine="vllm", continuation=ContinuePolicy(max_continuations=0, delay_s=0)) as llm:
        llm.gate = gate
        completion = await asyncio.wait_for(llm.complete(PROMPT, max_tokens=100), 10)
    assert (completion.finish_reason, completion.continuations) == ("stop", 1)


@respx.mock
async def test_an_abort_no_pause_made_still_counts() -> None:
    from buffer.toolkit.llm import ContinuePolicy

    respx.post(CHAT).mock(return_value=vllm_chat([1, 2, 3], [10, 11], "abort", content="One"))
    async with client(engine="vllm", continuation=ContinuePolicy(max_continuations=0, delay_s=0)) as llm:
        completion = await asyncio.wait_for(llm.complete(PROMPT, max_tokens=100), 10)
    assert (completion.finish_reason, completion.continuations) == ("abort", 0)


# -- a restart ----------------------------------------------------------------------------


def test_admission_is_restored_for_a_job_resumed_after_a_restart(generator_dir: Path, tmp_path: Path) -> None:
    (generator_dir / "recorder_generator.py").write_text(RECORDER)
    start = {
        "task_type": "recorder",
        "rollout_name": "rec",
        "num_repeat_per_sample": 3,
        "out": str(tmp_path / "data.json"),
        "max_staleness": 1,
        "rollout_batch_size": 2,
        "num_process": 90,
    }
    with service(generator_dir, tmp_path / "data") as first:
        assert first.post("/start_rollout", json=start).status_code == 200
        admission = first.get("/policy").json()["data"]["admission"]["rec"]
        assert (admission["capacity"], admission["batch_declared"]) == (4, True)
    with service(generator_dir, tmp_path / "data") as second:
        jobs: Callable[[], list[Any]] = lambda: second.get("/jobs").json()["data"]["jobs"]  # noqa: E731
        wait_for(lambda: any(job["status"] == "running" for job in jobs()), 30, "the resumed job")
        admission = second.get("/policy").json()["data"]["admission"].get("rec")
        assert admission is not None, "a resumed job runs without admission"
        assert (admission["capacity"], admission["batch_declared"]) == (4, True)


def test_post_policy_declares_the_batch_and_refuses_a_bad_one(generator_dir: Path, tmp_path: Path) -> None:
    with service(generator_dir, tmp_path / "data") as client_:
        bad = client_.post("/policy", json={"version": 1, "rollout_batch_size": 0})
        assert bad.status_code == 422
        assert "rollout_batch_size" in bad.text
        assert client_.post("/policy", json={"version": 1, "rollout_batch_size": 5}).status_code == 200
        policy = client_.app.state.services.buffer.policy  # type: ignore[attr-defined]
        admission = policy.start_admission("math", 1, None, lambda: 0)
        assert (admission.batch_groups, admission.declared) == (5, True)
        for item in versioned("g", [0.0, 1.0], 1):
            client_.post("/buffer/write", json={**item, "task_type": "math"})
