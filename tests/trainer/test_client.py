"""The trainer's client (``buffer/trainer/client.py``): against the real service in a subprocess, and
against answers mocked with respx for retries and polling. Every test runs twice, with the
sync client (in a worker thread) and with the async one (on the test's event loop)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
import respx

from buffer.processes import free_port, started, wait_ready
from buffer.trainer.client import (
    AsyncRolloutBufferClient,
    BufferRequestError,
    BufferUnavailableError,
    RolloutBatch,
    RolloutBufferClient,
)
from buffer.trainer.client.polling import LongPoll

pytestmark = pytest.mark.anyio

REWARDS = (0.0, 0.25, 0.5, 1.0)  # varied, so the default hooks keep the group
MOCK_URL = "http://buffer.test"
FAST: dict[str, Any] = {"backoff_s": 0.001, "max_backoff_s": 0.01}

GENERATORS = {
    "echo_generator.py": 'TASK_TYPE = "echo"\n\n\ndef run_rollout(data):\n    return None\n',
    "sleepy_generator.py": (
        'import asyncio\n\nTASK_TYPE = "sleepy"\n\n\n'
        "async def run_rollout(data):\n    await asyncio.sleep(60)\n"
    ),
}


class Client:
    """Either client behind one awaitable interface: ``await client.stats()``."""

    def __init__(self, kind: str, base_url: str, **options: Any) -> None:
        self.kind = kind
        self.sync = RolloutBufferClient(base_url, **options) if kind == "sync" else None
        self.async_ = AsyncRolloutBufferClient(base_url, **options) if kind == "async" else None

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if self.sync is not None:
            method = getattr(self.sync, name)

            async def in_thread(*args: Any, **kwargs: Any) -> Any:
                return await anyio.to_thread.run_sync(functools.partial(method, *args, **kwargs))

            return in_thread
        result: Callable[..., Awaitable[Any]] = getattr(self.async_, name)
        return result

    async def aclose(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.async_ is not None:
            await self.async_.aclose()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    result: str = request.param
    return result


@contextlib.asynccontextmanager
async def connect(kind: str, base_url: str = MOCK_URL, **options: Any) -> AsyncIterator[Client]:
    client = Client(kind, base_url, **options)
    try:
        yield client
    finally:
        await client.aclose()


# -- against the real service ----------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python buffer.py`` on a free loopback port, groups of 4, two trivial generators."""
    directory = tmp_path_factory.mktemp("client")
    generators = directory / "generator"
    generators.mkdir()
    for name, source in GENERATORS.items():
        (generators / name).write_text(source)
    port = free_port()
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generators), "--group-size", "4", "--log-level", "warning"]
    with started(command, "rollout buffer", directory / "buffer.log") as process:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", process, 60, "the rollout buffer")
        yield url


def new_task() -> str:
    """A task of its own for each test: the service is shared by the module."""
    return f"t-{uuid.uuid4().hex[:8]}"


async def write(url: str, task: str, instance_id: str, rewards: tuple[float, ...] = REWARDS) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        for reward in rewards:
            trajectory = {
                "instance_id": instance_id,
                "task_type": task,
                "messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}],
                "reward": reward,
            }
            response = await http.post("/buffer/write", json=trajectory)
            assert response.status_code == 200, response.text


async def test_a_read_returns_whole_groups_with_their_statistics(kind: str, service: str) -> None:
    task = new_task()
    for instance_id in ["a", "b", "c"]:
        await write(service, task, instance_id)
    async with connect(kind, service) as buffer:
        batch = await buffer.get_rollout_data(task_type=task)
        again = await buffer.get_rollout_data(task_type=task)
    assert batch.success
    assert [[item["instance_id"] for item in group] for group in batch.groups()] == [
        ["a"] * 4,
        ["b"] * 4,
        ["c"] * 4,
    ]
    assert batch.finished_groups == ["a", "b", "c"]
    assert batch.meta_info["total_samples"] == 12
    assert sorted(item["raw_reward"] for item in batch.groups()[0]) == list(REWARDS)
    assert not again.success
    assert again.items == []


