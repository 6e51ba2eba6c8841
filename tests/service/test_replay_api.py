"""The replay pool over HTTP (``buffer.core.replay_pool``): ``--replay-capacity`` and its
flags, ``/get_rollout_data``'s ``replay_ratio`` (checked like the other fields), the marks a
trainer sees, and the pool's metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.support.calls import read, write_all
from tests.support.factories import group


def metrics(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize(
    ("ratio", "reason"),
    [
        (1, "less than 1"),
        (-0.1, "greater than or equal to 0"),
        ("half", "valid number"),
        (None, "valid number"),
    ],
)
def test_a_bad_replay_ratio_is_a_422_naming_it(
    make_client: Callable[..., TestClient], ratio: Any, reason: str
) -> None:
    client = make_client(group_size=2, replay_capacity=4)
    response = client.post("/get_rollout_data", json={"replay_ratio": ratio})
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["field"] == "replay_ratio"
    assert reason in error["reason"]


def test_a_replay_ratio_while_the_pool_is_off_is_a_422_at_once(client: TestClient) -> None:
    response = client.post("/get_rollout_data", json={"replay_ratio": 0.5, "wait_s": 300})
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error == {
        "field": "replay_ratio",
        "reason": "the replay pool is off: start the service with --replay-capacity N",
    }


def test_reads_mix_replayed_groups_marked_and_counted(make_client: Callable[..., TestClient]) -> None:
    client = make_client(group_size=2, replay_capacity=4, replay_max_uses=1)
    write_all(client, group("a", [0, 1]) + group("b", [1, 0]))
    first = read(client, {})["data"]
    assert "replayed" not in first["meta_info"]  # no replay asked: the answer as before
    write_all(client, group("c", [0, 1]))
    answer = read(client, {"batch_size": 4, "replay_ratio": 0.5})["data"]
    data = answer["data"]
    assert [item["instance_id"] for item in data] == ["c", "c", "b", "b"]
    assert [item["extra_info"].get("replay", {}).get("uses") for item in data] == [None, None, 1, 1]
    assert answer["meta_info"]["replayed"] == 1
    assert answer["meta_info"]["returned_groups"] == 2
    (stats,) = client.get("/buffer/stats").json()["data"]["data"]
    assert stats["total_read"] == 6  # the replayed group is not a second delivery
    samples = metrics(client)
    task = (("task", "default"),)
    assert samples["rollout_buffer_replay_pool_groups", task] == 2  # a and c; b used up
    assert samples["rollout_buffer_groups_replayed_total", task] == 1
    assert samples["rollout_buffer_replay_pool_dropped_total", (("reason", "uses"), ("task", "default"))] == 1


def test_no_pool_metrics_while_it_is_off(client: TestClient) -> None:
    write_all(client, group("q", [0, 1, 0, 1]))
    read(client, {})
    assert not any("replay" in name for name, _ in metrics(client))
