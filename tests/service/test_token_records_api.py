"""Token records (``turns``, ``tools``, ``reasoning_content``, ``generated``) through the HTTP API.

Written against the API only, so they hold whatever store keeps the buffer: refused with a 422 naming
the field and the reason, and otherwise stored, restored after a restart, exported and read back unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from buffer.service.app import create_app
from buffer.service.settings import Settings
from buffer.trainer.samples import samples_from_turns
from tests.support.calls import read, write_all
from tests.support.factories import trajectory

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def recorded(instance_id: str = "q1", reward: float = 0.5) -> dict[str, Any]:
    """A two-turn tool-using trajectory with its token records, as the toolkit writes it."""
    return trajectory(
        instance_id,
        reward,
        messages=[
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 12 * 7?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Multiply.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'},
                    }
                ],
                "generated": True,
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "84"},
            {"role": "assistant", "content": "\\boxed{84}", "generated": True},
        ],
        tools=TOOLS,
        turns=[
            {
                "prompt_ids": [151644, 8948, 198, 0, 2**31 - 1],
                "output_ids": [151657, 515, 151658],
                "output_logprobs": [-0.10000000000000001, -1.2345678901234567e-05, -5e-324],
                "logprobs": "sampling",
                "finish_reason": "tool_calls",
                "message_index": 2,
                "weight_version": "7",
                "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 512},
            },
            {
                "prompt_ids": [151665, 23, 19, 151666],
                "prompt_offset": 8,
                "output_ids": [59, 79075, 90, 151645],
                "output_logprobs": [-0.0, -2.5, -0.75, -3.0e-08],
                "logprobs": "sampling",
                "finish_reason": "stop",
                "message_index": 4,
                "weight_version": 7,
                "sampling": None,
            },
        ],
    )


def with_turn(item: dict[str, Any], n: int, **change: Any) -> dict[str, Any]:
    changed = copy.deepcopy(item)
    changed["turns"][n].update(change)
    return changed


def good() -> dict[str, Any]:
    return recorded()


def refusals() -> Iterator[tuple[str, dict[str, Any], str, str]]:
    """(case, trajectory, the field named, words of the reason)."""
    item = good()
    yield (
        "a fractional id",
        with_turn(item, 0, output_ids=[1, 2.5, 3]),
        "turns.0.output_ids.1",
        "valid integer",
    )
    yield "a string id", with_turn(item, 1, prompt_ids=["23"]), "turns.1.prompt_ids.0", "valid integer"
    yield "a boolean id", with_turn(item, 0, output_ids=[True, 1, 2]), "turns.0.output_ids.0", "valid integer"
    yield (
        "a negative id",
        with_turn(item, 0, prompt_ids=[151644, -1, 198, 0, 1]),
        "turns.0.prompt_ids.1",
        "is -1: a token id is in [0, 2**31)",
    )
    yield (
        "an id too large",
        with_turn(item, 1, output_ids=[1, 2, 2**31, 3]),
        "turns.1.output_ids.2",
        "is 2147483648: a token id is in [0, 2**31)",
    )
    yield (
        "a logprob that is a string",
        with_turn(item, 1, output_logprobs=["-0.5", -2.5, -0.75, -1.0]),
        "turns.1.output_logprobs.0",
        "valid number",
    )
    yield (
        "logprobs that disagree in length",
        with_turn(item, 1, output_logprobs=[-0.5, -2.5]),
        "turns.1.output_logprobs",
        "2 logprobs for 4 output_ids",
    )
    yield (
        "a first turn with a prompt_offset",
        with_turn(item, 0, prompt_offset=1),
        "turns.0.prompt_offset",
        "the first turn has no previous tokens",
    )
    yield (
        "a prompt_offset past the previous turn",
        with_turn(item, 1, prompt_offset=9),
        "turns.1.prompt_offset",
        "is 9, past the tokens available (turn 0 provides 8)",
    )
    yield (
        "a negative prompt_offset",
        with_turn(item, 1, prompt_offset=-1),
        "turns.1.prompt_offset",
        "greater than",
    )
    yield (
        "a message_index out of range",
        with_turn(item, 1, message_index=5),
        "turns.1.message_index",
        "out of range for 5 messages",
    )
    yield (
        "a message_index at a tool message",
        with_turn(item, 1, message_index=3),
        "turns.1.message_index",
        "points at a 'tool' message, not an assistant one",
    )
    yield (
        "two turns for one message",
        with_turn(item, 1, message_index=2),
        "turns.1.message_index",
        "not after the previous turn's 2",
    )
    yield (
        "an unknown finish_reason",
        with_turn(item, 0, finish_reason="eos"),
        "turns.0.finish_reason",
        "'stop'",
    )
    yield "no output_ids", _without(item, 0, "output_ids"), "turns.0.output_ids", "required"
    yield "no message_index", _without(item, 1, "message_index"), "turns.1.message_index", "required"
    yield "turns not a list", {**item, "turns": {"0": {}}}, "turns", "valid array"
    yield "tools not a list", {**item, "tools": "calculator"}, "tools", "valid array"
    yield "a tool without a type", {**item, "tools": [{"function": {}}]}, "tools.0.type", "required"
    messages = copy.deepcopy(item["messages"])
    messages[2]["reasoning_content"] = ["Multiply."]
    yield (
        "reasoning that is not text",
        {**item, "messages": messages},
        "messages.2.reasoning_content",
        "string",
    )
    messages = copy.deepcopy(item["messages"])
    messages[4]["generated"] = "yes"
    yield "generated that is not a boolean", {**item, "messages": messages}, "messages.4.generated", "boolean"


def _without(item: dict[str, Any], n: int, key: str) -> dict[str, Any]:
    changed = copy.deepcopy(item)
    del changed["turns"][n][key]
    return changed


CASES = list(refusals())


@pytest.mark.parametrize(
    ("item", "field", "reason"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_a_bad_token_record_gets_a_422_naming_the_field_and_nothing_is_buffered(
    client: TestClient, item: dict[str, Any], field: str, reason: str
) -> None:
    response = client.post("/buffer/write", json=item)
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert [error["field"] for error in errors] == [field]
    assert reason in errors[0]["reason"]
    assert client.get("/buffer/stats").json()["data"]["data"][0]["total_written"] == 0


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_a_logprob_that_is_not_finite_is_refused(client: TestClient, number: str) -> None:
    body = orjson.dumps(good()).replace(b"-2.5", number.encode())
    response = client.post("/buffer/write", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["errors"] == [
        {"field": "turns.1.output_logprobs.1", "reason": "Input should be a finite number"}
    ]


def test_several_faults_are_each_named(client: TestClient) -> None:
    item = with_turn(good(), 1, output_logprobs=[-1.0], prompt_offset=99, message_index=0)
    response = client.post("/buffer/write", json=item)
    assert response.status_code == 422
    assert [error["field"] for error in response.json()["errors"]] == [
        "turns.1.output_logprobs",
        "turns.1.prompt_offset",
        "turns.1.message_index",
    ]


def test_a_batch_names_the_trajectory_and_writes_none_of_it(client: TestClient) -> None:
    batch = [recorded("q1"), with_turn(recorded("q2"), 0, output_logprobs=[])]
    response = client.post("/buffer/write_batch", json=batch)
    assert response.status_code == 422
    assert [error["field"] for error in response.json()["errors"]] == ["1.turns.0.output_logprobs"]
    assert client.get("/buffer/stats").json()["data"]["data"][0]["total_written"] == 0


def test_prompt_offsets_that_each_turn_provides_are_accepted(client: TestClient) -> None:
    """Turn 1 provides its full prompt (offset 8 + 4 ids) and 4 outputs: 16; a third turn may cut back."""
    item = good()
    item["messages"] += [{"role": "user", "content": "And 84 / 2?"}, {"role": "assistant", "content": "42"}]
    third = {"prompt_ids": [1, 2], "output_ids": [3], "finish_reason": "stop", "message_index": 6}
    for offset in (16, 0, 5):
        item["turns"] = [*good()["turns"], {**third, "prompt_offset": offset}]
        assert client.post("/buffer/write", json=item).status_code == 200
    over = {**item, "turns": [*good()["turns"], {**third, "prompt_offset": 17}]}
    answer = client.post("/buffer/write", json=over).json()
    assert answer["errors"][0]["field"] == "turns.2.prompt_offset"


def test_token_records_are_optional_and_may_be_null(client: TestClient) -> None:
    write_all(client, [trajectory("q1"), trajectory("q2", turns=None, tools=None)])
    item = with_turn(good(), 0, output_logprobs=None)
    del item["turns"][1]["output_logprobs"]
    assert client.post("/buffer/write", json=item).status_code == 200


def test_the_openapi_schema_describes_turns(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert set(schemas["Turn"]["required"]) == {"prompt_ids", "output_ids", "finish_reason", "message_index"}
    assert "turns" in schemas["Trajectory"]["properties"]
    assert "tools" in schemas["Trajectory"]["properties"]


# -- stored, restored, exported and read back unchanged ------------------------------------------------


@contextmanager
def service(generator_dir: Path, data_dir: Path | None) -> Iterator[TestClient]:
    settings = Settings(generator_dir=generator_dir, data_dir=data_dir, group_size=4)
    with TestClient(create_app(settings)) as client:
        yield client


RECORDS = ("messages", "tools", "turns")


def records(item: dict[str, Any]) -> dict[str, Any]:
    return {key: item[key] for key in RECORDS}


def by_uid(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["uid"]: records(item) for item in items}


def test_token_records_come_back_unchanged_from_a_read(client: TestClient) -> None:
    written = [recorded("q1", reward) for reward in (0.0, 1.0, 0.5, 0.25)]
    write_all(client, written)
    answer = read(client)
    assert by_uid(answer["data"]["data"]) == by_uid(written)


def test_token_records_survive_a_restart_and_are_exported_unchanged(
    generator_dir: Path, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    first = [recorded("q1", reward) for reward in (0.0, 1.0, 0.5, 0.25)]
    second = [recorded("q2", reward) for reward in (1.0, 0.0, 0.5, 0.75)]
    with service(generator_dir, data_dir) as client:
        write_all(client, first)
        client.post("/buffer/write_batch", json=second[:2])  # pending across the restart
    with service(generator_dir, data_dir) as client:
        client.post("/buffer/write_batch", json=second[2:])
        delivered = read(client)["data"]["data"]
        assert by_uid(delivered) == by_uid(first + second)
        export = client.get("/buffer/export")
        assert export.status_code == 200
        exported = [orjson.loads(line)["trajectory"] for line in export.content.splitlines()]
    assert by_uid(exported) == by_uid(first + second)
    assert exported[0]["turns"][0]["output_logprobs"][2] == -5e-324  # the smallest double, not rounded to 0


def test_a_generator_written_trajectory_with_records_is_read_by_slimes_reader(
    make_client: Callable[..., TestClient],
) -> None:
    """slime's ``/buffer/read`` (its older route) returns the records too."""
    client = make_client(group_size=2)
    written = [recorded("q1", 0.0), recorded("q1", 1.0)]
    write_all(client, written)
    response = client.post("/buffer/read", json={"batch_size": -1})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    items = data["data"] if isinstance(data, dict) else data
    assert by_uid(items) == by_uid(written)


def test_what_a_trainer_reads_converts_to_the_ids_the_engine_saw(client: TestClient) -> None:
    written = [recorded("q1", reward) for reward in (0.0, 1.0, 0.5, 0.25)]
    write_all(client, written)
    for item in read(client)["data"]["data"]:
        (sample,) = samples_from_turns(item, reward=item["reward"], raw_reward=item.get("raw_reward", 0.0))
        first, second = item["turns"]
        held = first["prompt_ids"] + first["output_ids"]
        assert sample.tokens == held + second["prompt_ids"] + second["output_ids"]
        assert sample.loss_mask == [1] * 3 + [0] * 4 + [1] * 4
        assert sample.rollout_log_probs == first["output_logprobs"] + [0.0] * 4 + second["output_logprobs"]
        assert sample.weight_versions == ["7", 7]