async def test_batch_size_is_respected_in_whole_groups(kind: str, service: str) -> None:
    task = new_task()
    for instance_id in ["a", "b", "c"]:
        await write(service, task, instance_id)
    async with connect(kind, service) as buffer:
        first = await buffer.get_rollout_data(batch_size=6, task_type=task)
        rest = await buffer.get_rollout_data(batch_size=8, task_type=task)
        empty = await buffer.get_rollout_data(batch_size=8, task_type=task)
    assert [len(group) for group in first.groups()] == [4]  # 8 items would exceed 6
    assert [group[0]["instance_id"] for group in rest.groups()] == ["b", "c"]
    assert not empty.success


async def test_an_instance_repeated_back_to_back_comes_as_two_groups_in_two_reads(
    kind: str, service: str
) -> None:
    task = new_task()
    await write(service, task, "a", REWARDS * 2)  # a full group closes; the next 4 open another
    async with connect(kind, service) as buffer:
        first = await buffer.get_rollout_data(task_type=task)
        second = await buffer.get_rollout_data(task_type=task)
    # One read never holds two groups of an instance: slime's trainer would merge them.
    assert [len(group) for group in first.groups()] == [4]
    assert [len(group) for group in second.groups()] == [4]
    assert first.finished_groups == second.finished_groups == ["a"]


async def test_stats_count_what_was_written_pending_ready_and_read(kind: str, service: str) -> None:
    task = new_task()
    async with connect(kind, service) as buffer:
        before = await buffer.stats()
        await write(service, task, "full")
        await write(service, task, "half", (0.0, 1.0))
        written = await buffer.stats()
        await buffer.get_rollout_data(task_type=task)
        after = await buffer.stats()
    assert written.total_written - before.total_written == 6
    assert written.current_size - before.current_size == 4
    assert written.max_size == 1_000_000  # --max-buffered-trajectories
    assert written.tasks[task]["ready_groups"] == 1
    assert written.tasks[task]["pending_items"] == 2
    assert after.total_read - written.total_read == 4
    assert after.tasks[task]["delivered_groups"] == 1
    assert after.tasks[task]["ready_groups"] == 0


async def test_waiting_on_an_empty_buffer_returns_empty_after_wait_s(kind: str, service: str) -> None:
    task = new_task()
    await write(service, task, "a", (1.0,))  # the task exists; its group is not complete
    with respx.mock(using="httpx") as router:  # counts each request once, and sends it on
        reads = router.post(f"{service}/get_rollout_data").pass_through()
        async with connect(kind, service) as buffer:
            started_at = time.monotonic()
            batch = await buffer.get_rollout_data(task_type=task, wait_s=2)
            elapsed_s = time.monotonic() - started_at
    assert not batch.success
    assert batch.items == []
    assert reads.call_count == 1  # the service held the read for wait_s: nothing left to poll for
    assert 0 < sent(reads)["wait_s"] <= 2
    assert 1.9 <= elapsed_s < 20  # not the 30 s cap; the slack above is a busy machine's


async def test_waiting_returns_as_soon_as_a_group_is_ready(kind: str, service: str) -> None:
    task = new_task()
    await write(service, task, "a", (1.0,))

    async def complete_the_group() -> None:
        while not reads.called:  # noqa: ASYNC110 - a respx route has no event to wait on
            await anyio.sleep(0.01)
        await anyio.sleep(0.5)  # for the service to start holding the read
        await write(service, task, "a", (0.0, 0.25, 0.5))

    with respx.mock(using="httpx") as router:
        reads = router.post(f"{service}/get_rollout_data").pass_through()
        router.route().pass_through()  # the writes
        async with connect(kind, service) as buffer, anyio.create_task_group() as writers:
            writers.start_soon(complete_the_group)
            started_at = time.monotonic()
            batch = await buffer.get_rollout_data(task_type=task, wait_s=25)
            elapsed_s = time.monotonic() - started_at
    assert [len(group) for group in batch.groups()] == [4]
    assert reads.call_count == 1
    # Answered when the group was ready, not when the 25 s it was held for ran out; the slack
    # between 0.5 s and 20 s is a busy machine's.
    assert 0.5 <= elapsed_s < 20


