"""The lease board across the service's lives and the job's end (issue 22, the generation
soak's defects): a worker over HTTP walks from the task's resume point before its first walk;
an epoch is complete only once every plan told is made; a board closed for a finished job tells
its workers to stop; a new board after a restart settles, granting only items in flight, so a
remote worker's item in flight across the restart is not made again by another; items in
flight carry over to a new run's board; ``rollout-buffer worker`` waits for a buffer that does
not answer yet; a sample's task that raises fails the toolkit's run."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from fastapi.testclient import TestClient

from buffer.current import JobContext, running
from buffer.lease_terms import PlanFinished, Settling, item_key
from buffer.toolkit import leased as leased_module
from buffer.toolkit.dataset import Plan, ResumePoint
from buffer.toolkit.leased import BoardLeases, leased
from buffer.toolkit.llm import ChatClient, RetryPolicy
from buffer.toolkit.runner import run_rollouts
from buffer.toolkit.types import Sample
from buffer.workers import remote
from buffer.workers.leases import LeaseBoard
from tests.support.factories import Collected, FakeClock, trajectory


def _plan(instances: int = 4, repeats: int = 2, epochs: int = 1, resume: ResumePoint | None = None) -> Plan:
    rows = [{"instance_id": f"q{i}", "prompt": f"question {i}"} for i in range(instances)]
    return Plan(rows, num_repeat_per_sample=repeats, num_epoch=epochs, seed=1, resume=resume)


#: The task's resume point after its earlier lives made q0's group of epoch 0.
Q0_MADE = {"finished_groups": [["q0", 1]], "finished_epochs": [["q0", 0, 1]], "open_groups": []}


class RemoteLike(BoardLeases):
    """A worker over HTTP, on the board itself: it has a board to learn and a resume point."""

    def __init__(self, board: LeaseBoard, worker: str, point: dict[str, Any], ttl_s: float = 30) -> None:
        super().__init__(board, "t", worker, ttl_s)
        self.point = point

    async def identity(self) -> str | None:
        self._board.claim("t", self.worker, [], self.ttl_s)
        return self._board.identity("t")

    async def resume_point(self) -> dict[str, Any]:
        return self.point


async def _walk(
    board: LeaseBoard,
    plan: Plan,
    leases: dict[str, Any],
    made: list[Sample],
    *,
    stop_after: int | None = None,
) -> None:
    """A worker: walks the plan and writes each sample (the board observes it at once)."""
    job = JobContext("job-1", "t", "g.py", {}, lease_board=board)
    try:
        with running(job):
            async with contextlib.aclosing(leased(plan, "t", leases)) as samples:
                mine = 0
                async for sample in samples:
                    if stop_after is not None and mine >= stop_after:
                        return  # lost: what it holds stays its own until released
                    mine += 1
                    made.append(sample)
                    extra = {"epoch": sample.epoch, "repeat": sample.repeat}
                    board.observe("t", trajectory(str(sample.instance_id), extra_info=extra))
    finally:
        for task in job.background:
            task.cancel()
        await asyncio.gather(*job.background, return_exceptions=True)


def _keys(made: list[Sample]) -> Counter[str]:
    return Counter(item_key(s.epoch, s.instance_id, s.repeat) for s in made)


# -- A: a worker over HTTP learns the resume point before it walks ----------------------------


@pytest.mark.anyio
async def test_a_worker_over_http_walks_from_the_resume_point_before_its_first_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Started after a restart, its board new: q0, made by the service's earlier lives, is known
    only to the task's resume point, and must not be made again."""
    board = LeaseBoard()
    board.open("t")
    monkeypatch.setattr(leased_module, "lease_client", lambda task, leases: RemoteLike(board, "r", Q0_MADE))
    made: list[Sample] = []
    await _walk(board, _plan(), {"worker": "r", "chunk": 4, "ttl_s": 30}, made)
    assert sorted(_keys(made)) == sorted(item_key(0, f"q{i}", r) for i in (1, 2, 3) for r in range(2))


