"""Training samples from token records (`buffer.trainer.samples.turns`, dispatched by `SampleConverter`).

The token ids here are arbitrary numbers: conversion from turns never looks at the tokenizer, so a sample
is right exactly when its tokens, mask and logprobs are the ones the turns hold, in the order the engine
saw them. The tokenizer (built offline, as in test_samples.py) is there for the converter's other paths.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from buffer.trainer.samples import SampleConversionError, SampleConverter, samples_from_turns
from tests.support.chat_templates import QWEN25_TEMPLATE, QWEN_PLAIN, QWEN_SPECIAL, make_tokenizer, train_bpe

SYSTEM_AND_USER = [10, 11, 12, 13]  # the first prompt the engine was given
CALL = [20, 21, 22]  # turn 0 sampled a tool call
RESULT = [30, 31]  # the tool result and the next generation prompt
ANSWER = [40, 41, 42, 43]  # turn 1 sampled the answer
CALL_LOGPROBS = [-0.5, -0.25, -0.125]
ANSWER_LOGPROBS = [-1.0, -2.0, -3.0, -0.0625]

MESSAGES = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {}}]},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "84"},
]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def turn(
    prompt_ids: list[int],
    output_ids: list[int],
    logprobs: list[float] | None,
    message_index: int,
    *,
    offset: int = 0,
    finish_reason: str = "stop",
    weight_version: str | int | None = None,
) -> dict[str, Any]:
    return {
        "prompt_ids": prompt_ids,
        "prompt_offset": offset,
        "output_ids": output_ids,
        "output_logprobs": logprobs,
        "logprobs": "sampling",  # what the toolkit says of logprobs it knows are the sampling distribution's
        "finish_reason": finish_reason,
        "message_index": message_index,
        "weight_version": weight_version,
    }


def recorded(
    turns: list[dict[str, Any]], messages: list[dict[str, Any]] = MESSAGES, **extra_info: Any
) -> dict[str, Any]:
    return {
        "uid": "uid-1",
        "instance_id": "calc-3",
        "messages": messages,
        "tools": TOOLS,
        "reward": 1.0,
        "extra_info": {"finish_reason": "stop", **extra_info},
        "turns": turns,
    }


def delta_turns() -> list[dict[str, Any]]:
    """The toolkit's token-in/token-out form: each later turn gives only the new ids, after all held."""
    held = len(SYSTEM_AND_USER) + len(CALL)
    return [
        turn(SYSTEM_AND_USER, CALL, CALL_LOGPROBS, 2, finish_reason="tool_calls", weight_version="5"),
        turn(RESULT, ANSWER, ANSWER_LOGPROBS, 4, offset=held, weight_version="6"),
    ]


@pytest.fixture(scope="module")
def converter() -> SampleConverter:
    tokenizer: PreTrainedTokenizerFast = make_tokenizer(
        train_bpe(), QWEN25_TEMPLATE, QWEN_SPECIAL + QWEN_PLAIN, eos="<|im_end|>"
    )
    return SampleConverter(tokenizer)


# --- one branch ------------------------------------------------------------------------------------------


def test_a_multi_turn_sample_is_exactly_the_ids_the_engine_received_and_sampled(
    converter: SampleConverter,
) -> None:
    sample = converter.convert(recorded(delta_turns()))
    assert sample.tokens == SYSTEM_AND_USER + CALL + RESULT + ANSWER
    assert sample.prompt_length == len(SYSTEM_AND_USER)
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs or [])
    assert sample.rollout_log_probs == [*CALL_LOGPROBS, 0.0, 0.0, *ANSWER_LOGPROBS]
    assert sample.weight_versions == ["5", "6"]
    assert sample.tools == TOOLS
    assert (sample.status, sample.reward, sample.uid, sample.instance_id) == (
        "completed",
        1.0,
        "uid-1",
        "calc-3",
    )


def test_the_sample_comes_from_the_turns_not_from_the_text_or_the_older_extra_info_ids(
    converter: SampleConverter,
) -> None:
    item = recorded(delta_turns(), prompt_token_ids=[1, 2], token_ids=[[3]], logprobs=[[-9.0]])
    sample = converter.convert(item)
    assert sample.tokens == SYSTEM_AND_USER + CALL + RESULT + ANSWER
    assert sample.metadata == {**item["extra_info"], "source": "token_records"}
    assert "source" not in item["extra_info"]  # a copy: the trajectory itself is not touched


