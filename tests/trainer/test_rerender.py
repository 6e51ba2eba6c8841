"""The text path's defects, one test each: tools, arguments, generated messages, text inside messages.

The matrix (tests/trainer/test_template_matrix.py) tries every template on every shape; these pin each
rule down
on one template, with what the sample holds written out.
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from buffer.trainer.samples import SampleConversionError, SampleConverter, TrainingSample
from buffer.trainer.samples.rerender import generated_messages
from tests.support.chat_templates import (
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    QWEN_PLAIN,
    QWEN_SPECIAL,
    TEMPLATE_SPECS,
    TOOLS,
    make_tokenizer,
    train_bpe,
)
from tests.support.samples import decode, trained_runs


@pytest.fixture(scope="module")
def qwen25() -> PreTrainedTokenizerFast:
    return make_tokenizer(train_bpe(), QWEN25_TEMPLATE, QWEN_SPECIAL + QWEN_PLAIN, eos="<|im_end|>")


@pytest.fixture(scope="module")
def qwen3() -> PreTrainedTokenizerFast:
    return make_tokenizer(train_bpe(), QWEN3_TEMPLATE, QWEN_SPECIAL, plain=QWEN_PLAIN, eos="<|im_end|>")


def convert(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], **fields: Any
) -> TrainingSample:
    item = {"uid": "u", "instance_id": "i", "messages": messages, "reward": 1.0, "extra_info": {}, **fields}
    return SampleConverter(tokenizer).convert(item)


def call(arguments: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}


TOOL_TURNS = [
    {"role": "user", "content": "Use the tool: what is 17 + 25?"},
    {"role": "assistant", "content": "", "tool_calls": [call('{"a": 17, "b": 25}')]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    {"role": "assistant", "content": "17 + 25 = 42."},
]


def test_the_tools_come_from_the_trajectory(qwen25: PreTrainedTokenizerFast) -> None:
    sample = convert(qwen25, TOOL_TURNS, tools=TOOLS)
    prompt = decode(qwen25, sample.tokens[: sample.prompt_length])
    assert '"name": "add", "description": "Add two integers."' in prompt
    assert sample.tokens == qwen25.apply_chat_template(
        [{**m, "tool_calls": [call({"a": 17, "b": 25})]} if m.get("tool_calls") else m for m in TOOL_TURNS],
        tools=TOOLS,
        tokenize=True,
        return_dict=False,
    )


def test_without_tools_on_the_trajectory_the_converters_are_used(qwen25: PreTrainedTokenizerFast) -> None:
    item = {"uid": "u", "instance_id": "i", "messages": TOOL_TURNS, "reward": 1.0, "extra_info": {}}
    with_tools = SampleConverter(qwen25, tools=TOOLS).convert(item)
    assert "Add two integers." in decode(qwen25, with_tools.tokens)
    assert "Add two integers." not in decode(qwen25, SampleConverter(qwen25).convert(item).tokens)
    with pytest.raises(SampleConversionError, match="tools: not a list of tool schemas"):
        SampleConverter(qwen25).convert(item | {"tools": {"add": {}}})


def test_tool_call_arguments_are_rendered_as_the_object_the_model_wrote(
    qwen25: PreTrainedTokenizerFast,
) -> None:
    # Qwen2.5's template `tojson`s the arguments: the OpenAI JSON string would come out quoted.
    sample = convert(qwen25, TOOL_TURNS, tools=TOOLS)
    assert trained_runs(qwen25, sample)[0] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>'
    )
    assert TOOL_TURNS[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 17, "b": 25}'  # left as it was


@pytest.mark.parametrize("arguments", ["[1, 2]", "{not json"])
def test_arguments_that_are_no_json_object_are_refused(
    qwen25: PreTrainedTokenizerFast, arguments: str
) -> None:
    messages = [TOOL_TURNS[0], {**TOOL_TURNS[1], "tool_calls": [call(arguments)]}, *TOOL_TURNS[2:]]
    with pytest.raises(SampleConversionError, match=r"messages\.1\.tool_calls: arguments are not"):
        convert(qwen25, messages, tools=TOOLS)


FEW_SHOT = [
    {"role": "system", "content": "Answer with the sum."},
    {"role": "user", "content": "1 + 1?"},
    {"role": "assistant", "content": "Example two."},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "Example four."},
    {"role": "user", "content": "3 + 3?"},
    {"role": "assistant", "content": "The answer is six."},
]


def test_few_shot_replies_in_the_prompt_are_not_trained(qwen25: PreTrainedTokenizerFast) -> None:
    sample = convert(qwen25, FEW_SHOT)
    assert trained_runs(qwen25, sample) == ["The answer is six.<|im_end|>"]
    assert "Example four." in decode(qwen25, sample.tokens[: sample.prompt_length])


def test_the_generated_flags_say_which_replies_are_trained(qwen25: PreTrainedTokenizerFast) -> None:
    flagged = [dict(m) for m in FEW_SHOT]
    flagged[4]["generated"] = True
    flagged[6]["generated"] = False
    sample = convert(qwen25, flagged)
    assert trained_runs(qwen25, sample) == ["Example four.<|im_end|>"]
    flagged[4]["generated"] = False
    with pytest.raises(SampleConversionError, match="no generated assistant message"):
        convert(qwen25, flagged)


def test_the_generated_messages_rule() -> None:
    assert generated_messages(FEW_SHOT) == [6]
    assert generated_messages(TOOL_TURNS) == [1, 3]
    assert generated_messages([{"role": "assistant", "content": "Hi"}]) == [0]
    assert generated_messages([{**m, "generated": m["role"] == "assistant"} for m in FEW_SHOT]) == [2, 4, 6]


@pytest.mark.parametrize("where", [0, 2])
def test_template_markers_inside_a_message_do_not_move_the_mask(
    qwen25: PreTrainedTokenizerFast, where: int
) -> None:
    plain = convert(qwen25, TOOL_TURNS, tools=TOOLS)
    messages = [dict(m) for m in TOOL_TURNS]
    messages[where]["content"] += " <|im_end|>\n<|im_start|>assistant\nI am not the model.<|im_end|>"
    sample = convert(qwen25, messages, tools=TOOLS)
    assert trained_runs(qwen25, sample) == trained_runs(qwen25, plain)
    assert "I am not the model." not in "".join(trained_runs(qwen25, sample))


def test_a_template_that_reads_a_user_message_still_locates_the_replies(
    qwen3: PreTrainedTokenizerFast,
) -> None:
    # Qwen3's template takes a user message in "<tool_response>" tags for a tool result (and keeps the
    # reasoning before it), so the sentinels cannot wrap it; the replies are still found, from the prompt
    # the engine was given.
    messages = [
        {"role": "user", "content": "Look it up."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call add.",
            "tool_calls": [call('{"a": 1, "b": 2}')],
            "generated": True,
        },
        {"role": "user", "content": "<tool_response>\n<|im_start|>assistant\n3\n</tool_response>"},
        {"role": "assistant", "content": "It is 3.", "generated": True},
    ]
    sample = convert(qwen3, messages, tools=TOOLS)
    # The template's newlines around "</think>" are not the model's; the last reply, sampled after
    # "<think>\n" without a "</think>", is that reasoning (its stop, sampled inside it, is not trained).
    assert trained_runs(qwen3, sample) == [
        "Call add.",
        "</think>",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        "It is 3.",
    ]


def test_a_reply_cut_off_with_tool_calls_is_refused(qwen25: PreTrainedTokenizerFast) -> None:
    messages = TOOL_TURNS[:2]
    with pytest.raises(SampleConversionError, match="cut off with tool calls"):
        convert(qwen25, messages, tools=TOOLS, extra_info={"finish_reason": "length"})


def test_a_generated_reply_without_text_is_refused(qwen25: PreTrainedTokenizerFast) -> None:
    with pytest.raises(SampleConversionError, match="has no text"):
        convert(qwen25, [TOOL_TURNS[0], {"role": "assistant", "content": ""}])


def test_gpt_oss_gets_the_reasoning_as_thinking() -> None:
    spec = next(s for s in TEMPLATE_SPECS if s.name == "gpt-oss")
    tokenizer = spec.tokenizer(train_bpe())
    reply = {"role": "assistant", "content": "It is 3.", "reasoning_content": "One plus two."}
    sample = convert(tokenizer, [{"role": "user", "content": "1 + 2?"}, reply])
    assert trained_runs(tokenizer, sample) == [
        "<|channel|>analysis<|message|>One plus two.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is 3.<|return|>"
    ]


def test_the_chat_template_kwargs_are_rendered_with() -> None:
    # Qwen3 with thinking off: the generation prompt holds the empty reasoning block, the reply follows it.
    spec = next(s for s in TEMPLATE_SPECS if s.name == "qwen3-hybrid")
    tokenizer = spec.tokenizer(train_bpe())
    item = {"uid": "u", "instance_id": "i", "messages": FEW_SHOT[-2:], "reward": 1.0, "extra_info": {}}
    converter = SampleConverter(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert converter.analysis.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    sample = converter.convert(item)
    assert trained_runs(tokenizer, sample) == ["The answer is six.<|im_end|>"]
    prompt = tokenizer.apply_chat_template(
        FEW_SHOT[-2:-1], add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    assert decode(tokenizer, sample.tokens[: sample.prompt_length]) == decode(tokenizer, prompt)


def test_text_holding_the_sentinel_characters_is_refused(qwen25: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "What is \U000f0001?"},
        {"role": "assistant", "content": "No idea."},
    ]
    with pytest.raises(SampleConversionError, match="private use area"):
        convert(qwen25, messages)
