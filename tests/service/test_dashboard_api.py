"""The dashboard's JSON and /docs, through the app: incremental history, the viewer's groups."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from buffer.service.history import History
from tests.support.calls import write_all
from tests.support.factories import group


def test_data_since_sends_only_the_newer_history_samples(client: TestClient) -> None:
    history: History = client.app.state.services.history  # type: ignore[attr-defined]
    history._interval_s = 0.0  # every call samples
    write_all(client, group("q1", [0, 1, 0, 1]))
    first = history.sample(client.app.state.services.buffer)  # type: ignore[attr-defined]
    write_all(client, group("q2", [1, 1, 0, 0]))
    second = history.sample(client.app.state.services.buffer)  # type: ignore[attr-defined]
    assert first is not None
    assert second is not None
    everything = client.get("/dashboard/data").json()["history"]
    newer = client.get("/dashboard/data", params={"since": first["t"]}).json()["history"]
    assert len(everything) >= 2
    assert newer == [sample for sample in everything if sample["t"] > first["t"]]
    assert newer[-1]["tasks"]["default"]["reward_count"] == 8
    assert newer[-1]["tasks"]["default"]["reward_sum"] == 4.0


def test_the_viewer_lists_ready_groups_and_opens_one_with_its_token_records(client: TestClient) -> None:
    turn = {
        "prompt_ids": [1, 2, 3],
        "output_ids": [7, 8],
        "output_logprobs": [-0.5, -0.25],
        "finish_reason": "stop",
        "message_index": 1,
    }
    write_all(client, group("q1", [0, 1, 0, 1], task_type="math"))
    write_all(client, group("q2", [1, 0, 0, 0], task_type="math", turns=[turn]))
    listed = client.get("/dashboard/groups", params={"task_type": "math"}).json()["groups"]
    assert [(g["instance_id"], g["size"], g["raw_rewards"]) for g in listed] == [
        ("q2", 4, [1, 0, 0, 0]),
        ("q1", 4, [0, 1, 0, 1]),
    ]
    assert listed[0]["rewards"][0] > 1  # normalized within its group, as the trainer gets it
    opened = client.get("/dashboard/group", params={"task_type": "math", "instance_id": "q2"}).json()
    assert [t["raw_reward"] for t in opened["trajectories"]] == [1, 0, 0, 0]
    assert opened["trajectories"][0]["turns"][0]["output_ids"] == [7, 8]
    missing = client.get("/dashboard/group", params={"task_type": "math", "instance_id": "nope"})
    assert missing.status_code == 404
    unknown = client.get("/dashboard/groups", params={"task_type": "no-such-task"})
    assert unknown.status_code == 404


def test_docs_loads_swagger_ui_from_the_service_by_relative_urls(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "dashboard/static/vendor/swagger-ui/swagger-ui-bundle.js" in sources
    assert not [source for source in sources if "//" in source]  # nothing from another host
    for source in sources:
        if source.startswith("dashboard/"):
            asset = client.get("/" + source)
            assert asset.status_code == 200, source
            assert len(asset.content) > 100_000
    assert "url: 'openapi.json'" in page.text or '"openapi.json"' in page.text
    assert client.get("/redoc").status_code == 404  # ReDoc only exists on a CDN


def test_assets_outside_the_list_are_never_served(client: TestClient) -> None:
    assert client.get("/dashboard/static/vendor/uplot/LICENSE").status_code == 404
    assert client.get("/dashboard/static/../settings.py").status_code == 404
    assert client.get("/dashboard/static/vendor/uplot/uPlot.iife.min.js").status_code == 200
