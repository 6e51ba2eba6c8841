"""The write routes keep a trajectory's token lists as the bytes the client sent
(``buffer.service.token_bytes``): they take exactly what the schema takes, refuse what it refuses
naming the same field, and never decode the ids or logprobs of a trajectory they take."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from buffer.errors import InvalidInput
from buffer.service import models, token_bytes
from tests.service.test_quick_read import CHANGES, _schema, _valid
from tests.support.calls import read


def _stored(item: dict[str, Any]) -> Any:
    """What the buffer stores of a read trajectory, decoded (an integer beyond 64 bits in a key the
    schema does not name is refused when stored, naming it: as it was)."""
    try:
        return orjson.loads(orjson.dumps(item))
    except orjson.JSONEncodeError:
        return item


@pytest.mark.parametrize("name", CHANGES)
def test_it_agrees_with_the_schema(name: str) -> None:
    item = copy.deepcopy(_valid())
    CHANGES[name](item)
    body = json.dumps(item).encode()
    verdict, expected = _schema(body)
    if verdict == "ok":
        assert _stored(token_bytes.read_trajectory(body)) == expected
    else:
        with pytest.raises(InvalidInput) as refused:
            token_bytes.read_trajectory(body)
        assert refused.value.errors == expected


def _with_text(turn_field: str, text: bytes) -> bytes:
    """The valid trajectory with turn 0's ``turn_field`` written as ``text``."""
    body = orjson.dumps(_valid())
    before = orjson.dumps({turn_field: _valid()["turns"][0][turn_field]})[1:-1]
    assert body.count(before) == 1
    return body.replace(before, b'"%s":%s' % (turn_field.encode(), text))


@pytest.mark.parametrize(
    ("field", "text", "value"),
    [
        ("prompt_ids", b"[ 5,\n 6 ,7 ]", [5, 6, 7]),
        ("prompt_ids", b"[5,1234567890,7]", [5, 1234567890, 7]),  # ten digits, below 2**31
        ("output_logprobs", b"[-5e-1, 1E-400]", [-0.5, 0.0]),
        ("output_logprobs", b"[-0.5, 1e2]", [-0.5, 100.0]),  # a positive exponent: decoded and checked
        ("output_logprobs", b"[0, -1]", [0, -1]),
        ("output_ids", b"[8, 2147483647]", [8, 2**31 - 1]),
    ],
)
def test_numbers_written_any_valid_way_are_taken(field: str, text: bytes, value: list[Any]) -> None:
    body = _with_text(field, text)
    assert _stored(token_bytes.read_trajectory(body))["turns"][0][field] == value
    assert models.TRAJECTORY.validate_json(body)["turns"][0][field] == value


@pytest.mark.parametrize(
    ("field", "text", "where"),
    [
        ("prompt_ids", b"[5, [6], 7]", "turns.0.prompt_ids.1"),
        ("prompt_ids", b"[5, null, 7]", "turns.0.prompt_ids.1"),
        ("prompt_ids", b'[5, "6", 7]', "turns.0.prompt_ids.1"),
        ("prompt_ids", b"[5, 6.5, 7]", "turns.0.prompt_ids.1"),
        ("prompt_ids", b"[5, 9999999999, 7]", "turns.0.prompt_ids.1"),
        ("prompt_ids", b"[5, false, 7]", "turns.0.prompt_ids.1"),
        ("prompt_ids", b'{"a": 1}', "turns.0.prompt_ids"),
        ("output_logprobs", b"[-0.5, 1e999]", "turns.0.output_logprobs.1"),
        ("output_logprobs", b"[-0.5, 1E+400]", "turns.0.output_logprobs.1"),
        ("output_logprobs", b"[-0.5, -1" + b"0" * 400 + b"]", "turns.0.output_logprobs.1"),
        ("output_logprobs", b"[-0.5, true]", "turns.0.output_logprobs.1"),
        ("output_logprobs", b"[-0.5]", "turns.0.output_logprobs"),
    ],
)
def test_what_the_schema_refuses_is_refused_naming_the_field(field: str, text: bytes, where: str) -> None:
    body = _with_text(field, text)
    with pytest.raises(InvalidInput) as refused:
        token_bytes.read_trajectory(body)
    assert [error["field"] for error in refused.value.errors] == [where]


def test_a_trajectory_it_takes_is_never_decoded_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fallback to the whole-body parse, and the token lists are the client's bytes, kept."""

    def not_asked(*args: Any) -> None:
        raise AssertionError("decoded whole")

    monkeypatch.setattr(models, "read_trajectory", not_asked)
    monkeypatch.setattr(models, "read_trajectories", not_asked)
    item = _valid()
    item["turns"][0]["routed_experts"] = [[1, 2], [3, 4]]
    body = orjson.dumps(item)
    taken = token_bytes.read_trajectory(body)
    assert {key for key, value in taken["turns"][0].items() if isinstance(value, orjson.Fragment)} == {
        "prompt_ids",
        "output_ids",
        "output_logprobs",
        "routed_experts",
    }
    assert _stored(taken) == item
    assert [_stored(one) for one in token_bytes.read_trajectories(b"[" + body + b"]", batch=False)] == [item]
    batch = b'{"trajectories":[' + body + b"," + body + b"]}"
    assert [_stored(one) for one in token_bytes.read_trajectories(batch, batch=True)] == [item, item]


def test_a_key_the_schema_does_not_name_is_kept() -> None:
    item = {**_valid(), "score": {"a": 1}}
    assert _stored(token_bytes.read_trajectory(orjson.dumps(item))) == item


def test_a_batch_with_one_invalid_item_is_refused_naming_it() -> None:
    good, bad = _valid(), _valid()
    bad["turns"][0]["output_ids"] = [1, 2**31]
    with pytest.raises(InvalidInput) as refused:
        token_bytes.read_trajectories(orjson.dumps({"trajectories": [good, bad]}), batch=True)
    assert [error["field"] for error in refused.value.errors] == ["trajectories.1.turns.0.output_ids.1"]


def test_a_read_returns_the_token_lists_as_the_client_wrote_them(client: TestClient) -> None:
    """Stored, finished by the default hooks and read without being decoded: the read's bytes hold
    each array as the client spaced it (decoded and encoded again, it would read ``[5,6,7]``)."""
    spaced = b"[5,  6,   7]"
    for n in range(4):  # a group of 4
        item = {**_valid(), "uid": f"u{n}", "reward": n / 4}
        body = orjson.dumps(item).replace(b"[5,6,7]", spaced)
        answer = client.post("/buffer/write", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 200, answer.text
    response = client.post("/get_rollout_data", json={"batch_size": -1})
    assert response.content.count(spaced) == 4
    assert [item["turns"][0]["prompt_ids"] for item in response.json()["data"]["data"]] == [[5, 6, 7]] * 4
    assert read(client)["success"] is False  # all of it was read
