"""The text path says what it is (issue 20, item 3): a sample re-rendered from text is marked and counted,
and what a template writes that the model did not sample is never trained as if it had been.

One test per rule, on the real template it concerns (tests/support/templates), with the sample written
out; the matrix (test_template_matrix.py) tries every rule on every template.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from buffer.trainer.samples import SampleConversionError, SampleConverter
from buffer.trainer.samples.converter import FLAGLESS
from tests.support.chat_templates import TEMPLATE_SPECS, train_bpe
from tests.support.samples import decode, trained_runs

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def tokenizer(name: str) -> PreTrainedTokenizerFast:
    return next(spec for spec in TEMPLATE_SPECS if spec.name == name).tokenizer(train_bpe())


@pytest.fixture(scope="module")
def glm() -> PreTrainedTokenizerFast:
    return tokenizer("glm-4.5")


@pytest.fixture(scope="module")
def llama4() -> PreTrainedTokenizerFast:
    return tokenizer("llama-4")


@pytest.fixture(scope="module")
def qwen25() -> PreTrainedTokenizerFast:
    return tokenizer("qwen2.5")


@pytest.fixture(scope="module")
def hybrid() -> PreTrainedTokenizerFast:
    return tokenizer("qwen3-hybrid")


def item(messages: list[dict[str, Any]], finish_reason: str = "stop", **fields: Any) -> dict[str, Any]:
    extra_info = {"finish_reason": finish_reason}
    return {
        "uid": "u",
        "instance_id": "i",
        "messages": messages,
        "reward": 1.0,
        "extra_info": extra_info,
    } | fields


def call(expression: str) -> dict[str, Any]:
    arguments = f'{{"expression": "{expression}"}}'
    return {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}


QUESTION = {"role": "user", "content": "What is 2 + 3?"}
FOLLOW_UP = {"role": "user", "content": "And 5 times 4?"}


def test_glm_s_end_of_turn_is_the_next_turn_s_marker_and_is_trained(glm: PreTrainedTokenizerFast) -> None:
    """GLM-4.5's template writes nothing after a reply: its model stops by sampling the next message's
    marker, "<|user|>" (or "<|observation|>" after a tool call). Where the conversation has it, it is
    trained; after the last reply, it is appended."""
    messages = [
        QUESTION,
        {"role": "assistant", "content": "It is 5.", "generated": True},
        FOLLOW_UP,
        {"role": "assistant", "content": None, "tool_calls": [call("5*4")], "generated": True},
        {"role": "tool", "tool_call_id": "call_1", "content": "20"},
        {"role": "assistant", "content": "It is 20.", "generated": True},
    ]
    sample = SampleConverter(glm).convert(item(messages, tools=[CALCULATOR]))
    runs = trained_runs(glm, sample)
    assert runs[0] == "It is 5.<|user|>"  # after the empty "\n<think></think>\n" the template writes
    assert runs[-2].endswith("</tool_call><|observation|>")
    assert runs[-1] == "It is 20.<|user|>"
    text = glm.apply_chat_template(messages, tools=[CALCULATOR], tokenize=False)
    assert text.endswith("It is 20.")  # the template writes no end of turn: the sample adds it
    assert sample.tokens[-1] == glm.convert_tokens_to_ids("<|user|>")
    assert any("'<|user|>'" in note and "appended" in note for note in sample.metadata["rerender_notes"])


def test_glm_s_last_tool_call_ends_with_observation_and_a_cut_off_reply_with_nothing(
    glm: PreTrainedTokenizerFast,
) -> None:
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call("2+3")]}]
    sample = SampleConverter(glm).convert(item(messages, "tool_calls", tools=[CALCULATOR]))
    assert trained_runs(glm, sample)[-1].endswith("</tool_call><|observation|>")
    cut_off = SampleConverter(glm).convert(
        item([QUESTION, {"role": "assistant", "content": "It is"}], "length")
    )
    assert trained_runs(glm, cut_off) == ["It is"]
    cut_off_text = glm.apply_chat_template(
        [QUESTION, {"role": "assistant", "content": "It is"}], tokenize=False
    )
    assert cut_off.tokens == glm(cut_off_text, add_special_tokens=False)["input_ids"]  # nothing appended


def test_llama4_s_python_tags_around_a_tool_call_are_not_trained(llama4: PreTrainedTokenizerFast) -> None:
    """Llama 4's template wraps a tool-call message's content in "<|python_start|>...<|python_end|>",
    even an empty one: the model is not known to have written them."""
    messages = [
        QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call("2+3")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    sample = SampleConverter(llama4).convert(item(messages, tools=[CALCULATOR]))
    text = decode(llama4, sample.tokens)
    assert '<|header_end|>\n\n<|python_start|><|python_end|>{"name": "calculator"' in text
    runs = trained_runs(llama4, sample)
    assert runs[0] == '{"name": "calculator", "parameters": {"expression": "2+3"}}<|eot|>'
    assert not any("<|python_start|>" in run or "<|python_end|>" in run for run in runs)
    assert runs[-1] == "It is 5.<|eot|>"


def test_a_reply_cut_off_after_a_space_keeps_the_space(qwen25: PreTrainedTokenizerFast) -> None:
    messages = [QUESTION, {"role": "assistant", "content": "The answer is "}]
    sample = SampleConverter(qwen25).convert(item(messages, "length"))
    assert trained_runs(qwen25, sample) == ["The answer is "]


def test_a_reply_with_undecodable_bytes_is_refused(qwen25: PreTrainedTokenizerFast) -> None:
    # A character split between tokens decodes to U+FFFD: the bytes the model sampled are gone.
    messages = [QUESTION, {"role": "assistant", "content": "It is 5 \ufffd"}]
    with pytest.raises(SampleConversionError, match="holds U\\+FFFD"):
        SampleConverter(qwen25).convert(item(messages))


def test_the_empty_reasoning_block_a_template_inserts_is_masked_and_said(
    hybrid: PreTrainedTokenizerFast,
) -> None:
    """Qwen3's hybrid template writes "<think>\\n\\n</think>\\n\\n" before a reply without reasoning: never
    trained as the model's, and the sample says the template put it there."""
    sample = SampleConverter(hybrid).convert(item([QUESTION, {"role": "assistant", "content": "It is 5."}]))
    assert decode(hybrid, sample.tokens[: sample.prompt_length]).endswith("<think>\n\n</think>\n\n")
    assert trained_runs(hybrid, sample) == ["It is 5.<|im_end|>"]
    assert any("empty reasoning block" in note for note in sample.metadata["rerender_notes"])