def test_whole_prompts_and_partial_offsets_give_the_same_sample_as_deltas(converter: SampleConverter) -> None:
    held = SYSTEM_AND_USER + CALL
    expected = converter.convert(recorded(delta_turns()))
    for offset in (0, 2, len(held)):  # the engine's whole prompt, a part of it, the delta alone
        turns = delta_turns()
        turns[1].update(prompt_ids=(held + RESULT)[offset:], prompt_offset=offset)
        sample = converter.convert(recorded(turns))
        assert (sample.tokens, sample.loss_mask) == (expected.tokens, expected.loss_mask), offset
        assert sample.rollout_log_probs == expected.rollout_log_probs


def test_an_observation_may_continue_inside_the_last_reply_ids(converter: SampleConverter) -> None:
    """A prompt that takes only part of the previous output, then gives the same ids again, extends it."""
    turns = delta_turns()
    turns[1].update(prompt_ids=CALL[1:] + RESULT, prompt_offset=len(SYSTEM_AND_USER) + 1)
    sample = converter.convert(recorded(turns))
    assert sample.tokens == SYSTEM_AND_USER + CALL + RESULT + ANSWER
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1, 1]


def test_a_turn_without_logprobs_leaves_rollout_log_probs_none_rather_than_made_up(
    converter: SampleConverter,
) -> None:
    turns = delta_turns()
    turns[0]["output_logprobs"] = None
    sample = converter.convert(recorded(turns))
    assert sample.rollout_log_probs is None
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    del turns[0]["output_logprobs"]
    assert converter.convert(recorded(turns)).rollout_log_probs is None


def test_an_empty_reply_adds_no_response_token(converter: SampleConverter) -> None:
    turns = [turn(SYSTEM_AND_USER, [], [], 2, finish_reason="length")]
    sample = converter.convert(recorded(turns))
    assert (sample.tokens, sample.loss_mask, sample.rollout_log_probs) == (SYSTEM_AND_USER, [], [])
    assert sample.status == "truncated"


# --- aborts ----------------------------------------------------------------------------------------------


def test_an_abort_continued_from_its_ids_is_one_turn_and_trains_every_sampled_id(
    converter: SampleConverter,
) -> None:
    """The toolkit continues an aborted reply from its ids and writes one turn with all of them."""
    first_part, rest = [20, 21], [22, 23, 24]
    turns = [turn(SYSTEM_AND_USER, first_part + rest, [-0.5, -0.5, -1.0, -1.0, -1.0], 2)]
    sample = converter.convert(recorded(turns))
    assert sample.tokens == SYSTEM_AND_USER + first_part + rest
    assert sample.loss_mask == [1] * 5
    assert sample.status == "completed"


@pytest.mark.parametrize(
    ("last_turn", "written", "status"),
    [
        ("abort", "abort", "aborted"),
        ("abort", "stop", "aborted"),  # the trajectory did not say so, its last turn does
        ("stop", "abort", "aborted"),
        ("length", "stop", "truncated"),
        ("stop", "length", "truncated"),
        ("length", "abort", "aborted"),
        ("tool_calls", "stop", "completed"),
    ],
)
def test_the_status_is_the_most_severe_of_the_last_turn_and_the_trajectory(
    converter: SampleConverter, last_turn: str, written: str, status: str
) -> None:
    turns = delta_turns()
    turns[1]["finish_reason"] = last_turn
    assert converter.convert(recorded(turns, finish_reason=written)).status == status


def test_an_earlier_turn_that_was_cut_off_does_not_mark_the_sample(converter: SampleConverter) -> None:
    turns = delta_turns()
    turns[0]["finish_reason"] = "length"
    assert converter.convert(recorded(turns)).status == "completed"


# --- branches --------------------------------------------------------------------------------------------


def rewritten_turns() -> list[dict[str, Any]]:
    """Turn 1's prompt drops ids of turn 0's reply (as a template strips old reasoning): no extension."""
    stripped = SYSTEM_AND_USER + CALL[1:]
    return [
        turn(SYSTEM_AND_USER, CALL, CALL_LOGPROBS, 2, finish_reason="tool_calls", weight_version=5),
        turn(stripped + RESULT, ANSWER, ANSWER_LOGPROBS, 4, weight_version=6),
    ]