async def test_an_unknown_task_raises_404_with_the_servers_message(kind: str, service: str) -> None:
    async with connect(kind, service) as buffer:
        with pytest.raises(BufferRequestError) as raised:
            await buffer.start_rollout("no-such-task")
    assert raised.value.status_code == 404
    assert raised.value.message == "task_type: no generator for 'no-such-task'; available tasks: echo, sleepy"
    assert raised.value.message in str(raised.value)
    assert f"{service}/start_rollout" in str(raised.value)


async def test_an_invalid_field_raises_422_naming_it(kind: str, service: str) -> None:
    async with connect(kind, service) as buffer:
        with pytest.raises(BufferRequestError) as raised:
            await buffer.get_rollout_data(batch_size=0)
    assert raised.value.status_code == 422
    assert [error["field"] for error in raised.value.errors] == ["batch_size"]


async def test_jobs_are_started_listed_and_cancelled(kind: str, service: str) -> None:
    async with connect(kind, service) as buffer:
        health = await buffer.health()
        echo = await buffer.start_rollout("echo", num_repeat_per_sample="4", restart=True)
        sleepy = await buffer.start_rollout("sleepy", num_repeat_per_sample="4")
        again = await buffer.start_rollout("sleepy")
        listed = await buffer.jobs()
        cancelled = await buffer.cancel_job(sleepy.job_id)
        looked_up = await buffer.job(sleepy.job_id)
        for _ in range(1200):  # the sync generator runs in a thread: it ends in a moment (or a minute)
            done = await buffer.job(echo.job_id)
            if done.status != "running":
                break
            await anyio.sleep(0.05)
        with pytest.raises(BufferRequestError) as unknown:
            await buffer.job("job-404")
    assert health["status"] == "ok"
    assert set(health["generators"]) == {"echo", "sleepy"}
    assert (sleepy.message, sleepy.task_type, sleepy.job.status) == ("Rollout started", "sleepy", "running")
    assert (again.message, again.job_id) == ("Rollout already running", sleepy.job_id)
    assert {echo.job_id, sleepy.job_id} <= {job.id for job in listed}
    assert cancelled.status == looked_up.status == "cancelled"
    assert looked_up.finished_at is not None
    assert (done.status, done.task_type, done.error) == ("succeeded", "echo", None)
    assert unknown.value.status_code == 404


# -- against mocked answers ------------------------------------------------------------


def answer(
    items: list[dict[str, Any]] | None = None, status_code: int = 200, **fields: Any
) -> httpx.Response:
    """A ``/get_rollout_data`` answer in the service's envelope."""
    body = {
        "success": bool(items),
        "message": "ok" if items else "No data available to read",
        "data": {"data": items or [], "meta_info": {}},
        **fields,
    }
    return httpx.Response(status_code, json=body)


def failure(status_code: int, message: str, **headers: str) -> httpx.Response:
    return httpx.Response(status_code, json={"success": False, "message": message}, headers=headers)


ITEMS = [{"instance_id": "a", "reward": 1.0, "messages": []}] * 2


