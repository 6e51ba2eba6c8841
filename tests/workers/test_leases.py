"""The service's work leases: one holder per item, taken back after its holder goes silent or
is released, never granted again once its trajectory is in the buffer, and a board whose memory
stays bounded however many epochs a run makes. The workers' walk (``leased``) against the board
itself: every item made once, by whichever worker is left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from buffer.current import JobContext, running
from buffer.lease_terms import item_key
from buffer.toolkit.dataset import Plan
from buffer.toolkit.leased import leased
from buffer.toolkit.types import Sample
from buffer.workers.leases import LeaseBoard
from tests.support.factories import FakeClock, trajectory


def written(instance_id: str, repeat: int, epoch: int = 0) -> dict[str, Any]:
    return trajectory(instance_id, extra_info={"epoch": epoch, "repeat": repeat})


def test_an_item_is_granted_to_one_worker_at_a_time(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    keys = [item_key(0, "q1", r) for r in range(2)]
    assert board.claim("t", "a", keys, ttl_s=10) == keys
    assert board.claim("t", "b", keys, ttl_s=10) == []
    assert board.claim("t", "a", keys, ttl_s=10) == []  # its own already: never handed out twice


def test_a_silent_workers_items_become_orphans_and_a_renewing_ones_do_not(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    board.claim("t", "a", ["0|k1|0"], ttl_s=10)
    board.claim("t", "b", ["0|k2|0"], ttl_s=10)
    clock.advance(6)
    board.claim("t", "b", [], ttl_s=10)  # b's heartbeat
    clock.advance(6)
    granted, others, _ = board.orphans("t", "c", limit=10, ttl_s=10)
    assert granted == ["0|k1|0"]
    assert others == 1  # b still holds k2
    assert board.claim("t", "a", ["0|k1|0"], ttl_s=10) == []  # a came back too late: c has it


def test_an_item_written_is_never_granted_again(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    key = item_key(0, "q1", 1)
    board.claim("t", "a", [key], ttl_s=10)
    board.observe("t", written("q1", 1))
    clock.advance(60)
    assert board.orphans("t", "b", limit=10, ttl_s=10) == ([], 0, 0)
    assert board.claim("t", "b", [key], ttl_s=10) == []


def test_writes_to_tasks_without_leases_are_ignored(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    board.observe("other", written("q1", 0))
    board.open("t")
    board.observe("t", {"instance_id": "q1", "extra_info": {}})  # no plan's item: nothing to note
    board.observe("t", {"instance_id": "q1", "extra_info": "?"})
    assert board.tracked("t") == 0
    assert board.claim("other", "a", [item_key(0, "q1", 0)], ttl_s=1) == [item_key(0, "q1", 0)]


def test_the_services_own_worker_keeps_its_items_until_released(clock: FakeClock) -> None:
    """A job's worker past its expiry is hung, not gone: the service stops it before anyone
    else may make its items (else it could write them too, later)."""
    board = LeaseBoard(clock)
    board.own("t", "job-1/0.0")
    board.claim("t", "job-1/0.0", ["0|q1|0", "0|q1|1"], ttl_s=2)
    board.claim("t", "job-1/1.1", ["0|q2|0"], ttl_s=2)
    clock.advance(3)
    assert board.orphans("t", "job-1/1.1", limit=10, ttl_s=2)[0] == []
    assert board.expired("t") == ["job-1/0.0"]
    board.observe("t", written("q1", 0))  # it wrote one before it was stopped
    assert board.release("t", "job-1/0.0") == 1
    assert board.orphans("t", "job-1/1.1", limit=10, ttl_s=2)[0] == ["0|q1|1"]
    assert board.expired("t") == []


def test_orphans_keep_a_groups_repeats_together(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    keys = [item_key(0, q, r) for q in ("q2", "q1") for r in range(3)]
    board.claim("t", "a", keys, ttl_s=1)
    board.release("t", "a")
    granted, _, _ = board.orphans("t", "b", limit=3, ttl_s=1)
    assert granted == [item_key(0, "q1", r) for r in range(3)]
    granted, _, _ = board.orphans("t", "c", limit=2, ttl_s=1)  # the limit never splits a group
    assert granted == [item_key(0, "q2", r) for r in range(3)]


def test_a_new_run_starts_afresh_and_a_closed_one_leaves_the_next_alone(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    first = board.open("t")
    board.claim("t", "a", ["0|q1|0"], ttl_s=10)
    board.observe("t", written("q1", 0))
    second = board.open("t")  # a restart of the job: the same items are made again
    assert board.claim("t", "b", ["0|q1|0"], ttl_s=10) == ["0|q1|0"]
    board.close("t", first)
    assert board.claim("t", "c", ["0|q1|0"], ttl_s=10) == []  # still the second run's board
    board.close("t", second)
    board.observe("t", written("q1", 1))  # no board: ignored, nothing kept
    assert board.tracked("t") == 0


def test_the_board_forgets_each_epoch_once_it_is_made_and_never_grants_it_again(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    instances, repeats, epochs = 50, 4, 40
    plan = {str(epoch): instances * repeats for epoch in range(epochs)}
    peak = 0
    for epoch in range(epochs):
        keys = [item_key(epoch, f"q{i}", r) for i in range(instances) for r in range(repeats)]
        assert board.claim("t", "a", keys, ttl_s=10, plan=plan if epoch == 0 else None) == keys
        for i in range(instances):
            for r in range(repeats):
                board.observe("t", written(f"q{i}", r, epoch))
                peak = max(peak, board.tracked("t"))
        assert board.tracked("t") == 0  # the epoch is made: nothing of it is kept one by one
        assert board.claim("t", "b", keys, ttl_s=10) == []
    assert peak == instances  # one bit mask per instance of the epoch in progress, not per item
    assert board.orphans("t", "a", limit=10, ttl_s=10) == ([], 0, 0)


def test_the_board_counts_items_of_the_plan_nobody_claimed(clock: FakeClock) -> None:
    board = LeaseBoard(clock)
    board.claim("t", "a", ["0|q1|0"], ttl_s=10, plan={"0": 3})
    board.observe("t", written("q1", 0))
    board.claim("t", "a", ["0|q2|0"], ttl_s=10)
    assert board.orphans("t", "b", limit=10, ttl_s=10) == ([], 1, 1)  # q3 is nobody's yet


def _plan(instances: int = 12, repeats: int = 2, epochs: int = 2) -> Plan:
    rows = [{"instance_id": f"q{i}", "prompt": f"question {i}"} for i in range(instances)]
    return Plan(rows, num_repeat_per_sample=repeats, num_epoch=epochs, seed=1)


async def _work(
    board: LeaseBoard,
    plan: Plan,
    index: int,
    count: int,
    made: list[tuple[str, Sample]],
    *,
    stop_after: int | None = None,
    ttl_s: float = 30,
) -> None:
    """One worker: walks the plan as ``leased`` does, and writes each sample it is granted
    (here: the board observes it at once) unless it stops first."""
    name = f"w{index}"
    job = JobContext("job-1", "t", "g.py", {}, lease_board=board)
    leases: dict[str, Any] = {"worker": name, "index": index, "count": count, "chunk": 4, "ttl_s": ttl_s}
    try:
        with running(job):
            async with contextlib.aclosing(leased(plan, "t", leases)) as samples:
                async for sample in samples:
                    if stop_after is not None and len([m for m in made if m[0] == name]) >= stop_after:
                        return  # lost: what it was granted and has not written is still its own
                    await asyncio.sleep(0)
                    made.append((name, sample))
                    board.observe("t", written(str(sample.instance_id), sample.repeat, sample.epoch))
    finally:
        await _end_run(job)


async def _end_run(job: JobContext) -> None:
    """What the end of a run does to the tasks its generator left (the leases' heartbeat)."""
    for task in job.background:
        task.cancel()
    await asyncio.gather(*job.background, return_exceptions=True)


def _keys(made: list[tuple[str, Sample]]) -> Counter[str]:
    return Counter(item_key(s.epoch, s.instance_id, s.repeat) for _, s in made)


@pytest.mark.anyio
async def test_workers_make_every_item_once_between_them() -> None:
    board, plan, made = LeaseBoard(), _plan(), []
    await asyncio.gather(*(_work(board, plan, index, 3, made) for index in range(3)))
    keys = _keys(made)
    assert len(keys) == plan.total()
    assert set(keys.values()) == {1}
    assert len({name for name, _ in made}) == 3  # each did some


@pytest.mark.anyio
async def test_a_plan_of_millions_of_items_starts_at_once_and_tells_the_board_each_epoch_as_met() -> None:
    """slime asks for 100,000 epochs: 51 million items of 64 prompts. Reading them all before the
    first claim held a job's worker for minutes; the first sample comes with the first claim."""
    rows = [{"instance_id": f"q{i}", "prompt": "p"} for i in range(64)]
    plan = Plan(rows, num_repeat_per_sample=8, num_epoch=100_000)
    board = LeaseBoard()
    job = JobContext("job-1", "t", "g.py", {}, lease_board=board)
    leases: dict[str, Any] = {"worker": "w0", "index": 0, "count": 2, "chunk": 256, "ttl_s": 30}
    started = time.monotonic()
    try:
        with running(job):
            async with contextlib.aclosing(leased(plan, "t", leases)) as samples:
                taken = [sample async for sample in _first(samples, 600)]
    finally:
        await _end_run(job)
    assert time.monotonic() - started < 5
    assert len(taken) == 600
    # Three claims of 256 (a share's 32 groups an epoch), each telling its epoch's 512 items: the
    # board counts 3 x 512 of the plan, 768 of them held by w0 and 768 nobody's yet.
    assert board.orphans("t", "w1", limit=0, ttl_s=30) == ([], 768, 768)


async def _first(samples: AsyncIterator[Sample], count: int) -> AsyncIterator[Sample]:
    async for sample in samples:
        yield sample
        count -= 1
        if count == 0:
            return


@pytest.mark.anyio
async def test_a_released_workers_items_and_unclaimed_share_go_to_the_others() -> None:
    board, plan, made = LeaseBoard(), _plan(instances=20), []
    await _work(board, plan, 0, 2, made, stop_after=5)  # worker 0 is lost early
    assert board.release("t", "w0") > 0  # as the service does when its process is gone
    await _work(board, plan, 1, 2, made)
    keys = _keys(made)
    assert len(keys) == plan.total()
    assert set(keys.values()) == {1}


@pytest.mark.anyio
async def test_a_silent_remote_workers_items_are_taken_after_its_lease() -> None:
    board, plan, made = LeaseBoard(), _plan(instances=8), []
    await _work(board, plan, 0, 2, made, stop_after=3, ttl_s=0.2)
    await _work(board, plan, 1, 2, made, ttl_s=0.2)  # waits out w0's lease, then makes its items
    keys = _keys(made)
    assert len(keys) == plan.total()
    assert set(keys.values()) == {1}


@pytest.mark.anyio
async def test_a_worker_done_walking_keeps_what_it_has_in_flight_until_its_run_ends() -> None:
    """A long rollout outlasts the lease: its worker, done with the plan, still renews it."""
    board, plan = LeaseBoard(), _plan(instances=2, repeats=1, epochs=1)
    job = JobContext("job-1", "t", "g.py", {}, lease_board=board)
    with running(job):
        samples = [s async for s in leased(plan, "t", {"worker": "a", "ttl_s": 0.2, "chunk": 4})]
    assert len(samples) == 2  # granted; their trajectories are still being made
    await asyncio.sleep(0.5)  # more than the lease
    assert board.orphans("t", "b", limit=10, ttl_s=0.2)[0] == []
    await _end_run(job)  # the worker's run ends without writing them (it was lost)
    await asyncio.sleep(0.3)
    assert len(board.orphans("t", "b", limit=10, ttl_s=0.2)[0]) == 2


PROBE = """
import json
from buffer.toolkit.leased import BoardLeases, lease_client
TASK_TYPE = "probe"
START_ROLLOUT_FIELDS = ('probe_file',)

async def run_rollout(data):
    client = lease_client("probe", data["leases"])
    granted = await client.claim(["0|q1|0"], {"0": 1})
    with open(data["probe_file"], "w") as out:
        json.dump({"direct": isinstance(client, BoardLeases), "granted": granted}, out)
"""


def test_a_job_in_the_services_process_claims_from_the_board_itself(
    make_client: Callable[..., TestClient], generator_dir: Path, tmp_path: Path
) -> None:
    (generator_dir / "probe_generator.py").write_text(PROBE)
    client = make_client()
    probe = tmp_path / "probe.json"
    job = client.post("/start_rollout", json={"task_type": "probe", "probe_file": str(probe)}).json()["job"]
    deadline = time.monotonic() + 10
    while client.get(f"/jobs/{job['id']}").json()["data"]["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert json.loads(probe.read_text()) == {"direct": True, "granted": ["0|q1|0"]}


def test_the_lease_routes_take_the_plan_and_say_what_nobody_holds(client: TestClient) -> None:
    body = {"worker": "a", "offer": ["0|q1|0", "0|q1|1"], "ttl_s": 5, "plan": {"0": 4}}
    response = client.post("/tasks/math/leases", json=body)
    board = response.json()["data"]["board"]  # the identity of the task's board
    assert response.json()["data"] == {"granted": ["0|q1|0", "0|q1|1"], "board": board}
    response = client.post("/tasks/math/leases/orphans", json={"worker": "b", "limit": 10})
    assert response.json()["data"] == {"granted": [], "held_by_others": 2, "unmade": 2, "board": board}
    response = client.post("/tasks/math/leases", json={"worker": "a", "plan": {"0": -1}})
    assert response.status_code == 422


def test_a_lease_ttl_is_checked_before_a_job_starts(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    (generator_dir / "probe_generator.py").write_text(PROBE)
    client = make_client()
    for bad in (0, -1, 3601, "soon", True):
        response = client.post("/start_rollout", json={"task_type": "probe", "lease_ttl_s": bad})
        assert response.status_code == 422, bad
        assert response.json()["errors"][0]["field"] == "lease_ttl_s"