@pytest.mark.anyio
async def test_an_epoch_is_complete_only_once_every_plan_told_is_made() -> None:
    """Two workers' plans from different resume points: worker 0's (q0 made) is smaller than
    worker 1's, which offers q0 again. The epoch's size is the larger plan's: copies of items
    outside the smaller plan never fill the count early and leave real items refused."""
    board, made = LeaseBoard(), list[Sample]()
    board.open("t")
    resumed = _plan(instances=3, epochs=2, resume=ResumePoint.from_json(Q0_MADE))
    await _walk(board, resumed, {"worker": "w0", "index": 0, "count": 2, "chunk": 2}, made, stop_after=2)
    board.release("t", "w0")  # lost: what it held and did not write goes to the others
    await _walk(
        board, _plan(instances=3, epochs=2), {"worker": "w1", "index": 1, "count": 2, "chunk": 2}, made
    )
    never = {item_key(s.epoch, s.instance_id, s.repeat) for s in resumed} - set(_keys(made))
    assert not never


# -- B: a board closed for a finished job ------------------------------------------------------


def test_a_board_closed_for_a_finished_job_tells_its_workers_to_stop(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    opened = board.open("t")
    board.close("t", opened, finished=True)
    assert board.finished("t")
    with pytest.raises(PlanFinished):
        board.claim("t", "r", ["0|q1|0"], ttl_s=10)  # never a fresh board handing the plan out again
    with pytest.raises(PlanFinished):
        board.orphans("t", "r", 10, ttl_s=10)
    assert board.task_types() == []
    board.open("t")  # a new run of the task
    assert not board.finished("t")
    assert board.claim("t", "r", ["0|q1|0"], ttl_s=10) == ["0|q1|0"]
    failed = board.open("u")
    board.close("u", failed)  # a job that did not finish: no word of finished
    assert not board.finished("u")


@pytest.mark.anyio
async def test_a_worker_meeting_a_finished_jobs_board_stops_without_walking_again() -> None:
    board = LeaseBoard()
    board.close("t", board.open("t"), finished=True)
    made: list[Sample] = []
    await _walk(board, _plan(), {"worker": "r", "chunk": 4, "ttl_s": 30}, made)
    assert made == []


def test_the_lease_routes_and_the_resume_point_say_a_finished_job_finished(client: TestClient) -> None:
    leases = client.app.state.services.jobs.leases  # type: ignore[attr-defined]
    assert client.get("/tasks/math/resume_point").json()["data"]["finished"] is False
    leases.close("math", leases.open("math"), finished=True)
    assert client.get("/tasks/math/resume_point").json()["data"]["finished"] is True
    answer = client.post("/tasks/math/leases", json={"worker": "r", "offer": ["0|q1|0"]}).json()["data"]
    assert answer["granted"] == []
    assert answer["finished"] is True
    answer = client.post("/tasks/math/leases/orphans", json={"worker": "r"}).json()["data"]
    assert answer["finished"] is True


# -- C: a new board settles; items in flight go to their worker first -------------------------


def test_a_resumed_jobs_board_grants_only_items_in_flight_while_it_settles(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    board.open("t", settle_s=8)
    with pytest.raises(Settling) as settling:
        board.claim("t", "job/0.0", ["0|q1|0", "0|q1|1"], ttl_s=8)
    assert settling.value.seconds == 8
    assert board.claim("t", "job/0.0", [], ttl_s=8) == []  # a heartbeat is answered
    assert board.claim("t", "remote", ["0|q1|1"], ttl_s=8, in_flight=True) == ["0|q1|1"]
    clock.advance(8)
    assert board.claim("t", "job/0.0", ["0|q1|0", "0|q1|1"], ttl_s=8) == ["0|q1|0"]


def test_a_board_a_claim_makes_in_a_restarted_services_first_lease_term_settles(clock: FakeClock) -> None:
    board = LeaseBoard(clock, settle_at_start=True)
    clock.advance(2)
    with pytest.raises(Settling) as settling:
        board.claim("t", "a", ["0|q1|0"], ttl_s=5)
    assert settling.value.seconds == 3
    assert board.claim("t", "b", ["0|q1|1"], ttl_s=5, in_flight=True) == ["0|q1|1"]
    clock.advance(3)
    assert board.claim("t", "a", ["0|q1|0", "0|q1|1"], ttl_s=5) == ["0|q1|0"]
    assert LeaseBoard(clock).claim("t", "a", ["0|q1|0"], ttl_s=5) == ["0|q1|0"]  # a first start


def test_a_new_runs_board_keeps_what_remote_workers_of_the_old_one_hold(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    board.open("t")
    board.own("t", "job-1/0.0")
    board.claim("t", "remote", ["0|q1|0"], ttl_s=10)
    board.claim("t", "job-1/0.0", ["0|q2|0"], ttl_s=10)
    board.claim("t", "gone", ["0|q3|0"], ttl_s=1)
    clock.advance(2)
    board.open("t")  # the job posted again: its old workers are stopped, the remote one is not
    assert board.claim("t", "job-2/0.0", ["0|q1|0", "0|q2|0", "0|q3|0"], ttl_s=10) == ["0|q2|0", "0|q3|0"]
    board.observe("t", trajectory("q1", extra_info={"epoch": 0, "repeat": 0}))
    assert board.claim("t", "job-2/0.0", ["0|q1|0"], ttl_s=10) == []


@pytest.mark.anyio
async def test_a_remote_workers_item_in_flight_across_a_restart_is_not_made_by_the_resumed_job() -> None:
    """The resumed job's worker claims at once; the remote worker claims its item in flight back
    only later (its heartbeat): the new board holds the job's worker off until it has."""
    board = LeaseBoard()
    board.open("t", settle_s=2.0)
    made: list[Sample] = []
    plan = _plan(instances=2, repeats=1)
    in_flight = item_key(*next((s.epoch, s.instance_id, s.repeat) for s in plan))
    job_worker = asyncio.create_task(
        _walk(board, plan, {"worker": "job-2/0.0", "chunk": 4, "ttl_s": 2}, made)
    )
    for _ in range(20):  # the job's worker has made its first claim, and waits
        await asyncio.sleep(0)
    assert made == []
    assert board.claim("t", "remote", [in_flight], ttl_s=30, in_flight=True) == [in_flight]
    board.observe("t", trajectory(in_flight.split("|")[1], extra_info={"epoch": 0, "repeat": 0}))
    await job_worker
    assert in_flight not in _keys(made)
    assert len(made) == 1


# -- D: rollout-buffer worker configures its task once the buffer answers ---------------------


def test_the_remote_worker_retries_configuring_its_task_until_the_buffer_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def put(url: str, **kwargs: Any) -> httpx.Response:
        calls.append(url)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        if len(calls) == 2:
            return httpx.Response(503, request=httpx.Request("PUT", url))
        return httpx.Response(200, json={"data": {"settings": {}}}, request=httpx.Request("PUT", url))

    monkeypatch.setattr(httpx, "put", put)
    remote._configure("http://buffer.test", "t", {"num_repeat_per_sample": 2}, retry_s=60)
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(
        httpx,
        "put",
        lambda url, **kw: httpx.Response(422, text="bad", request=httpx.Request("PUT", url)),
    )
    with pytest.raises(SystemExit, match="HTTP 422"):  # a refusal is not retried
        remote._configure("http://buffer.test", "t", {})


# -- E: a sample's task that raises fails the run ----------------------------------------------


class BrokenSink(Collected):
    """A sink whose second write breaks (not a refusal the run counts: a bug, a lost buffer)."""

    async def write(self, trajectory: dict[str, Any]) -> None:
        if len(self.trajectories) == 1:
            self.trajectories.append({})
            raise RuntimeError("the sink broke")
        await super().write(trajectory)


@pytest.mark.anyio
@respx.mock
async def test_a_sample_whose_task_raises_fails_the_run(tmp_path: Path) -> None:
    answer = {"choices": [{"message": {"role": "assistant", "content": "2"}, "finish_reason": "stop"}]}
    respx.post("http://engine.test/v1/chat/completions").mock(return_value=httpx.Response(200, json=answer))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "label": "1"}) + "\n" for i in range(4)))
    data = {
        "task_type": "math",
        "input_file": str(rows),
        "remote_engine_url": "http://engine.test",
        "num_repeat_per_sample": 2,
        "num_process": 2,
    }
    retry = RetryPolicy(max_attempts=1, backoff_s=0.001, max_backoff_s=0.01)
    async with ChatClient("http://engine.test", retry=retry, transport=httpx.AsyncHTTPTransport()) as llm:
        with pytest.raises(RuntimeError, match="the sink broke"):
            await run_rollouts(data, reward=lambda sample, episode: 1.0, sink=BrokenSink(), llm=llm)