def test_a_prompt_that_rewrites_history_splits_the_trajectory_into_branches(
    converter: SampleConverter,
) -> None:
    item = recorded(rewritten_turns())
    first, second = converter.convert_all(item)
    assert first.tokens == SYSTEM_AND_USER + CALL
    assert (first.loss_mask, first.rollout_log_probs) == ([1, 1, 1], CALL_LOGPROBS)
    assert first.prompt_length == len(SYSTEM_AND_USER)
    assert (first.status, first.weight_versions) == ("completed", [5])
    stripped_prompt = SYSTEM_AND_USER + CALL[1:] + RESULT
    assert second.tokens == stripped_prompt + ANSWER
    assert second.prompt_length == len(stripped_prompt)
    assert (second.loss_mask, second.rollout_log_probs) == ([1] * 4, ANSWER_LOGPROBS)
    assert second.weight_versions == [6]
    assert first.reward == second.reward == 1.0
    branch = {"finish_reason": "stop", "source": "token_records", "branches": 2}
    assert first.metadata == {**branch, "branch": 0, "first_turn": 0}
    assert second.metadata == {**branch, "branch": 1, "first_turn": 1}
    assert item["extra_info"] == {"finish_reason": "stop"}  # the trajectory itself is not touched


def test_convert_refuses_a_trajectory_with_branches_and_says_how_many(converter: SampleConverter) -> None:
    with pytest.raises(
        SampleConversionError, match=r"'uid-1': its turns make 2 branches \(starting at turns 0, 1\)"
    ):
        converter.convert(recorded(rewritten_turns()))


def test_the_readme_loop_takes_every_branch_of_a_group(converter: SampleConverter) -> None:
    """``convert_many``, the README's trainer loop, gives each trajectory's samples in order: one, or
    one per branch, each saying which trajectory (``uid``) and which branch it is."""
    group = [recorded(delta_turns()), recorded(rewritten_turns()) | {"uid": "uid-2", "reward": -1.0}]
    samples = converter.convert_many(group)
    assert [(s.uid, s.metadata.get("branch"), s.reward) for s in samples] == [
        ("uid-1", None, 1.0),
        ("uid-2", 0, -1.0),
        ("uid-2", 1, -1.0),
    ]
    assert samples == [*converter.convert_all(group[0]), *converter.convert_all(group[1])]
    assert {s.uid: s.instance_id for s in samples} == {"uid-1": "calc-3", "uid-2": "calc-3"}


def test_a_branch_keeps_extending_after_it_starts(converter: SampleConverter) -> None:
    """Three turns, the second rewrites history, the third extends the second: two samples, not three."""
    turns = rewritten_turns()
    branch_held = len(SYSTEM_AND_USER) + len(CALL) - 1 + len(RESULT) + len(ANSWER)
    turns.append(turn([50, 51], [60, 61], [-0.25, -0.5], 6, offset=branch_held, weight_version=7))
    messages = [*MESSAGES, {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "84"}]
    first, second = converter.convert_all(recorded(turns, messages))
    assert first.tokens == SYSTEM_AND_USER + CALL
    assert second.tokens == SYSTEM_AND_USER + CALL[1:] + RESULT + ANSWER + [50, 51, 60, 61]
    assert second.loss_mask == [1, 1, 1, 1, 0, 0, 1, 1]
    assert second.rollout_log_probs == [*ANSWER_LOGPROBS, 0.0, 0.0, -0.25, -0.5]
    assert second.weight_versions == [6, 7]


def test_a_shorter_offset_with_different_ids_is_a_branch_too(converter: SampleConverter) -> None:
    turns = delta_turns()
    turns[1].update(prompt_ids=[99, *RESULT], prompt_offset=len(SYSTEM_AND_USER) + 2)
    first, second = converter.convert_all(recorded(turns))
    assert first.tokens == SYSTEM_AND_USER + CALL
    assert second.tokens == SYSTEM_AND_USER + CALL[:2] + [99, *RESULT] + ANSWER
    assert second.prompt_length == len(SYSTEM_AND_USER) + 2 + 3


