"""The HTTP API in-process: shapes, validation, jobs and generators."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.support.calls import RECORDING, WAITING, job_status, read, wait_for, write_all
from tests.support.factories import group, trajectory, write_generator

# -- writing ---------------------------------------------------------------------------


def test_a_write_answers_with_the_uid_not_the_trajectory(client: TestClient) -> None:
    item = trajectory()
    body = client.post("/buffer/write", json=item).json()
    assert body == {
        "success": True,
        "message": "Data has been successfully written to buffer",
        "data": {"uid": item["uid"], "task_type": "default", "duplicate": False},
    }


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"instance_id": None}, "instance_id", "valid string"),
        ({"instance_id": ""}, "instance_id", "at least 1 character"),
        ({"reward": "high"}, "reward", "valid number"),
        ({"reward": True}, "reward", "valid number"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": "hello"}, "messages", "valid array"),
        ({"messages": [{"role": "user"}]}, "messages.0", "content may be null only on an assistant message"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
            "messages.1",
            "content may be null only on an assistant message with tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages.0.content.0.type",
            "required",
        ),
        ({"extra_info": []}, "extra_info", "an object"),
    ],
)
def test_bad_trajectories_get_a_422_naming_the_field(
    client: TestClient, change: dict[str, Any], field: str, reason: str
) -> None:
    item = {**trajectory(), **change}
    if change.get("instance_id") is None and "instance_id" in change:
        del item["instance_id"]
        reason = "required"
    response = client.post("/buffer/write", json=item)
    assert response.status_code == 422
    body = response.json()
    assert body["success"] is False
    fields = {error["field"]: error["reason"] for error in body["errors"]}
    assert field in fields, fields
    assert reason in fields[field]
    assert "Traceback" not in response.text


def test_valid_shapes_slime_generators_write_are_accepted(client: TestClient) -> None:
    tool_turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}],
    }
    multimodal = {
        "role": "user",
        "content": [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {}}],
    }
    items = [
        trajectory(instance_id=7, reward=1),  # integer id and reward
        trajectory(messages=[multimodal, tool_turn, {"role": "tool", "content": "2", "tool_call_id": "c1"}]),
        trajectory(reward={"accuracy": 1.0}),  # named rewards
        {
            k: v for k, v in trajectory().items() if k not in ("uid", "extra_info")
        },  # uid and extra_info optional
    ]
    write_all(client, items)


def test_bad_json_and_wrong_bodies_are_refused_clearly(client: TestClient) -> None:
    response = client.post(
        "/buffer/write", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "body"
    assert "Invalid JSON" in response.json()["message"]
    assert client.post("/buffer/write", content=b"").status_code == 422
    response = client.post("/buffer/write", json=[trajectory()])
    assert response.status_code == 422
    assert response.json()["errors"] == [{"field": "body", "reason": "Input should be an object"}]


def test_bad_input_touches_nothing_already_buffered(client: TestClient) -> None:
    write_all(client, group("q", [0, 1, 0]))
    assert client.post("/buffer/write", json={**trajectory("q"), "reward": "x"}).status_code == 422
    write_all(client, group("q", [1]))
    data = read(client)["data"]["data"]
    assert len(data) == 4


def test_unknown_keys_are_kept(client: TestClient) -> None:
    write_all(client, group("q", [0, 1, 0, 1], rollout_index=3, custom={"nested": [1]}))
    for item in read(client)["data"]["data"]:
        assert item["rollout_index"] == 3
        assert item["custom"] == {"nested": [1]}


def test_write_batch_is_all_or_nothing(client: TestClient) -> None:
    items = group("q", [0, 1, 0, 1])
    bad = [*items[:2], {**items[2], "reward": None}, items[3]]
    response = client.post("/buffer/write_batch", json=bad)
    assert response.status_code == 422
    assert [error["field"] for error in response.json()["errors"]] == ["2.reward"]
    assert client.get("/buffer/stats").json()["data"]["data"][0]["total_written"] == 0
    response = client.post("/buffer/write_batch", json={"trajectories": items})
    assert response.json()["data"]["written"] == 4
    assert response.json()["data"]["uids"] == [item["uid"] for item in items]
    again = client.post("/buffer/write_batch", json=items).json()["data"]
    assert (again["written"], again["duplicates"]) == (0, 4)
    assert len(read(client)["data"]["data"]) == 4


# -- reading ---------------------------------------------------------------------------


def test_get_rollout_data_accepts_no_body_an_empty_object_and_string_numbers(client: TestClient) -> None:
    empty = read(client)
    assert empty["success"] is False
    assert empty["data"]["data"] == []
    assert empty["data"]["meta_info"]["total_samples"] == 0
    assert read(client, {})["success"] is False
    write_all(client, group("a", [0, 1, 0, 1]) + group("b", [1, 0, 1, 0]))
    first = read(client, {"batch_size": "4"})
    assert [item["instance_id"] for item in first["data"]["data"]] == ["a"] * 4
    assert first["message"] == "Successfully read 4 items"
    assert [item["instance_id"] for item in read(client, {})["data"]["data"]] == ["b"] * 4


def test_reads_name_tasks_that_exist(client: TestClient) -> None:
    response = client.post("/get_rollout_data", json={"task_type": "nope"})
    assert response.status_code == 404
    assert "task_type: no generator for 'nope'" in response.json()["message"]
    assert client.post("/get_rollout_data", json={"batch_size": 0}).status_code == 422


def test_get_rollout_data_can_wait_for_a_group(client: TestClient) -> None:
    started = time.monotonic()
    assert read(client, {"wait_s": 0.3})["success"] is False
    assert time.monotonic() - started >= 0.3
    timer = threading.Timer(0.2, write_all, args=(client, group("q", [0, 1, 0, 1])))
    asked = time.monotonic()
    timer.start()
    body = read(client, {"wait_s": 60})
    timer.join()
    assert body["success"] is True
    assert time.monotonic() - asked < 60  # woken by the write, not at the end of its wait


def test_stats_keep_slime_shape_and_add_per_task_counters(client: TestClient) -> None:
    write_all(client, group("q", [0, 1, 0, 1]) + group("r", [1]))
    read(client)
    body = client.get("/buffer/stats").json()
    (counters,) = body["data"]["data"]
    assert {"current_size", "max_size", "total_written", "total_read"} <= set(counters)
    assert (counters["total_written"], counters["total_read"], counters["current_size"]) == (5, 4, 0)
    task = body["data"]["meta_info"]["tasks"]["default"]
    assert (task["pending_groups"], task["delivered_groups"]) == (1, 1)


def test_root_and_health(client: TestClient) -> None:
    assert client.get("/").json()["message"] == "Rollout Buffer Server is running"
    assert client.get("/health").json()["status"] == "ok"


def test_an_unexpected_error_is_a_500_without_a_traceback(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    client.app.state.services.buffer.stats = lambda: 1 / 0  # type: ignore[attr-defined]
    quiet = TestClient(client.app, raise_server_exceptions=False)
    response = quiet.get("/buffer/stats")
    assert response.status_code == 500
    assert response.json() == {
        "success": False,
        "message": "internal error; the service log has the details",
        "data": None,
    }


def test_the_openapi_schema_documents_the_trajectory(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/buffer/write"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/Trajectory"}
    assert {"instance_id", "messages", "reward"} <= set(
        schema["components"]["schemas"]["Trajectory"]["required"]
    )
    assert "ChatMessage" in schema["components"]["schemas"]


# -- rollouts, generators and jobs ------------------------------------------------------


def test_start_rollout_runs_the_generator_with_normalised_data(
    make_client: Callable[..., TestClient], generator_dir: Path, tmp_path: Path
) -> None:
    write_generator(generator_dir, "math_generator.py", RECORDING.format(task="math"))
    client = make_client()
    record = tmp_path / "data.json"
    payload = {
        "task_type": "math",
        "num_repeat_per_sample": "8",
        "num_process": "100",
        "num_epoch": "3",
        "max_tokens": "1024",
        "sampling_params": {"max_tokens": 1024, "temperature": 0.8},
        "skip_instance_ids": [1, "q2"],
        "record_to": str(record),
    }
    response = client.post("/start_rollout", json=payload)
    assert response.status_code == 200
    body = response.json()
    assert body["message"] == "Rollout started"
    wait_for(lambda: job_status(client, body["job_id"]) == "succeeded")
    data = json.loads(record.read_text())
    assert (data["num_repeat_per_sample"], data["num_process"], data["num_epoch"]) == (8, 100, 3)
    assert data["remote_buffer_url"] == "http://127.0.0.1:8889"
    assert data["group_timeout_seconds"] == 300
    assert data["min_timeout_group_size_ratio"] == 0.7
    assert data["skip_instance_ids"] == [1, "q2"]
    assert data["thread"] == body["job_id"]  # a thread of its own, not the event loop's
    assert client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]["math"]["group_size"] == 8


def test_a_generator_added_while_running_is_found(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    client = make_client()
    assert client.get("/generators").json()["data"]["generators"] == []
    write_generator(generator_dir, "late_generator.py", RECORDING.format(task="late"))
    listed = client.get("/generators").json()["data"]["generators"]
    assert [g["task_type"] for g in listed] == ["late"]


def test_a_job_can_be_cancelled(make_client: Callable[..., TestClient], generator_dir: Path) -> None:
    write_generator(generator_dir, "waiting_generator.py", WAITING)
    client = make_client()
    job_id = client.post("/start_rollout", json={"task_type": "waiting"}).json()["job_id"]
    cancelled = client.post(f"/jobs/{job_id}/cancel").json()
    assert cancelled["data"]["status"] == "cancelled"
    assert cancelled["data"]["finished_at"] is not None
    assert client.get("/jobs/job-404").status_code == 404


def test_a_failing_generator_is_recorded_and_the_service_keeps_serving(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(
        generator_dir,
        "crash_generator.py",
        'TASK_TYPE = "crash"\ndef run_rollout(data):\n    raise RuntimeError("engine unreachable")\n',
    )
    client = make_client()
    job_id = client.post("/start_rollout", json={"task_type": "crash"}).json()["job_id"]
    wait_for(lambda: job_status(client, job_id) == "failed")
    job = client.get(f"/jobs/{job_id}").json()["data"]
    assert job["error"] == "RuntimeError: engine unreachable"
    assert job["where"] == "generator/crash_generator.py:3 in run_rollout"
    assert "traceback" not in job
    assert client.get("/health").status_code == 200


def test_generators_endpoint_lists_tasks_and_load_errors(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(
        generator_dir,
        "math_generator.py",
        RECORDING.format(task="math") + "\ndef normalize_group_data(group):\n    return group\n",
    )
    write_generator(generator_dir, "bad_generator.py", "TASK_TYPE = 'bad'\n")
    data = make_client().get("/generators").json()["data"]
    assert [(g["task_type"], g["hooks_overridden"]) for g in data["generators"]] == [
        ("math", ["normalize_group_data"])
    ]
    assert [(e["task_type"], e["kind"], e["error"]) for e in data["errors"]] == [
        ("bad", "contract", "does not define run_rollout(data)")
    ]


def test_a_task_first_met_through_a_write_uses_its_generator_hooks(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(
        generator_dir,
        "keepall_generator.py",
        'TASK_TYPE = "keepall"\ndef run_rollout(data):\n    pass\n'
        "def is_valid_group(group, min_valid_group_size, task_type):\n    return True\n",
    )
    client = make_client(group_size=2)
    write_all(client, group("q", [1, 1], task_type="keepall"))  # equal rewards: the default would discard
    assert len(read(client, {"task_type": "keepall"})["data"]["data"]) == 2


WRITES_ITS_TASK = """
from buffer.toolkit import open_sink

