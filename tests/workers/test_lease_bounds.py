"""The lease board holds what the service's bounds allow, whatever the claims (issue 22): the
tasks of --max-tasks, the characters of the items held, the epochs not yet made, each past its
bound refused with a 422 naming the field."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from buffer.errors import InvalidInput
from buffer.service.routes.tasks import MAX_KEY_CHARS
from buffer.workers import leases
from buffer.workers.leases import LeaseBoard
from tests.support.factories import trajectory


def fields(response: Any) -> list[str]:
    return [error["field"] for error in response.json()["errors"]]


def test_claims_for_more_task_names_than_max_tasks_are_refused_naming_the_field(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(group_size=2, max_tasks=3)
    board = client.app.state.services.jobs.leases  # type: ignore[attr-defined]
    for name in ("a", "b", "c"):
        assert (
            client.post(f"/tasks/{name}/leases", json={"worker": "w", "offer": ["0|q|0"]}).status_code == 200
        )
    for path in ("/tasks/d/leases", "/tasks/d/leases/orphans"):  # the board is full
        response = client.post(path, json={"worker": "w"})
        assert response.status_code == 422, response.text
        assert fields(response) == ["task_type"]
        assert "--max-tasks" in response.text
    assert len(board.task_types()) == 3


def test_a_claim_for_a_task_the_full_buffer_would_refuse_the_writes_of_is_refused(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(group_size=2, max_tasks=3)
    for name in ("x", "y", "z"):
        assert client.post("/buffer/write", json=trajectory("q", 1.0, task_type=name)).status_code == 200
    response = client.post("/tasks/e/leases", json={"worker": "w"})
    assert response.status_code == 422, response.text
    assert fields(response) == ["task_type"]
    assert client.post("/tasks/x/leases", json={"worker": "w"}).status_code == 200  # its own go on


def test_under_strict_tasks_a_claim_for_a_task_never_configured_is_refused(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(group_size=2, strict_tasks=True)
    response = client.post("/tasks/never/leases", json={"worker": "w", "offer": ["0|q|0"]})
    assert response.status_code == 422, response.text
    assert fields(response) == ["task_type"]
    assert client.put("/tasks/never", json={"num_repeat_per_sample": 2}).status_code == 200
    assert client.post("/tasks/never/leases", json={"worker": "w", "offer": ["0|q|0"]}).status_code == 200


def test_the_lease_board_takes_its_limit_from_the_services_max_tasks(
    make_client: Callable[..., TestClient],
) -> None:
    unlimited = make_client(group_size=2, max_tasks=0)
    board = unlimited.app.state.services.jobs.leases  # type: ignore[attr-defined]
    assert board._max_tasks == leases.MAX_TASKS  # no limit there: the board's own
    assert LeaseBoard(max_tasks=5)._max_tasks == 5


def test_a_task_whose_workers_are_all_gone_makes_room_for_a_new_one() -> None:
    now = [0.0]
    board = LeaseBoard(lambda: now[0], max_tasks=2)
    opened = board.open("job")  # a job's board stays, whoever is silent
    board.claim("job", "j", ["0|q|0"], 30.0)
    board.claim("a", "w", ["0|q|0"], 30.0)
    with pytest.raises(InvalidInput, match="task_type"):
        board.claim("b", "w", ["0|q|0"], 30.0)
    now[0] = 31.0  # every worker silent past its expiry
    assert board.claim("b", "w", ["0|q|0"], 30.0) == ["0|q|0"]
    assert sorted(board.task_types()) == ["b", "job"]
    board.close("job", opened)


def test_a_plans_epoch_names_are_numbers_not_long_strings(client: TestClient) -> None:
    response = client.post("/tasks/math/leases", json={"worker": "w", "plan": {"e" * 21: 4}})
    assert response.status_code == 422, response.text
    assert fields(response)[0].startswith("plan."), response.text


def test_the_characters_of_the_items_held_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "MAX_ITEM_CHARS", 30)
    board = LeaseBoard()
    assert board.claim("a", "w", ["0|" + "q" * 10 + "|0", "0|" + "r" * 10 + "|0"], 30.0) != []  # 28
    with pytest.raises(InvalidInput, match="offer"):
        board.claim("a", "w", ["0|s|0"], 30.0)
    board.release("a", "w")  # released, still held by the board
    with pytest.raises(InvalidInput, match="offer"):
        board.claim("a", "w", ["0|s|0"], 30.0)
    board.observe("a", {"instance_id": "q" * 10, "extra_info": {"epoch": 0, "repeat": 0}})
    assert board.claim("a", "w", ["0|s|0"], 30.0) == ["0|s|0"]  # a made item frees its room


def test_a_complete_epoch_gives_back_its_room_and_still_counts_as_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leases, "MAX_EPOCHS", 2)
    board = LeaseBoard()
    assert board.claim("a", "w", ["0|q|0", "0|q|1"], 30.0, {"0": 2, "1": 2}) == ["0|q|0", "0|q|1"]
    with pytest.raises(InvalidInput, match="plan"):
        board.claim("a", "w", [], 30.0, {"2": 2})
    for repeat in (0, 1):
        board.observe("a", {"instance_id": "q", "extra_info": {"epoch": 0, "repeat": repeat}})
    assert board.claim("a", "w", [], 30.0, {"2": 2}) == []  # epoch 0 made: room for 2
    assert board.orphans("a", "w2", 10, 30.0) == ([], 0, 4)  # epochs 1 and 2 unmade


def test_what_claims_can_make_the_board_hold_stays_bounded() -> None:
    """The claims that grew the service by 125 MB per 10 (long names, big plans), for ever new
    tasks and workers until refused: the board holds a few tens of MB at most."""
    board = LeaseBoard(max_tasks=1000)
    long = "q" * (MAX_KEY_CHARS - 20)
    tracemalloc.start()
    try:
        refused = 0
        for claim in range(20):  # half long names, half plans: each past its own bound
            offer = [f"0|{claim:03d}{i:05d}{long}|0" for i in range(10_000)] if claim % 2 else []
            plan = {} if claim % 2 else {str(claim * 10_000 + i): 2**32 for i in range(10_000)}
            try:
                board.claim(f"t{claim}", f"w{claim}", offer, 30.0, plan)
            except InvalidInput:
                refused += 1
            del offer, plan
        held_bytes, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused >= 2
    assert held_bytes < 64 * 2**20, f"{held_bytes / 2**20:.0f} MB"
