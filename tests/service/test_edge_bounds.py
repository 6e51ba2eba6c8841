"""Nothing a client sends makes a 500 or grows the service without bound (issue 22): the lease
routes, the gateway's sessions and its chat calls refuse such input with a 422 naming the field,
before anything is held."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from buffer.errors import InvalidInput
from buffer.service.gateway import service as gateway_service
from buffer.service.gateway.sessions import MAX_METADATA_BYTES, MAX_SESSION_TIMEOUT_S
from buffer.workers import leases
from buffer.workers.leases import LeaseBoard

ENGINE = "http://127.0.0.1:9"  # never called: each body here is refused first


def fields(response: Any) -> list[str]:
    return [error["field"] for error in response.json()["errors"]]


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


def open_sessions(client: TestClient) -> int:
    return len(client.get("/gateway/sessions").json()["data"]["open"])


# -- leases ---------------------------------------------------------------------------------


def test_a_plan_past_64_bits_is_refused_and_later_orphan_claims_still_answer(client: TestClient) -> None:
    claim = {"worker": "w1", "offer": ["0|q|0"], "plan": {"0": 2**64}}
    response = client.post("/tasks/math/leases", json=claim)
    assert response.status_code == 422, response.text
    assert fields(response) == ["plan.0"]
    response = client.post("/tasks/math/leases/orphans", json={"worker": "w2"})
    assert response.status_code == 200, response.text
    assert response.json()["data"]["unmade"] == 0


def test_the_sizes_of_a_plan_are_summed_within_64_bits(client: TestClient) -> None:
    plan = {str(epoch): 2**32 for epoch in range(100)}
    assert client.post("/tasks/math/leases", json={"worker": "w1", "plan": plan}).status_code == 200
    response = client.post("/tasks/math/leases/orphans", json={"worker": "w2"})
    assert response.status_code == 200, response.text
    assert response.json()["data"]["unmade"] == 100 * 2**32


def test_a_work_item_name_past_its_length_is_refused(client: TestClient) -> None:
    response = client.post("/tasks/math/leases", json={"worker": "w1", "offer": ["0|" + "q" * 1000 + "|0"]})
    assert response.status_code == 422, response.text
    assert fields(response) == ["offer.0"]


def test_the_lease_board_holds_leases_of_a_bounded_number_of_tasks() -> None:
    board = LeaseBoard(max_tasks=2)
    board.claim("a", "w", ["0|q|0"], 30.0)
    board.claim("b", "w", ["0|q|0"], 30.0)
    with pytest.raises(InvalidInput, match="task_type"):
        board.claim("c", "w", ["0|q|0"], 30.0)
    with pytest.raises(InvalidInput, match="task_type"):
        board.orphans("c", "w", 10, 30.0)
    assert board.claim("a", "w", ["0|q|1"], 30.0) == ["0|q|1"]  # the tasks it has go on


def test_the_lease_board_holds_a_bounded_number_of_items_workers_and_epochs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leases, "MAX_ITEMS", 3)
    monkeypatch.setattr(leases, "MAX_WORKERS", 2)
    monkeypatch.setattr(leases, "MAX_EPOCHS", 2)
    board = LeaseBoard()
    assert board.claim("a", "w1", ["0|q|0", "0|q|1"], 30.0, {"0": 4}) == ["0|q|0", "0|q|1"]
    with pytest.raises(InvalidInput, match="offer"):
        board.claim("a", "w1", ["0|q|2", "0|q|3"], 30.0)
    with pytest.raises(InvalidInput, match="plan"):
        board.claim("a", "w1", [], 30.0, {"1": 4, "2": 4})
    board.claim("b", "w2", [], 30.0)
    with pytest.raises(InvalidInput, match="worker"):
        board.claim("a", "w3", [], 30.0)
    board.observe("a", {"instance_id": "q", "extra_info": {"epoch": 0, "repeat": 0}})
    assert board.claim("a", "w1", ["0|q|2"], 30.0) == ["0|q|2"]  # a made item frees its room


# -- sessions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({"n": 2**64}, "metadata.n"),
        ({"deep": nested(300)}, "metadata.deep"),
        ({"big": "x" * (MAX_METADATA_BYTES + 1)}, "metadata"),
    ],
)
def test_session_metadata_the_service_cannot_keep_is_refused_and_opens_nothing(
    client: TestClient, metadata: dict[str, Any], field: str
) -> None:
    body = {"task_type": "agent", "instance_id": "q", "remote_engine_url": ENGINE, "metadata": metadata}
    response = client.post("/sessions", json=body)
    assert response.status_code == 422, response.text
    assert fields(response)[0].startswith(field)
    assert open_sessions(client) == 0


def raw_open(client: TestClient, extra: str) -> Any:
    """POST /sessions with ``extra`` written as raw JSON (what ``json=`` cannot send)."""
    head = f'{{"task_type": "agent", "instance_id": "q", "remote_engine_url": "{ENGINE}", '
    return client.post("/sessions", content=head + extra + "}", headers={"content-type": "application/json"})


def test_a_lone_surrogate_in_session_metadata_is_refused_and_opens_nothing(client: TestClient) -> None:
    response = raw_open(client, '"metadata": {"s": "\\ud800"}')
    assert response.status_code == 422, response.text
    assert fields(response) == ["metadata.s"]
    assert open_sessions(client) == 0


@pytest.mark.parametrize("timeout", ["Infinity", "NaN", str(MAX_SESSION_TIMEOUT_S * 2), "0"])
def test_a_session_timeout_must_be_finite_and_bounded(client: TestClient, timeout: str) -> None:
    response = raw_open(client, f'"timeout_s": {timeout}')
    assert response.status_code == 422, response.text
    assert fields(response) == ["timeout_s"]
    assert open_sessions(client) == 0


def test_a_tasks_session_timeout_of_inf_still_expires() -> None:
    assert gateway_service._positive("inf") == MAX_SESSION_TIMEOUT_S
    assert gateway_service._positive("nan") is None
    assert gateway_service._positive("60") == 60.0


def test_a_chat_call_nested_past_the_journals_depth_is_refused_before_the_engine_is_asked(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(group_size=4)
    opened = client.post(
        "/sessions", json={"task_type": "agent", "instance_id": "q", "remote_engine_url": ENGINE}
    )
    assert opened.status_code == 200, opened.text
    session = opened.json()["data"]
    asked: list[Any] = []

    async def chat(urls: Any, body: Any, key: str) -> dict[str, Any]:
        asked.append(body)
        raise AssertionError("the engine must not be asked")

    monkeypatch.setattr(client.app.state.gateway.proxy, "chat", chat)  # type: ignore[attr-defined]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "extra": nested(300)}]}
    response = client.post(f"/sessions/{session['session_id']}/v1/chat/completions", json=body)
    assert response.status_code == 422, response.text
    assert fields(response)[0].startswith("messages.0.extra")
    assert asked == []
    assert client.get(f"/sessions/{session['session_id']}").json()["data"]["calls"] == 0
