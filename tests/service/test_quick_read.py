"""The write routes' quick way (orjson and a check of the shapes) takes what the pydantic schema
takes, and leaves to the schema whatever it refuses, so the answer names the field as before."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from buffer.errors import InvalidInput
from buffer.service import models
from buffer.service.models import TRAJECTORY, is_trajectory, parse_json, read_trajectories, read_trajectory


def _valid() -> dict[str, Any]:
    return {
        "instance_id": "q1",
        "uid": "u1",
        "messages": [
            {"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "2", "generated": True},
            {"role": "tool", "content": [{"type": "text", "text": "ok"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
        ],
        "reward": 0.5,
        "extra_info": {"epoch": 1, "big": 2**63 - 1},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "turns": [
            {
                "prompt_ids": [5, 6, 7],
                "output_ids": [8, 2**31 - 1],
                "output_logprobs": [-0.5, 0],
                "finish_reason": "stop",
                "message_index": 1,
                "weight_version": 3,
                "logprobs": "sampling",
                "sampling": {"temperature": 1.0, "skip_special_tokens": True},
            },
            {
                "prompt_ids": [],
                "prompt_offset": 5,
                "output_ids": [9],
                "finish_reason": "tool_calls",
                "message_index": 3,
            },
        ],
    }


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(item: dict[str, Any]) -> None:
        target: Any = item
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _drop(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def change(item: dict[str, Any]) -> None:
        target: Any = item
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return change


CHANGES = {
    "valid": lambda item: None,
    "named rewards": _set(("reward",), {"a": 1, "b": 0.5}),
    "integer reward": _set(("reward",), 1),
    "no uid": _drop(("uid",)),
    "null uid": _set(("uid",), None),
    "empty uid": _set(("uid",), ""),
    "integer id": _set(("instance_id",), 7),
    "boolean id": _set(("instance_id",), True),
    "id beyond 64 bits": _set(("instance_id",), 2**64),
    "boolean reward": _set(("reward",), True),
    "string reward": _set(("reward",), "1"),
    "no messages": _set(("messages",), []),
    "message without role": _drop(("messages", 0, "role")),
    "null content on a user message": _set(("messages", 0, "content"), None),
    "no content without tool calls": _drop(("messages", 3, "tool_calls")),
    "generated not a boolean": _set(("messages", 1, "generated"), 1),
    "content part without type": _set(("messages", 2, "content"), [{"text": "x"}]),
    "extra_info a list": _set(("extra_info",), []),
    "beyond 64 bits in extra_info": _set(("extra_info", "big"), 2**63),
    "below 64 bits in an unknown key": _set(("score",), [1, -(2**63) - 1]),
    "a huge float": _set(("extra_info", "x"), 1e300),
    "tool without type": _set(("tools",), [{"function": {}}]),
    "boolean token id": _set(("turns", 0, "prompt_ids"), [5, True, 7]),
    "zero and one ids": _set(("turns", 0, "prompt_ids"), [0, 1, 0]),
    "float token id": _set(("turns", 0, "output_ids"), [8, 9.0]),
    "token id 2**31": _set(("turns", 0, "output_ids"), [8, 2**31]),
    "negative token id": _set(("turns", 0, "prompt_ids"), [-1, 6, 7]),
    "boolean logprob": _set(("turns", 0, "output_logprobs"), [True, -0.5]),
    "string logprob": _set(("turns", 0, "output_logprobs"), ["x", -0.5]),
    "logprobs of another length": _set(("turns", 0, "output_logprobs"), [-0.5]),
    "unknown finish reason": _set(("turns", 0, "finish_reason"), "eos"),
    "unknown logprobs kind": _set(("turns", 0, "logprobs"), "other"),
    "offset past the tokens": _set(("turns", 1, "prompt_offset"), 99),
    "turn at a user message": _set(("turns", 1, "message_index"), 0),
    "negative message index": _set(("turns", 1, "message_index"), -1),
    "sampling a list": _set(("turns", 0, "sampling"), [1]),
    "no turns": _drop(("turns",)),
    "null turns": _set(("turns",), None),
    "turns a dict": _set(("turns",), {}),
}


def _schema(body: bytes) -> Any:
    try:
        return ("ok", TRAJECTORY.validate_json(body))
    except Exception:
        with pytest.raises(InvalidInput) as refused:
            parse_json(TRAJECTORY, body)
        return ("refused", refused.value.errors)


@pytest.mark.parametrize("name", CHANGES)
def test_the_quick_way_agrees_with_the_schema(name: str) -> None:
    item = copy.deepcopy(_valid())
    CHANGES[name](item)
    body = json.dumps(item).encode()  # orjson cannot write an integer beyond 64 bits
    verdict, expected = _schema(body)
    if verdict == "ok":
        assert read_trajectory(body) == expected
    else:
        assert not is_trajectory(json.loads(body)), "the quick way must leave it to the schema"
        with pytest.raises(InvalidInput) as refused:
            read_trajectory(body)
        assert refused.value.errors == expected


def test_a_valid_trajectory_takes_the_quick_way(monkeypatch: pytest.MonkeyPatch) -> None:
    def schema_not_asked(*args: Any) -> None:
        raise AssertionError("the schema was asked")

    monkeypatch.setattr(models, "parse_json", schema_not_asked)
    body = orjson.dumps(_valid())
    assert read_trajectory(body) == orjson.loads(body)
    assert read_trajectories(b"[" + body + b"," + body + b"]", batch=False) == [orjson.loads(body)] * 2
    assert read_trajectories(b'{"trajectories":[' + body + b"]}", batch=True) == [orjson.loads(body)]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"instance_id": "q", "messages": [{"role": "user", "content": "x"}], "reward": NaN}', "reward"),
        (b'{"instance_id": "q", "messages": [{"role": "user", "content": "x"}], "reward": 1e999}', "reward"),
        (b"", "body"),
    ],
)
def test_what_orjson_cannot_read_is_refused_by_the_schema_naming_the_field(body: bytes, field: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        read_trajectory(body)
    assert [error["field"] for error in refused.value.errors] == [field]


def test_a_batch_with_one_invalid_item_is_refused_naming_it() -> None:
    good, bad = _valid(), _valid()
    bad["turns"][0]["output_ids"] = [1, 2**31]
    with pytest.raises(InvalidInput) as refused:
        read_trajectories(orjson.dumps({"trajectories": [good, bad]}), batch=True)
    assert [error["field"] for error in refused.value.errors] == ["trajectories.1.turns.0.output_ids.1"]
