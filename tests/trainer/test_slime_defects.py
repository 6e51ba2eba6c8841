"""One test for each defect of slime's rollout buffer listed in CONTRACT.md: we keep slime's
shapes and do the right thing instead.

Losing everything on a crash or restart, and listening unauthenticated on every interface,
belong to the durability and authentication work and are tested there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tests.support.calls import RECORDING, WAITING, job_status, read, wait_for, write_all
from tests.support.factories import group, trajectory, write_generator


def test_start_rollout_keeps_everything_buffered(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(generator_dir, "math_generator.py", WAITING.replace('"waiting"', '"math"'))
    write_generator(generator_dir, "code_generator.py", WAITING.replace('"waiting"', '"code"'))
    client = make_client(group_size=4)
    write_all(client, group("ready", [0, 1, 0, 1]) + group("open", [0, 1]))
    client.post("/start_rollout", json={"task_type": "math", "num_repeat_per_sample": "4"})
    client.post("/start_rollout", json={"task_type": "code", "num_repeat_per_sample": "2"})
    write_all(client, group("open", [1, 0], task_type="default"))
    returned = {item["instance_id"] for item in read(client)["data"]["data"]}
    assert returned == {"ready", "open"}


def test_a_second_start_returns_the_running_job_instead_of_a_second_generator(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(generator_dir, "waiting_generator.py", WAITING)
    client = make_client()
    first = client.post("/start_rollout", json={"task_type": "waiting"}).json()
    again = client.post("/start_rollout", json={"task_type": "waiting"}).json()
    assert again["message"] == "Rollout already running"
    assert again["job_id"] == first["job_id"]
    restarted = client.post("/start_rollout", json={"task_type": "waiting", "restart": True}).json()
    assert restarted["job_id"] != first["job_id"]
    assert job_status(client, first["job_id"]) == "cancelled"
    assert [job["status"] for job in client.get("/jobs").json()["data"]["jobs"]] == ["cancelled", "running"]


def test_start_rollout_refuses_unknown_and_broken_tasks_instead_of_saying_started(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(generator_dir, "math_generator.py", RECORDING.format(task="math"))
    write_generator(
        generator_dir, "search_generator.py", 'TASK_TYPE = "search"\nraise ValueError("bad config")\n'
    )
    client = make_client()
    unknown = client.post("/start_rollout", json={"task_type": "chess"})
    assert unknown.status_code == 404
    assert unknown.json()["available_tasks"] == ["math"]
    broken = client.post("/start_rollout", json={"task_type": "search"})
    assert broken.status_code == 409
    assert "ValueError: bad config" in broken.json()["message"]
    invalid = client.post("/start_rollout", json={"task_type": "math", "num_repeat_per_sample": "many"})
    assert invalid.status_code == 422
    assert invalid.json()["errors"][0]["field"] == "num_repeat_per_sample"
    assert client.post("/start_rollout", json={}).json()["errors"][0]["field"] == "task_type"


def test_a_read_never_deletes_groups_it_does_not_return(client: TestClient) -> None:
    for name in ["a", "b", "c"]:
        write_all(client, group(name, [0, 1, 0, 1]))
    seen = []
    for _ in range(3):
        data = read(client, {"batch_size": 4})["data"]["data"]
        seen.append({item["instance_id"] for item in data})
    assert seen == [{"a"}, {"b"}, {"c"}]


def test_peek_works_and_leaves_the_groups(client: TestClient) -> None:
    assert client.get("/buffer/peek").json()["success"] is False
    write_all(client, group("q", [0, 1, 0, 1]))
    peeked = client.get("/buffer/peek", params={"batch_size": 4}).json()
    assert peeked["success"] is True
    assert len(peeked["data"]["data"]) == 4
    assert len(read(client)["data"]["data"]) == 4


def test_a_waiting_read_does_not_stall_other_requests(client: TestClient) -> None:
    results: dict[str, Any] = {}

    def long_poll() -> None:
        response = client.post("/buffer/read", json={"batch_size": 4, "timeout": 60, "wait": True})
        results["body"] = response.json()

    poller = threading.Thread(target=long_poll, daemon=True)
    poller.start()
    ready = client.app.state.services.ready  # type: ignore[attr-defined]
    wait_for(lambda: ready._waiters, what="the read to wait")
    for _ in range(10):
        assert client.get("/buffer/stats").status_code == 200
    # slime's read holds every request for its timeout: these would have come after it.
    assert "body" not in results
    write_all(client, group("q", [0, 1, 0, 1]))
    poller.join(timeout=30)  # woken by the write, long before its 60 s
    assert not poller.is_alive()
    assert results["body"]["success"] is True
    assert len(results["body"]["data"]["data"]) == 4


def test_a_malformed_trajectory_is_refused_and_later_reads_still_work(client: TestClient) -> None:
    write_all(client, group("q", [0, 1, 0]))
    non_numeric = client.post("/buffer/write", json={**trajectory("q"), "reward": "1.0"})
    null_content = client.post(
        "/buffer/write",
        json={
            **trajectory("q"),
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
        },
    )
    assert (non_numeric.status_code, null_content.status_code) == (422, 422)
    write_all(client, group("q", [1]))
    for _ in range(2):
        response = client.post("/get_rollout_data", json={})
        assert response.status_code == 200
    write_all(client, group("r", [0, 1, 0, 1]))
    assert len(read(client)["data"]["data"]) == 4


def test_a_group_that_never_completes_times_out(make_client: Callable[..., TestClient]) -> None:
    client = make_client(group_size=4, group_timeout_seconds=0.3, sweep_interval_s=0.05)
    write_all(client, group("stuck", [1]))  # 1 of 4: discarded; times out first
    write_all(client, group("slow", [0, 1, 1]))  # 3 of 4 >= 0.7: kept and padded
    body = wait_for(lambda: (r := read(client))["success"] and r)
    assert [item["instance_id"] for item in body["data"]["data"]] == ["slow"] * 4
    assert sorted(body["data"]["meta_info"]["finished_groups"]) == ["slow", "stuck"]


def test_finished_groups_lists_every_group_returned_or_discarded(client: TestClient) -> None:
    write_all(client, group("kept", [0, 1, 0, 1]) + group("equal", [1, 1, 1, 1]) + group("open", [0]))
    meta = read(client)["data"]["meta_info"]
    assert sorted(meta["finished_groups"]) == ["equal", "kept"]
    assert meta["discarded_groups"] == {"invalid_group": 1}


def test_a_group_is_never_over_full(client: TestClient) -> None:
    write_all(client, group("q", [0, 1, 0, 1, 1, 0]))
    data = read(client)["data"]["data"]
    assert len(data) == 4  # the trainer asserts exactly n samples per group


def test_padding_copies_get_their_own_uids(client: TestClient) -> None:
    write_all(client, group("q", [0, 1, 1, -1]))  # the failed item is filtered, then the group padded
    data = read(client)["data"]["data"]
    assert len(data) == 4
    assert len({item["uid"] for item in data}) == 4


def test_a_retried_write_is_counted_once(client: TestClient) -> None:
    items = group("q", [0, 1, 0, 1])
    write_all(client, items + items[:2])
    assert client.get("/buffer/stats").json()["data"]["data"][0]["total_written"] == 4
    assert len(read(client)["data"]["data"]) == 4


def test_a_failing_hook_sends_no_traceback_to_the_client(
    make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    write_generator(
        generator_dir,
        "boom_generator.py",
        'TASK_TYPE = "boom"\ndef run_rollout(data):\n    pass\n'
        "def normalize_group_data(group):\n    raise KeyError('secret internals')\n",
    )
    client = make_client(group_size=2)
    write_all(client, group("q", [0, 1], task_type="boom"))
    response = client.post("/get_rollout_data", json={"task_type": "boom"})
    assert response.status_code == 200
    assert "Traceback" not in response.text
    assert "secret internals" not in response.text
    set_aside = client.get("/buffer/set_aside")
    assert "Traceback" not in set_aside.text
    (aside,) = set_aside.json()["data"]["groups"]
    assert aside["hook"] == "normalize_group_data"
    assert aside["where"] == "generator/boom_generator.py:5 in normalize_group_data"
    assert len(aside["items"]) == 2
