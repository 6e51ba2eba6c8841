"""Generators that fail: one that raises, one that hangs, one whose hook raises on every group.

Each is a file in the generator folder, run through the API as the trainer runs it; in each
case the job says what happened, nothing already buffered is lost, and the service keeps
serving. (A sync generator that raises at once, and cancelling or restarting an async one
that waits, are in ``test_api.py`` and ``test_slime_defects.py``.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.support.calls import job_status, read, wait_for, write_all
from tests.support.factories import group, write_generator

pytestmark = pytest.mark.timeout(60)

# Writes one group of two into the service's buffer, then fails.
WRITES_THEN_RAISES = """
import asyncio
from buffer.toolkit import open_sink

TASK_TYPE = "crash"

async def write_a_group(data):
    sink = await open_sink(None)
    for reward in (0.0, 1.0):
        await sink.write({
            "instance_id": "before", "task_type": data["task_type"], "reward": reward,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        })

{run_rollout}
"""
RAISES_ASYNC = """
async def run_rollout(data):
    await write_a_group(data)
    raise RuntimeError("the reward model is gone")
"""
RAISES_SYNC = """
def run_rollout(data):
    asyncio.run(write_a_group(data))
    raise RuntimeError("the reward model is gone")
"""

# Never returns. The async one waits on nothing; the sync one ignores ``cancel_requested``
# and stops only when the test, tearing down, creates the file ``data["release"]`` names.
HANGS_ASYNC = """
import asyncio
TASK_TYPE = "hang"
START_ROLLOUT_FIELDS = ('release',)

async def run_rollout(data):
    await asyncio.Event().wait()
"""
HANGS_SYNC = """
import pathlib, time
TASK_TYPE = "hang"
START_ROLLOUT_FIELDS = ('release',)

def run_rollout(data):
    while not pathlib.Path(data["release"]).exists():
        time.sleep(0.02)
"""

NORMALISE_RAISES = """
from buffer.toolkit import open_sink

TASK_TYPE = "boom"

async def run_rollout(data):
    sink = await open_sink(None)
    for instance in ("a", "b", "c"):
        for reward in (0.0, 1.0):
            await sink.write({
                "instance_id": instance, "task_type": "boom", "reward": reward,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            })

def normalize_group_data(group, epsilon=1e-8, algo="grpo"):
    raise ValueError("cannot normalise " + str(len(group)) + " items")
"""


def job(client: TestClient, job_id: str) -> dict[str, Any]:
    """The job as ``GET /jobs`` lists it."""
    jobs = client.get("/jobs").json()["data"]["jobs"]
    (found,) = [j for j in jobs if j["id"] == job_id]
    return dict(found)


def still_serves(client: TestClient) -> None:
    """The service answers, and a group of another task goes in and comes out."""
    assert client.get("/health").status_code == 200
    write_all(client, group("other", [0.0, 1.0], task_type="other"))
    items = read(client, {"task_type": "other"})["data"]["data"]
    assert [item["instance_id"] for item in items] == ["other", "other"]


@pytest.fixture
def release(tmp_path: Path) -> Iterator[Path]:
    """A file whose creation lets a hanging sync generator's thread end, once the test is over."""
    path = tmp_path / "release"
    yield path
    path.touch()


@pytest.mark.parametrize("run_rollout", [RAISES_ASYNC, RAISES_SYNC], ids=["async", "sync"])
def test_a_generator_that_raises_fails_its_job_and_what_it_wrote_stays_readable(
    make_client: Callable[..., TestClient], generator_dir: Path, run_rollout: str
) -> None:
    write_generator(
        generator_dir, "crash_generator.py", WRITES_THEN_RAISES.replace("{run_rollout}", run_rollout)
    )
    client = make_client(group_size=2)
    job_id = client.post("/start_rollout", json={"task_type": "crash", "num_repeat_per_sample": 2}).json()[
        "job_id"
    ]
    wait_for(lambda: job_status(client, job_id) == "failed")

    failed = job(client, job_id)
    assert failed["error"] == "RuntimeError: the reward model is gone"
    assert failed["counters"]["written"] == 2
    assert failed["finished_at"] is not None
    items = read(client, {"task_type": "crash"})["data"]["data"]
    assert [(item["instance_id"], item["raw_reward"]) for item in items] == [("before", 0.0), ("before", 1.0)]
    still_serves(client)