def test_only_the_last_branch_takes_the_trajectorys_abort(converter: SampleConverter) -> None:
    first, second = converter.convert_all(recorded(rewritten_turns(), finish_reason="abort"))
    assert (first.status, second.status) == ("completed", "aborted")


def test_samples_from_turns_needs_no_tokenizer() -> None:
    (sample,) = samples_from_turns(recorded(delta_turns()), reward=0.5, raw_reward=2.0)
    assert sample.tokens == SYSTEM_AND_USER + CALL + RESULT + ANSWER
    assert (sample.reward, sample.raw_reward) == (0.5, 2.0)


def test_raw_reward_is_kept_for_every_branch(converter: SampleConverter) -> None:
    item = {**recorded(rewritten_turns()), "reward": 0.25, "raw_reward": 1.0}
    assert [(s.reward, s.raw_reward) for s in converter.convert_all(item)] == [(0.25, 1.0)] * 2


# --- the other paths stay as they were ---------------------------------------------------------------------


def test_the_older_single_turn_form_in_extra_info_is_still_read(converter: SampleConverter) -> None:
    item = {
        "uid": "u",
        "instance_id": 1,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "reward": 0.0,
        "extra_info": {"prompt_token_ids": [1, 2, 3], "token_ids": [[7, 8]], "logprobs": [[-0.5, -1.5]]},
    }
    (sample,) = converter.convert_all(item)
    assert (sample.tokens, sample.loss_mask, sample.rollout_log_probs) == (
        [1, 2, 3, 7, 8],
        [1, 1],
        [-0.5, -1.5],
    )
    assert sample.weight_versions == []


@pytest.mark.parametrize("turns", [None, []])
def test_without_turns_the_text_is_rendered(converter: SampleConverter, turns: list[Any] | None) -> None:
    item = {
        "uid": "u",
        "instance_id": 1,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "reward": 0.0,
        "tools": TOOLS,
        "turns": turns,
    }
    (sample,) = converter.convert_all(item)
    rendered = converter.tokenizer.apply_chat_template(
        item["messages"], tools=TOOLS, tokenize=True, return_dict=False
    )
    assert sample.tokens == rendered
    assert sample.rollout_log_probs is None
    assert sample.tools == TOOLS


# --- refusals ----------------------------------------------------------------------------------------------


def broken(change: dict[str, Any], n: int = 1) -> dict[str, Any]:
    turns = copy.deepcopy(delta_turns())
    turns[n].update(change)
    return recorded(turns)


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        (
            broken({"output_ids": [1, 2.5]}),
            "turns.1.output_ids: expected a list of non-negative integer token ids",
        ),
        (
            broken({"prompt_ids": [-3]}),
            "turns.1.prompt_ids: expected a list of non-negative integer token ids",
        ),
        (broken({"output_ids": [True]}), "turns.1.output_ids: expected"),
        (broken({"output_logprobs": [-1.0]}), "turns.1.output_logprobs: 1 values for 4 output_ids"),
        (broken({"output_logprobs": ["x"] * 4}), "turns.1.output_logprobs: not a list of numbers"),
        (broken({"prompt_offset": 8}), "turns.1.prompt_offset: is 8, past the 7 tokens of turn 0"),
        (broken({"prompt_offset": -1}), "turns.1.prompt_offset: expected a non-negative integer"),
        (
            broken({"prompt_offset": 2}, 0),
            "turns.0.prompt_offset: is 2; the first turn has no previous tokens",
        ),
        (broken({"prompt_ids": []}, 0), "turns.0.prompt_ids: empty"),
        ({**recorded([]), "turns": "all of them"}, "turns: not a list of turns"),
        ({**recorded(delta_turns()), "extra_info": []}, "extra_info: not an object"),
        ({**recorded(delta_turns()), "reward": None}, "reward: expected a number"),
    ],
)
def test_broken_token_records_are_refused_with_the_reason(
    converter: SampleConverter, item: dict[str, Any], reason: str
) -> None:
    with pytest.raises(SampleConversionError) as raised:
        converter.convert_all(item)
    assert str(raised.value).startswith("trajectory 'uid-1': ")
    assert reason in str(raised.value)