def sent(route: respx.Route, call: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(route.calls[call].request.content)
    return body


@respx.mock
async def test_a_503_is_retried_until_it_succeeds(kind: str) -> None:
    overloaded = failure(503, "overloaded")
    route = respx.post(f"{MOCK_URL}/get_rollout_data").mock(
        side_effect=[overloaded, overloaded, answer(ITEMS)]
    )
    async with connect(kind, **FAST) as buffer:
        batch = await buffer.get_rollout_data(batch_size=2)
    assert batch.items == ITEMS
    assert route.call_count == 3
    assert sent(route) == {"batch_size": 2}


@respx.mock
async def test_a_429_waits_for_retry_after(kind: str) -> None:
    route = respx.get(f"{MOCK_URL}/health").mock(
        side_effect=[failure(429, "slow down", **{"Retry-After": "1"}), httpx.Response(200, json={"ok": 1})]
    )
    async with connect(kind, **FAST) as buffer:
        started_at = time.monotonic()
        health = await buffer.health()
        elapsed_s = time.monotonic() - started_at
    assert health == {"ok": 1}
    assert route.call_count == 2
    assert elapsed_s >= 0.95  # the backoff alone is at most 10 ms


@respx.mock
async def test_it_gives_up_after_max_attempts_with_the_last_status_and_message(kind: str) -> None:
    route = respx.get(f"{MOCK_URL}/buffer/stats").mock(return_value=failure(503, "overloaded"))
    async with connect(kind, max_attempts=3, **FAST) as buffer:
        with pytest.raises(BufferUnavailableError) as raised:
            await buffer.stats()
    assert route.call_count == 3
    assert (raised.value.status_code, raised.value.message) == (503, "overloaded")
    assert str(raised.value) == (
        f"GET {MOCK_URL}/buffer/stats failed after 3 attempts; last: HTTP 503: overloaded"
    )


@respx.mock
async def test_connection_errors_are_retried_then_reported(kind: str) -> None:
    route = respx.get(f"{MOCK_URL}/jobs").mock(side_effect=httpx.ConnectError("connection refused"))
    async with connect(kind, max_attempts=2, **FAST) as buffer:
        with pytest.raises(BufferUnavailableError) as raised:
            await buffer.jobs()
    assert route.call_count == 2
    assert raised.value.status_code is None
    assert "ConnectError: connection refused" in str(raised.value)


@respx.mock
async def test_a_422_raises_at_once_with_the_servers_errors(kind: str) -> None:
    errors = [{"field": "num_epoch", "reason": "Input should be greater than or equal to 1"}]
    refused = httpx.Response(
        422, json={"success": False, "message": f"num_epoch: {errors[0]['reason']}", "errors": errors}
    )
    route = respx.post(f"{MOCK_URL}/start_rollout").mock(return_value=refused)
    async with connect(kind, **FAST) as buffer:
        with pytest.raises(BufferRequestError) as raised:
            await buffer.start_rollout("math", num_epoch=0)
    assert route.call_count == 1
    assert sent(route) == {"task_type": "math", "num_epoch": 0}
    assert (raised.value.status_code, raised.value.errors) == (422, errors)
    assert raised.value.message == "num_epoch: Input should be greater than or equal to 1"


@respx.mock
async def test_the_api_key_is_sent_as_a_bearer_token(kind: str) -> None:
    route = respx.get(f"{MOCK_URL}/health").mock(return_value=httpx.Response(200, json={"status": "ok"}))
    async with connect(kind, api_key="s3cret") as buffer:
        await buffer.health()
    async with connect(kind) as anonymous:
        await anonymous.health()
    assert route.calls[0].request.headers["authorization"] == "Bearer s3cret"
    assert "authorization" not in route.calls[1].request.headers


@respx.mock
async def test_a_long_wait_is_sent_to_the_server_in_slices(kind: str) -> None:
    route = respx.post(f"{MOCK_URL}/get_rollout_data").mock(return_value=answer(ITEMS))
    async with connect(kind) as buffer:
        batch = await buffer.get_rollout_data(task_type="math", wait_s=45)
    assert batch.success
    assert sent(route) == {"task_type": "math", "wait_s": 30.0}


@respx.mock
async def test_a_server_that_does_not_long_poll_is_polled_with_growing_pauses(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent_at: list[float] = []
    pauses: list[float | None] = []
    pause_s = LongPoll.pause_s

    def spy(poll: LongPoll, asked_s: float, answered_in_s: float) -> float | None:
        pauses.append(pause_s(poll, asked_s, answered_in_s))
        return pauses[-1]

    monkeypatch.setattr(LongPoll, "pause_s", spy)

    def at_once(request: httpx.Request) -> httpx.Response:
        sent_at.append(time.monotonic())
        return answer()  # slime's buffer: success false at once, whatever wait_s says

    route = respx.post(f"{MOCK_URL}/get_rollout_data").mock(side_effect=at_once)
    async with connect(kind) as buffer:
        started_at = time.monotonic()
        batch = await buffer.get_rollout_data(wait_s=2.0)
        elapsed_s = time.monotonic() - started_at
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent_at)]
    assert not batch.success
    assert 1.95 <= elapsed_s < 12  # gave up at wait_s; the slack above is a busy machine's
    # 0.1 s, 0.2 s, 0.4 s, 0.8 s, then what remains of wait_s: about 6 requests, not hundreds
    assert 3 <= route.call_count <= 15
    assert pauses[:2] == [0.1, 0.2]  # the pauses grow
    *kept, last = pauses
    assert last is None
    assert all(pause is not None and gap >= pause - 0.005 for gap, pause in zip(gaps, kept, strict=True))