def test_without_flags_only_the_replies_after_the_last_user_message_are_trained_and_it_is_said(
    qwen25: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    messages = [
        QUESTION,
        {"role": "assistant", "content": "It is 5."},
        FOLLOW_UP,
        {"role": "assistant", "content": "It is 20."},
    ]
    converter = SampleConverter(qwen25)
    with caplog.at_level(logging.WARNING, logger="buffer.trainer.samples.converter"):
        first, second = converter.convert_many([item(messages), item(messages)])
    assert trained_runs(qwen25, first) == ["It is 20.<|im_end|>"]
    assert [record.getMessage().count("only the assistant messages after") for record in caplog.records] == [
        1
    ]
    assert first.metadata["rerender_notes"] == second.metadata["rerender_notes"] == [FLAGLESS]
    flagged = [
        {**message, "generated": True} if message["role"] == "assistant" else message for message in messages
    ]
    assert trained_runs(qwen25, converter.convert(item(flagged))) == [
        "It is 5.<|im_end|>",
        "It is 20.<|im_end|>",
    ]


def test_each_sample_says_where_it_came_from_and_the_converter_counts_them(
    qwen25: PreTrainedTokenizerFast,
) -> None:
    prompt_ids = qwen25.apply_chat_template([QUESTION], add_generation_prompt=True, return_dict=False)
    engine = item([QUESTION, {"role": "assistant", "content": "5"}])
    engine["extra_info"] |= {"prompt_token_ids": prompt_ids, "token_ids": [[20, 21]]}
    turns = {"prompt_ids": prompt_ids, "output_ids": [20, 21], "logprobs": "sampling"}
    recorded = item([QUESTION, {"role": "assistant", "content": "5"}], turns=[turns])
    text = item([QUESTION, {"role": "assistant", "content": "5", "generated": True}])
    nothing = item([QUESTION])
    converter = SampleConverter(qwen25)
    samples = converter.convert_many([engine, recorded, text])
    assert [sample.metadata["source"] for sample in samples] == [
        "engine_tokens",
        "token_records",
        "rerendered",
    ]
    assert "rerender_notes" not in samples[1].metadata
    assert text["extra_info"] == {"finish_reason": "stop"}  # the trajectory itself is left as it was
    with pytest.raises(SampleConversionError):
        converter.convert(nothing)
    assert converter.counts == {"engine_tokens": 1, "token_records": 1, "rerendered": 1, "refused": 1}
