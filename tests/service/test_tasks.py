"""``PUT /tasks/{name}`` configures a task without a job; ``--strict-tasks`` refuses writes to
a task never configured instead of grouping them by the default group size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from tests.support.factories import group, trajectory, write_generator


def test_a_task_configured_without_a_job_groups_by_its_own_size(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(group_size=16)
    response = client.put("/tasks/remote", json={"num_repeat_per_sample": 2, "group_timeout_seconds": 30})
    assert response.status_code == 200, response.text
    assert response.json()["data"]["settings"]["group_size"] == 2
    for item in group("q1", [0.0, 1.0], task_type="remote"):
        assert client.post("/buffer/write", json=item).status_code == 200
    data = client.post("/get_rollout_data", json={"task_type": "remote"}).json()
    assert data["success"] is True
    assert len(data["data"]["data"]) == 2


def test_strict_mode_refuses_a_write_to_a_task_never_configured(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(strict_tasks=True)
    response = client.post("/buffer/write", json=trajectory(task_type="nobody"))
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "task_type"
    assert "PUT /tasks" in response.json()["errors"][0]["reason"]
    assert client.put("/tasks/nobody", json={"num_repeat_per_sample": 2}).status_code == 200
    assert client.post("/buffer/write", json=trajectory(task_type="nobody")).status_code == 200


def test_without_strict_mode_an_unknown_task_still_takes_the_default_group_size(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(group_size=3)
    assert client.post("/buffer/write", json=trajectory(task_type="guess")).status_code == 200


def test_hooks_come_from_the_generator_named(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(
        generator_dir,
        "keep_generator.py",
        'TASK_TYPE = "keep"\ndef run_rollout(data): pass\n'
        "def is_valid_group(group, min_valid_group_size, task_type):\n"
        "    return True, len(group[1]) >= min_valid_group_size\n",
    )
    client = make_client()
    response = client.put("/tasks/elsewhere", json={"num_repeat_per_sample": 2, "generator": "keep"})
    assert response.json()["data"]["hooks_overridden"] == ["is_valid_group"]
    for item in group("q1", [1.0, 1.0], task_type="elsewhere"):  # equal rewards: default hook drops it
        client.post("/buffer/write", json=item)
    assert client.post("/get_rollout_data", json={"task_type": "elsewhere"}).json()["success"] is True
    assert client.put("/tasks/x", json={"generator": "missing"}).status_code == 404
    assert client.put("/tasks/x", json={"group_size": 2}).status_code == 422  # a typo is not ignored


def test_a_task_refuses_a_timeout_the_data_folder_could_not_keep(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client()
    # What Python's json sends for float("inf"): the same rule as /start_rollout's.
    response = client.put(
        "/tasks/remote",
        content=b'{"group_timeout_seconds": Infinity}',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 422
    assert "group_timeout_seconds" in response.text
    assert "remote" not in client.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]