@respx.mock
async def test_polling_returns_the_data_once_it_comes(kind: str) -> None:
    route = respx.post(f"{MOCK_URL}/get_rollout_data").mock(side_effect=[answer(), answer(), answer(ITEMS)])
    async with connect(kind) as buffer:
        batch = await buffer.get_rollout_data(wait_s=5)
    assert batch.items == ITEMS
    assert route.call_count == 3


@respx.mock
async def test_the_async_client_polls_without_blocking_the_event_loop() -> None:
    respx.post(f"{MOCK_URL}/get_rollout_data").mock(return_value=answer())
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with AsyncRolloutBufferClient(MOCK_URL) as buffer, anyio.create_task_group() as ticker:
        ticker.start_soon(tick)
        await buffer.get_rollout_data(wait_s=2.0)
        ticker.cancel_scope.cancel()
    # ~200 when nothing blocks, and tens on a busy machine; a blocking sleep lets the ticker run
    # at most once between requests, about 6 times.
    assert ticks >= 20


def test_groups_split_on_instance_changes_and_on_group_size() -> None:
    def items(*ids: str) -> list[dict[str, Any]]:
        return [{"instance_id": instance_id} for instance_id in ids]

    def sizes(batch: RolloutBatch, group_size: int | None = None) -> list[int]:
        return [len(group) for group in batch.groups(group_size)]

    assert sizes(RolloutBatch(items=items("a", "a", "b", "b", "b"))) == [2, 3]
    assert sizes(RolloutBatch(items=items(*"aaaa"))) == [4]
    assert sizes(RolloutBatch(items=items(*"aaaa")), group_size=2) == [2, 2]
    assert sizes(RolloutBatch(items=items(*"aaaabb"), meta_info={"returned_groups": 3})) == [2, 2, 2]
    assert sizes(RolloutBatch(items=items(*"aaab"), meta_info={"returned_groups": 3})) == [3, 1]
    assert RolloutBatch().groups() == []
    assert not RolloutBatch().success


@respx.mock
async def test_by_default_it_rides_out_a_restart_of_the_buffer(kind: str) -> None:
    # Down for 8 s, as a restart on a data folder can be: longer than five attempts wait.
    back_at = time.monotonic() + 8.0

    def restarting(request: httpx.Request) -> httpx.Response:
        if time.monotonic() < back_at:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"success": True, "message": "ok", "data": {"jobs": []}})

    respx.get(f"{MOCK_URL}/jobs").mock(side_effect=restarting)
    async with connect(kind) as buffer:
        assert await buffer.jobs() == []
    assert time.monotonic() >= back_at


@respx.mock
async def test_the_retry_budget_is_a_time_and_can_be_set(kind: str) -> None:
    route = respx.get(f"{MOCK_URL}/jobs").mock(side_effect=httpx.ConnectError("connection refused"))
    started_at = time.monotonic()
    async with connect(kind, max_retry_s=1.0, **FAST) as buffer:
        with pytest.raises(BufferUnavailableError) as raised:
            await buffer.jobs()
    assert time.monotonic() - started_at < 30  # not the default minute; the slack is a busy machine's
    assert route.call_count > 5  # not a count of attempts: as many as fit in the time
    assert f"failed after {route.call_count} attempts" in str(raised.value)
