"""Limits that must hold under hostile or careless input: finite numbers, values the journal can
keep, the buffer's size under a huge batch, the number of tasks, the dashboard's history, the
metrics scrape, and one group of each instance per read."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.core.task import TaskSettings
from buffer.errors import BatchTooLarge, BufferFull, TooManyTasks
from buffer.service.app import create_app
from buffer.service.history import History
from buffer.service.metrics import BufferCollector
from buffer.service.settings import Settings
from tests.support.calls import read, write_all
from tests.support.factories import group, trajectory, write_generator

IDLE = 'TASK_TYPE = "idle"\nasync def run_rollout(data):\n    pass\n'
JSON = {"content-type": "application/json"}


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def start(client: TestClient, body: str) -> httpx.Response:
    """POST /start_rollout with the body as given: Python's json writes Infinity, NaN and
    lone surrogates as its ``dumps`` does, which is what a client sends."""
    return client.post("/start_rollout", content=body, headers=JSON)


def jobs(client: TestClient) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = client.get("/jobs").json()["data"]["jobs"]
    return listed


def refused_field(response: httpx.Response) -> str:
    assert response.status_code == 422, response.text
    fields = [error["field"] for error in response.json()["errors"]]
    assert len(fields) == 1, fields
    return fields[0]


# -- item 3 and 7: numbers and values the journal cannot keep ---------------------------------


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"group_timeout_seconds": float("inf")}, "group_timeout_seconds"),
        ({"group_timeout_seconds": float("nan")}, "group_timeout_seconds"),
        ({"sampling_params": {"temperature": float("nan")}}, "sampling_params.temperature"),
        ({"my_setting": [1.0, float("-inf")]}, "my_setting.1"),
        ({"seed": 2**64}, "seed"),
        ({"sampling_params": {"stop_token_ids": [-(2**63) - 1]}}, "sampling_params.stop_token_ids.0"),
        ({"note": "\ud800"}, "note"),
        ({"rollout_name": "run-\udfff"}, "rollout_name"),
    ],
)
def test_start_rollout_refuses_what_the_journal_cannot_keep_naming_the_field_before_any_job(
    make_client: Callable[..., TestClient],
    generator_dir: Path,
    tmp_path: Path,
    extra: dict[str, Any],
    field: str,
) -> None:
    write_generator(generator_dir, "idle_generator.py", IDLE)
    client = make_client(data_dir=tmp_path / "data")
    response = start(client, json.dumps({"task_type": "idle", **extra}))
    assert refused_field(response) == field
    assert jobs(client) == []
    started = start(client, json.dumps({"task_type": "idle"}))  # nothing blocks the task
    assert started.json()["message"] == "Rollout started"


def test_start_rollout_refuses_deep_nesting_naming_where(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(generator_dir, "idle_generator.py", IDLE)
    client = make_client()
    field = refused_field(
        start(client, json.dumps({"task_type": "idle", "sampling_params": {"x": nested(300)}}))
    )
    assert field.startswith("sampling_params.x.0.0")
    # Nesting Python's own parser cannot take is refused as it parses, and nothing starts.
    deeper = start(client, '{"task_type": "idle", "y": ' + "[" * 1000 + "]" * 1000 + "}")
    assert refused_field(deeper) == "body"
    assert "nested too deeply" in deeper.json()["message"]
    assert jobs(client) == []


def test_a_data_folder_starts_again_after_a_refused_infinite_timeout(
    make_client: Callable[..., TestClient], generator_dir: Path, tmp_path: Path
) -> None:
    write_generator(generator_dir, "idle_generator.py", IDLE)
    data_dir = tmp_path / "data"
    client = make_client(data_dir=data_dir)
    start(client, json.dumps({"task_type": "idle", "group_timeout_seconds": float("inf")}))
    client.__exit__(None, None, None)
    again = make_client(data_dir=data_dir)  # used to fail: the journal held a timeout of null
    assert again.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    ("body", "field"), [({"wait_s": float("nan")}, "wait_s"), ({"wait_s": float("inf")}, "wait_s")]
)
def test_reads_refuse_non_finite_waits(client: TestClient, body: dict[str, Any], field: str) -> None:
    response = client.post("/get_rollout_data", content=json.dumps(body), headers=JSON)
    assert refused_field(response) == field
    response = client.post("/buffer/read", content=json.dumps({"timeout": float("nan")}), headers=JSON)
    assert refused_field(response) == "timeout"


def test_a_trajectory_holding_infinity_or_nan_is_refused_naming_the_field(client: TestClient) -> None:
    item = trajectory("q1", extra_info={"score": float("inf")})
    response = client.post("/buffer/write", content=json.dumps(item), headers=JSON)
    assert refused_field(response) == "extra_info.score"
    batch = [trajectory("q2"), trajectory("q2", extra_info={"costs": [1.0, float("nan")]})]
    response = client.post("/buffer/write_batch", content=json.dumps(batch), headers=JSON)
    assert refused_field(response) == "1.extra_info.costs.1"
    wrapped = client.post("/buffer/write_batch", content=json.dumps({"trajectories": batch}), headers=JSON)
    assert refused_field(wrapped) == "trajectories.1.extra_info.costs.1"
    assert client.get("/buffer/stats").json()["data"]["data"][0]["total_written"] == 0
    # The words themselves, in text, are just text.
    fine = trajectory("q3", extra_info={"note": "NaN and Infinity"})
    assert client.post("/buffer/write", json=fine).status_code == 200


@pytest.mark.parametrize(
    "flag",
    [
        ["--group-timeout-seconds", "inf"],
        ["--export-retention-hours", "inf"],
        ["--export-retention-hours", "1e300"],
        ["--sweep-interval-s", "nan"],
        ["--header-timeout-seconds", "inf"],
    ],
)
def test_a_non_finite_flag_is_a_usage_error_naming_it(flag: list[str], tmp_path: Path) -> None:
    command = [sys.executable, "-m", "buffer", *flag, "--data-dir", str(tmp_path / "data"), "--port", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert f"rollout-buffer serve: {flag[0]} {flag[1]}:" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was made


@pytest.mark.parametrize(
    "field", ["group_timeout_seconds", "export_retention_hours", "sweep_interval_s", "header_timeout_seconds"]
)
def test_settings_refuse_non_finite_numbers(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"ROLLOUT_BUFFER_{field.upper()}", "inf")
    with pytest.raises(ValidationError, match=field):
        Settings()


# -- item 8: the buffer's limit under one huge batch -----------------------------------------


def filled(limit: int, held: int, group_size: int = 4) -> RolloutBuffer:
    """A buffer holding ``held`` trajectories in open groups of ``group_size``."""
    buffer = RolloutBuffer(TaskSettings(group_size=group_size), max_buffered=limit)
    items = [trajectory(f"held-{index // (group_size - 1)}", reward=index % 2) for index in range(held)]
    buffer.write_many(items)
    assert buffer.buffered_items() == held
    return buffer


def test_one_huge_batch_is_refused_whole_at_the_limit() -> None:
    buffer = filled(20_000, 19_996)
    batch = [trajectory(f"new-{index // 16}", reward=index % 2) for index in range(10_000)]
    with pytest.raises(BufferFull) as refused:
        buffer.write_many(batch)
    assert refused.value.adding == 10_000
    assert buffer.buffered_items() == 19_996  # all or none
    buffer.write_many(batch[:4])  # what fits is taken: exactly the limit
    assert buffer.buffered_items() == 20_000


def test_a_batch_larger_than_the_limit_itself_is_a_413_not_a_retry() -> None:
    buffer = filled(20_000, 0)
    with pytest.raises(BatchTooLarge):
        buffer.write_many([trajectory(f"new-{index}") for index in range(50_000)])
    assert buffer.buffered_items() == 0


def test_a_full_buffer_still_takes_what_fills_its_open_groups_but_not_beyond() -> None:
    buffer = filled(30, 30)  # ten open groups of 3 of 4
    fills = [trajectory(f"held-{index}", reward=1.0) for index in range(10)]
    buffer.write_many(fills)  # each open group lacks one: taken, and they finish
    assert buffer.buffered_items() == 40
    with pytest.raises(BufferFull):  # the groups are full now: the same instances open new ones
        buffer.write_many([trajectory("held-0")])
    # Duplicates add nothing.
    buffer.write_many(fills[:3])
    assert buffer.duplicates == 3


def test_write_batch_past_the_limit_gets_429_and_the_buffer_is_untouched(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(group_size=4, max_buffered_trajectories=100)
    write_all(client, [trajectory(f"a-{index}") for index in range(98)])
    batch = [trajectory(f"b-{index // 4}") for index in range(400)]
    response = client.post("/buffer/write_batch", json=batch)
    assert response.status_code == 413, response.text
    response = client.post("/buffer/write_batch", json=batch[:8])
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["adding"] == 8
    assert client.get("/buffer/stats").json()["data"]["data"][0]["pending_items"] == 98


def test_the_count_of_trajectories_held_follows_writes_and_reads() -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=2))
    buffer.write_many(group("a", [0.0, 1.0]) + group("b", [0.0, 1.0]) + [trajectory("c")])
    assert buffer.buffered_items() == 5
    buffer.read(max_items=2)
    assert buffer.buffered_items() == 3
    counted = sum(task.pending_items + task.ready_items for task in buffer._tasks.values())
    assert buffer.buffered_items() == counted


# -- item 9: tasks, history, metrics ----------------------------------------------------------


def test_past_max_tasks_a_new_task_type_is_refused_naming_the_field(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(generator_dir, "idle_generator.py", IDLE)
    client = make_client(group_size=2, max_tasks=2)
    write_all(client, [trajectory("q", task_type="one"), trajectory("q", task_type="two")])
    refused = client.post("/buffer/write", json=trajectory("q", task_type="three"))
    assert refused_field(refused) == "task_type"
    assert "--max-tasks" in refused.json()["message"]
    batch = [trajectory("q", task_type="one"), trajectory("q", task_type="four")]
    assert refused_field(client.post("/buffer/write_batch", json=batch)) == "1.task_type"
    assert refused_field(client.post("/start_rollout", json={"task_type": "idle"})) == "task_type"
    assert jobs(client) == []
    assert client.post("/buffer/write", json=trajectory("r", task_type="two")).status_code == 200
    assert sorted(client.get("/health").json()["tasks"]) == ["one", "two"]


def test_a_buffer_without_a_task_limit_takes_any_number() -> None:
    buffer = RolloutBuffer(max_tasks=0)
    buffer.write_many([trajectory("q", task_type=f"t{index}") for index in range(50)])
    assert len(buffer.task_types()) == 50
    limited = RolloutBuffer(max_tasks=3)
    with pytest.raises(TooManyTasks):
        limited.write_many([trajectory("q", task_type=f"t{index}") for index in range(4)])


def test_the_history_keeps_the_most_active_tasks_and_totals_over_all() -> None:
    clock = [0.0]
    history = History(keep=10, clock=lambda: clock[0], keep_tasks=3)
    buffer = RolloutBuffer(TaskSettings(group_size=2))
    for index in range(200):
        buffer.write(trajectory("q", task_type=f"t{index}"))
    buffer.write(trajectory("q2", task_type="t5"))
    sample = history.sample(buffer)
    assert sample is not None
    assert set(sample["tasks"]) == {"t5", "t199", "t198"}
    assert sample["total_written"] == 201
    assert sample["pending_groups"] == 201
    for step in range(1, 30):
        clock[0] = float(step)
        history.sample(buffer)
    assert len(history.snapshot()) == 10
    assert all(len(entry["tasks"]) <= 3 for entry in history.snapshot())


@pytest.fixture
async def app_client(generator_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(generator_dir=generator_dir, group_size=2))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://buffer") as client:
            yield client


@pytest.mark.anyio
async def test_a_slow_metrics_scrape_does_not_hold_up_other_requests(
    app_client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    collect = BufferCollector.collect
    collecting, released = threading.Event(), threading.Event()

    def slow_collect(self: BufferCollector) -> Any:
        collecting.set()
        released.wait(30)  # what 20,000 tasks cost, blocking: here until /health is answered
        return collect(self)

    monkeypatch.setattr(BufferCollector, "collect", slow_collect)
    scrape = asyncio.create_task(app_client.get("/metrics"))
    assert await asyncio.to_thread(collecting.wait, 30)  # the scrape is under way
    health = await app_client.get("/health")
    answered_behind_the_scrape = scrape.done()  # a scrape on the event loop holds it 30 s
    released.set()
    assert health.status_code == 200
    assert not answered_behind_the_scrape
    assert (await scrape).status_code == 200


# -- item 15: one group of each instance per read ---------------------------------------------


def test_a_read_returns_one_group_of_an_instance_and_keeps_the_order_otherwise() -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=2))
    # Two epochs of a and b, finishing a, a, b, c, b, a.
    for instance_id in ["a", "a", "b", "c", "b", "a"]:
        buffer.write_many(group(instance_id, [0.0, 1.0]))
    reads = [[g.instance_id for g in buffer.read().groups] for _ in range(4)]
    assert reads == [["a", "b", "c"], ["a", "b"], ["a"], []]


def test_batch_size_counts_only_the_groups_returned() -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=2))
    for instance_id in ["a", "a", "b", "c"]:
        buffer.write_many(group(instance_id, [0.0, 1.0]))
    assert [g.instance_id for g in buffer.peek(max_items=4)] == ["a", "b"]
    assert [g.instance_id for g in buffer.read(max_items=4).groups] == ["a", "b"]
    assert [g.instance_id for g in buffer.read().groups] == ["a", "c"]


def test_the_rule_holds_across_tasks_and_can_be_turned_off() -> None:
    buffer = RolloutBuffer(TaskSettings(group_size=2))
    buffer.write_many(group(0, [0.0, 1.0], task_type="x") + group(0, [0.0, 1.0], task_type="y"))
    assert [g.task_type for g in buffer.read().groups] == ["x"]
    assert [g.task_type for g in buffer.read().groups] == ["y"]
    free = RolloutBuffer(TaskSettings(group_size=2), one_group_per_instance=False)
    free.write_many(group("a", [0.0, 1.0]) + group("a", [0.0, 1.0]))
    assert len(free.read().groups) == 2


def test_slimes_trainer_merging_by_instance_never_sees_an_over_full_group(client: TestClient) -> None:
    # slime's select_rollout_data groups a read's items by instance_id and asserts each holds n.
    rewards = [0.0, 1.0, 0.0, 1.0]
    write_all(client, group("q", rewards) + group("q", rewards) + group("r", rewards))
    for _ in range(2):
        merged: dict[Any, int] = {}
        for item in read(client)["data"]["data"]:
            merged[item["instance_id"]] = merged.get(item["instance_id"], 0) + 1
        assert set(merged.values()) == {4}


def test_a_read_that_passed_groups_over_replays_the_same_after_a_restart(
    make_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    client = make_client(group_size=2, data_dir=data_dir)
    pair = [0.0, 1.0]
    write_all(
        client, group("a", pair) + group("a", pair) + group("b", pair) + group("c", pair, task_type="t")
    )
    first = [item["instance_id"] for item in read(client)["data"]["data"]]
    assert first == ["a", "a", "b", "b", "c", "c"]
    client.__exit__(None, None, None)
    again = make_client(group_size=2, data_dir=data_dir)
    rest = read(again)["data"]["data"]
    assert [item["instance_id"] for item in rest] == ["a", "a"]
    assert not read(again)["success"]


def test_a_data_folder_with_more_tasks_than_a_lower_limit_still_starts(
    make_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    client = make_client(group_size=2, data_dir=data_dir)
    write_all(client, [trajectory("q", task_type=f"t{index}") for index in range(5)])
    client.__exit__(None, None, None)
    again = make_client(group_size=2, data_dir=data_dir, max_tasks=3)
    assert len(again.get("/health").json()["tasks"]) == 5  # nothing restored is dropped
    assert refused_field(again.post("/buffer/write", json=trajectory("q", task_type="t9"))) == "task_type"