TASK_TYPE = "math"

async def run_rollout(data):
    # every instance gets equal rewards: a training run discards such groups, an evaluation keeps them
    sink = await open_sink(None)  # in the service: straight into its buffer
    for instance in ("a", "b"):
        for _ in range(data["num_repeat_per_sample"]):
            await sink.write({
                "instance_id": instance, "task_type": data["task_type"], "reward": 1.0,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            })
"""


def test_one_generator_runs_for_training_and_for_evaluation_side_by_side(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(generator_dir, "math_generator.py", WRITES_ITS_TASK)
    client = make_client()
    train = client.post("/start_rollout", json={"task_type": "math", "num_repeat_per_sample": "2"}).json()
    evaluation = client.post(
        "/start_rollout",
        json={
            "task_type": "math",
            "rollout_name": "eval-math",
            "evaluation": True,
            "num_repeat_per_sample": "3",
        },
    ).json()
    assert (train["task_type"], evaluation["task_type"]) == ("math", "eval-math")
    assert evaluation["job_id"] != train["job_id"]  # not "already running": another name
    for job in (train, evaluation):
        wait_for(lambda job=job: job_status(client, job["job_id"]) == "succeeded")
    assert read(client, {"task_type": "math"})["success"] is False  # equal rewards: discarded
    kept = read(client, {"task_type": "eval-math"})["data"]["data"]
    assert [(item["instance_id"], item["reward"]) for item in kept] == [("a", 1.0)] * 3 + [("b", 1.0)] * 3
    assert all("raw_reward" not in item for item in kept)  # not normalised, not padded