@pytest.mark.parametrize("source", [HANGS_ASYNC, HANGS_SYNC], ids=["async", "sync"])
def test_a_hanging_generator_is_cancelled_or_replaced_through_the_api_while_the_service_serves(
    make_client: Callable[..., TestClient], generator_dir: Path, release: Path, source: str
) -> None:
    write_generator(generator_dir, "hang_generator.py", source)
    client = make_client(group_size=2)
    start = {"task_type": "hang", "release": str(release)}
    first = client.post("/start_rollout", json=start).json()["job_id"]
    assert job_status(client, first) == "running"
    still_serves(client)  # the hung generator holds nothing the service needs

    again = client.post("/start_rollout", json=start).json()
    assert (again["message"], again["job_id"]) == ("Rollout already running", first)
    second = client.post("/start_rollout", json={**start, "restart": True}).json()["job_id"]
    assert second != first
    assert job_status(client, first) == "cancelled"
    assert job_status(client, second) == "running"

    cancelled = client.post(f"/jobs/{second}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["data"]["status"] == "cancelled"
    assert [(j["id"], j["status"]) for j in client.get("/jobs").json()["data"]["jobs"]] == [
        (first, "cancelled"),
        (second, "cancelled"),
    ]
    assert client.post(f"/jobs/{second}/cancel").json()["data"]["status"] == "cancelled"  # idempotent
    still_serves(client)
    third = client.post("/start_rollout", json=start).json()
    assert third["message"] == "Rollout started"  # nothing of the task runs any more


def test_a_hook_that_raises_on_every_group_sets_each_aside_and_reads_never_fail(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(generator_dir, "boom_generator.py", NORMALISE_RAISES)
    client = make_client(group_size=2)
    job_id = client.post("/start_rollout", json={"task_type": "boom", "num_repeat_per_sample": 2}).json()[
        "job_id"
    ]
    wait_for(lambda: job_status(client, job_id) == "succeeded")  # the generator did its part

    aside = client.get("/buffer/set_aside", params={"task_type": "boom"}).json()["data"]["groups"]
    assert [(g["instance_id"], g["hook"], len(g["items"])) for g in aside] == [
        ("a", "normalize_group_data", 2),
        ("b", "normalize_group_data", 2),
        ("c", "normalize_group_data", 2),
    ]
    assert all("ValueError: cannot normalise 2 items" in g["error"] for g in aside)

    for body in ({"task_type": "boom"}, {"task_type": "boom", "wait_s": 0.2}, {}):
        response = client.post("/get_rollout_data", json=body)
        assert response.status_code == 200
        assert (response.json()["success"], response.json()["data"]["data"]) == (False, [])
    boom = client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]["boom"]
    assert (boom["total_written"], boom["set_aside_groups"], boom["delivered_groups"]) == (6, 3, 0)
    assert (boom["pending_groups"], boom["ready_groups"]) == (0, 0)

    # The next read that returns anything says which groups went and why.
    write_all(client, group("fine", [0.0, 1.0], task_type="fine"))
    result = read(client)
    assert [item["instance_id"] for item in result["data"]["data"]] == ["fine", "fine"]
    meta = result["data"]["meta_info"]
    assert meta["discarded_groups"] == {"hook_error:normalize_group_data": 3}
    assert sorted(meta["finished_groups"]) == ["a", "b", "c", "fine"]
    still_serves(client)


# Swallows the first cancellation and carries on for a while, as a careless retry loop does.
IGNORES_CANCEL = """
import asyncio
TASK_TYPE = "stubborn"

async def run_rollout(data):
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        await asyncio.sleep(60)
"""


def test_cancelling_a_generator_that_ignores_cancellation_does_not_hang(
    monkeypatch: pytest.MonkeyPatch, make_client: Callable[..., TestClient], generator_dir: Path
) -> None:  # monkeypatch first: undone last, after the service's shutdown has cancelled its job
    monkeypatch.setattr("buffer.service.jobs.CANCEL_WAIT_S", 0.2)
    write_generator(generator_dir, "stubborn_generator.py", IGNORES_CANCEL)
    client = make_client()
    job_id = client.post("/start_rollout", json={"task_type": "stubborn"}).json()["job_id"]
    wait_for(lambda: job_status(client, job_id) == "running")
    started = time.monotonic()
    cancelled = client.post(f"/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200
    assert time.monotonic() - started < 30  # not the minute the generator takes to give up
    assert job_status(client, job_id) == "cancelled"
    restarted = client.post("/start_rollout", json={"task_type": "stubborn"}).json()
    assert restarted["job_id"] != job_id  # the task is free to start again
