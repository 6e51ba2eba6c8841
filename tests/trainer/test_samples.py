"""Trajectories to training samples (`buffer.trainer.samples`), against real chat templates.

The tokenizers are built here, offline: a small byte-level BPE trained on a few hundred sentences, with the
marker tokens each template writes added, and the public chat templates of Qwen2.5, Qwen3, Llama-3.1 and
DeepSeek-R1-Distill-Qwen (written out below, as their tokenizer_config.json files give them).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import pytest
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

import buffer.trainer.samples.converter as converter_module
from buffer.trainer.samples import (
    SampleConversionError,
    SampleConverter,
    TrainingSample,
    analyse_chat_template,
    sample_status,
    to_training_sample,
)
from buffer.trainer.samples.converter import FLAGLESS
from buffer.trainer.samples.template import ReasoningSlot
from tests.support.chat_templates import (
    DEEPSEEK_R1_DISTILL_TEMPLATE,
    DEEPSEEK_SPECIAL,
    LLAMA31_TEMPLATE,
    LLAMA_SPECIAL,
    LLAMA_SYSTEM_HEADER,
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    QWEN_PLAIN,
    QWEN_SPECIAL,
    SYSTEM,
    TOOLS,
    make_tokenizer,
    train_bpe,
)
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def bpe_json() -> str:
    return train_bpe()


@pytest.fixture(scope="module")
def qwen25(bpe_json: str) -> PreTrainedTokenizerFast:
    return make_tokenizer(bpe_json, QWEN25_TEMPLATE, QWEN_SPECIAL + QWEN_PLAIN, eos="<|im_end|>")


@pytest.fixture(scope="module")
def qwen3(bpe_json: str) -> PreTrainedTokenizerFast:
    return make_tokenizer(bpe_json, QWEN3_TEMPLATE, QWEN_SPECIAL, plain=QWEN_PLAIN, eos="<|im_end|>")


@pytest.fixture(scope="module")
def llama31(bpe_json: str) -> PreTrainedTokenizerFast:
    return make_tokenizer(
        bpe_json, LLAMA31_TEMPLATE, LLAMA_SPECIAL, bos="<|begin_of_text|>", eos="<|eot_id|>"
    )


@pytest.fixture(scope="module")
def deepseek(bpe_json: str) -> PreTrainedTokenizerFast:
    return make_tokenizer(
        bpe_json,
        DEEPSEEK_R1_DISTILL_TEMPLATE,
        DEEPSEEK_SPECIAL,
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    )


@pytest.fixture(scope="module")
def tokenizers(
    qwen25: PreTrainedTokenizerFast,
    qwen3: PreTrainedTokenizerFast,
    llama31: PreTrainedTokenizerFast,
    deepseek: PreTrainedTokenizerFast,
) -> dict[str, PreTrainedTokenizerFast]:
    return {"qwen25": qwen25, "qwen3": qwen3, "llama31": llama31, "deepseek": deepseek}


def trajectory(messages: list[dict[str, Any]], **extra_info: Any) -> dict[str, Any]:
    return {
        "uid": "uid-1",
        "instance_id": "math-7",
        "messages": messages,
        "reward": 1.0,
        "extra_info": {"finish_reason": "stop", **extra_info},
    }


def decode(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def template_ids(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    assert isinstance(ids, list)
    return ids


def masked_text(tokenizer: PreTrainedTokenizerFast, sample: TrainingSample) -> list[str]:
    """The decoded runs of response tokens whose loss mask is 1, in order."""
    response = sample.tokens[sample.prompt_length :]
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(response, sample.loss_mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return [decode(tokenizer, run) for run in runs]


def convert(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    **extra_info: Any,
) -> TrainingSample:
    """Convert, and check what holds for every sample: the tokens are the template's, the mask fits."""
    sample = to_training_sample(trajectory(messages, **extra_info), tokenizer, tools=tools)
    assert sample.tokens == template_ids(tokenizer, messages, tools)
    assert len(sample.loss_mask) == sample.response_length
    assert sample.loss_mask[0] == 1
    assert set(sample.loss_mask) <= {0, 1}
    return sample


def tool_call(arguments: str | dict[str, int]) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}


def multi_turn(first: str, second: str, third: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": first, "generated": True},
        {"role": "user", "content": "And 5 times 4?"},
        {"role": "assistant", "content": second, "generated": True},
        {"role": "user", "content": "Thanks! Now 20 minus 7?"},
        {"role": "assistant", "content": third, "generated": True},
    ]


def tool_conversation(
    arguments: str | dict[str, int], answer: str, **call_fields: Any
) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Use the tool: what is 17 + 25?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call(arguments)], **call_fields},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": answer},
    ]


SINGLE_TURN = [
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "<think>\nAdd the tens.\n</think>\n\nThe answer is 42."},
]
PLAIN_SINGLE_TURN = [SINGLE_TURN[0], {"role": "assistant", "content": "The answer is 42."}]
ARGUMENTS = '{"a": 17, "b": 25}'
#: Templates whose generation prompt opens no reasoning block: a plain reply is what the model wrote.
#: (Qwen3's and DeepSeek-R1's prompt with "<think>\n": their plain replies were sampled inside it.)
OPENS_NO_REASONING = ("qwen25", "llama31")


# --- the template analysis -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "generation_prompt", "history_header", "end_of_turn", "reasoning"),
    [
        ("qwen25", "<|im_start|>assistant\n", "<|im_start|>assistant\n", "<|im_end|>", None),
        (
            "qwen3",
            "<|im_start|>assistant\n<think>\n",
            "<|im_start|>assistant\n",
            "<|im_end|>",
            ReasoningSlot(opening="", closing="\n</think>\n\n"),
        ),
        (
            "llama31",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "<|eot_id|>",
            None,
        ),
        ("deepseek", "<｜Assistant｜><think>\n", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", None),
    ],
)
def test_the_analysis_reads_the_turn_delimiters_off_each_template(
    tokenizers: dict[str, PreTrainedTokenizerFast],
    name: str,
    generation_prompt: str,
    history_header: str,
    end_of_turn: str,
    reasoning: ReasoningSlot | None,
) -> None:
    analysis = analyse_chat_template(tokenizers[name])
    assert analysis.generation_prompt == generation_prompt
    assert analysis.header_prefixes[0] == generation_prompt
    assert history_header in analysis.header_prefixes
    assert analysis.end_of_turn == (end_of_turn,)
    assert analysis.reasoning == reasoning
    assert analyse_chat_template(tokenizers[name], tools=TOOLS) == analysis


def test_a_template_without_a_generation_prompt_is_refused(bpe_json: str) -> None:
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tokenizer = make_tokenizer(bpe_json, plain, QWEN_SPECIAL, eos="<|im_end|>")
    with pytest.raises(SampleConversionError, match="no generation prompt"):
        SampleConverter(tokenizer)


def test_a_template_that_fails_on_the_probe_is_refused(bpe_json: str) -> None:
    strict = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
    tokenizer = make_tokenizer(bpe_json, strict, QWEN_SPECIAL, eos="<|im_end|>")
    with pytest.raises(SampleConversionError, match="cannot render a probe conversation: a system message"):
        SampleConverter(tokenizer)


# --- single turn -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "prompt", "generated", "runs", "after"),
    [
        (
            "qwen25",
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
            "<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
            "<think>\nAdd the tens.\n</think>\n\nThe answer is 42.<|im_end|>",
            ["<think>\nAdd the tens.\n</think>\n\nThe answer is 42.<|im_end|>"],
            "\n",
        ),
        (
            "qwen3",  # the newlines the template writes around its reasoning slot are not trained
            "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n<think>\n",
            "Add the tens.\n</think>\n\nThe answer is 42.<|im_end|>",
            ["Add the tens.", "</think>", "The answer is 42.<|im_end|>"],
            "\n",
        ),
        (
            "llama31",
            LLAMA_SYSTEM_HEADER
            + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 12 + 30?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "<think>\nAdd the tens.\n</think>\n\nThe answer is 42.<|eot_id|>",
            ["<think>\nAdd the tens.\n</think>\n\nThe answer is 42.<|eot_id|>"],
            "",
        ),
    ],
)
def test_single_turn(
    tokenizers: dict[str, PreTrainedTokenizerFast],
    name: str,
    prompt: str,
    generated: str,
    runs: list[str],
    after: str,
) -> None:
    tokenizer = tokenizers[name]
    sample = convert(tokenizer, SINGLE_TURN)
    assert decode(tokenizer, sample.tokens[: sample.prompt_length]) == prompt
    assert masked_text(tokenizer, sample) == runs
    # What the template writes after the end-of-turn token (ChatML's newline) is in the response, unmasked.
    assert decode(tokenizer, sample.tokens[sample.prompt_length :]) == generated + after
    unmasked = len(tokenizer.encode(after, add_special_tokens=False))
    assert sample.loss_mask[sample.response_length - unmasked :] == [0] * unmasked
    assert sample.loss_mask[sample.response_length - unmasked - 1] == 1
    assert sample.rollout_log_probs is None
    assert sample.metadata["source"] == "rerendered"


def test_the_prompt_is_the_generation_prompt_the_engine_saw(qwen3: PreTrainedTokenizerFast) -> None:
    sample = convert(qwen3, SINGLE_TURN)
    prompt_ids = qwen3.apply_chat_template(SINGLE_TURN[:1], add_generation_prompt=True, return_dict=False)
    assert sample.tokens[: sample.prompt_length] == prompt_ids


# --- system prompt and several turns ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "generated"),
    [
        (
            "qwen25",
            ["2 + 3 = 5.<|im_end|>", "5 times 4 is 20.<|im_end|>", " 20 minus 7 is 13.\n<|im_end|>"],
        ),
        (
            "llama31",  # Llama's template trims the content
            ["2 + 3 = 5.<|eot_id|>", "5 times 4 is 20.<|eot_id|>", "20 minus 7 is 13.<|eot_id|>"],
        ),
    ],
)
def test_system_prompt_and_several_turns(
    tokenizers: dict[str, PreTrainedTokenizerFast], name: str, generated: list[str]
) -> None:
    tokenizer = tokenizers[name]
    sample = convert(tokenizer, multi_turn("2 + 3 = 5.", "5 times 4 is 20.", " 20 minus 7 is 13.\n"))
    assert masked_text(tokenizer, sample) == generated
    prompt = decode(tokenizer, sample.tokens[: sample.prompt_length])
    assert SYSTEM in prompt
    assert "What is 2 + 3?" in prompt
    assert "2 + 3 = 5." not in prompt  # the prompt ends with the first turn's assistant header
    assert prompt.endswith(analyse_chat_template(tokenizer).header_prefixes)


def test_qwen3_replies_without_reasoning_were_sampled_inside_it(qwen3: PreTrainedTokenizerFast) -> None:
    """Qwen3's thinking template prompts with "<think>\\n": a reply with no reasoning and no "</think>" was
    sampled inside that block. The last is trained as the reasoning it is, right after the prompt the
    engine gave (the template would put "\\n</think>\\n\\n" before it); those in the history stay as every
    later prompt held them, and are not trained (the template renders them closed)."""
    messages = multi_turn("2 + 3 = 5.", "5 times 4 is 20.", "20 minus 7 is 13.")
    sample = to_training_sample(trajectory(messages), qwen3)
    assert masked_text(qwen3, sample) == ["20 minus 7 is 13."]
    engine_prompt = qwen3.apply_chat_template(messages[:6], add_generation_prompt=True, return_dict=False)
    assert sample.tokens[: sample.prompt_length] == engine_prompt
    assert (
        decode(qwen3, sample.tokens[sample.prompt_length :]) == "20 minus 7 is 13.\n</think>\n\n<|im_end|>\n"
    )
    notes = sample.metadata["rerender_notes"]
    assert [note.split(":")[0] for note in notes] == ["message 2", "message 4", "message 6"]
    assert "sampled inside the reasoning block" in notes[2]


def test_deepseek_r1_replies_are_refused_where_the_template_drops_the_prompt_s_think(
    deepseek: PreTrainedTokenizerFast,
) -> None:
    # DeepSeek-R1-distill prompts with "<think>\n" and renders a reply without it: trained so, the reply
    # would follow a prompt the model never saw.
    with pytest.raises(SampleConversionError, match="is not how the whole conversation renders it"):
        to_training_sample(trajectory(PLAIN_SINGLE_TURN), deepseek)


def test_no_token_of_a_user_or_system_turn_is_masked(tokenizers: dict[str, PreTrainedTokenizerFast]) -> None:
    for tokenizer in (tokenizers[name] for name in OPENS_NO_REASONING):
        sample = convert(tokenizer, multi_turn("2 + 3 = 5.", "5 times 4 is 20.", "20 minus 7 is 13."))
        unmasked = "".join(
            decode(tokenizer, [token]) if not bit else "#"
            for token, bit in zip(sample.tokens[sample.prompt_length :], sample.loss_mask, strict=True)
        )
        assert "And 5 times 4?" in unmasked
        assert "Thanks! Now 20 minus 7?" in unmasked


@pytest.mark.parametrize(
    "messages",
    [
        SINGLE_TURN,
        multi_turn(
            "<think>\n2 and 3.\n</think>\n\n2 + 3 = 5.",
            "<think>\nFive fours.\n</think>\n\n5 times 4 is 20.",
            "<think>\nTake 7 away.\n</think>\n\n20 minus 7 is 13.",
        ),
    ],
)
def test_a_template_that_drops_the_reasoning_the_model_wrote_is_refused(
    deepseek: PreTrainedTokenizerFast, messages: list[dict[str, Any]]
) -> None:
    # DeepSeek-R1-distill's template cuts every reply at "</think>": the sample would train the answer
    # without the reasoning the model wrote before it.
    with pytest.raises(SampleConversionError, match="rewrites its content"):
        to_training_sample(trajectory(messages), deepseek)
    reply = {"role": "assistant", "content": "The answer is 42.", "reasoning_content": "Add the tens."}
    with pytest.raises(SampleConversionError, match="does not render the reasoning of the last reply"):
        to_training_sample(trajectory([SINGLE_TURN[0], reply]), deepseek)


# --- Qwen3 reasoning -------------------------------------------------------------------------------------


def test_qwen3_reasoning_in_several_turns(qwen3: PreTrainedTokenizerFast) -> None:
    messages = multi_turn(
        "<think>\n2 and 3 make 5.\n</think>\n\n2 + 3 = 5.",
        "<think>\nFive fours.\n</think>\n\n5 times 4 is 20.",
        "20 minus 7 is 13.",
    )
    messages[-1]["reasoning_content"] = "Take 7 away from 20."
    sample = convert(qwen3, messages)
    # The template drops the reasoning of the turns before the last user query, and keeps the last one's.
    assert masked_text(qwen3, sample) == [
        "2 + 3 = 5.<|im_end|>",
        "5 times 4 is 20.<|im_end|>",
        "Take 7 away from 20.",
        "</think>",
        "20 minus 7 is 13.<|im_end|>",
    ]
    text = qwen3.apply_chat_template(messages, tokenize=False)
    assert "Five fours" not in text
    assert "<|im_start|>assistant\n<think>\nTake 7 away from 20." in text


def test_qwen3_tool_turns_after_the_last_query_keep_their_reasoning(qwen3: PreTrainedTokenizerFast) -> None:
    messages = tool_conversation(
        ARGUMENTS, "<think>\nThe tool says 42.\n</think>\n\n17 + 25 = 42.", reasoning_content="Call add."
    )
    sample = convert(qwen3, messages, TOOLS)
    assert masked_text(qwen3, sample) == [
        "Call add.",
        "</think>",
        '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>',
        "The tool says 42.",
        "</think>",
        "17 + 25 = 42.<|im_end|>",
    ]


def test_a_reply_sampled_inside_the_prompt_s_reasoning_block_is_trained_as_that_reasoning(
    qwen3: PreTrainedTokenizerFast,
) -> None:
    # Qwen3's template renders "<think>\n\n</think>\n\n" before a reply without reasoning; the engine gave
    # the model "<think>\n", and it never wrote "</think>": the reply is reasoning, the closing the
    # template's, and the stop it sampled there is not trained after it.
    text = qwen3.apply_chat_template(PLAIN_SINGLE_TURN, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is 42.<|im_end|>\n")
    sample = to_training_sample(trajectory(PLAIN_SINGLE_TURN), qwen3)
    engine_prompt = qwen3.apply_chat_template(
        PLAIN_SINGLE_TURN[:1], add_generation_prompt=True, return_dict=False
    )
    assert sample.tokens[: sample.prompt_length] == engine_prompt
    assert masked_text(qwen3, sample) == ["The answer is 42."]
    assert (
        decode(qwen3, sample.tokens[sample.prompt_length :]) == "The answer is 42.\n</think>\n\n<|im_end|>\n"
    )
    cut_off = to_training_sample(trajectory(PLAIN_SINGLE_TURN, finish_reason="length"), qwen3)
    assert (cut_off.tokens, cut_off.loss_mask) == (sample.tokens, sample.loss_mask)


@pytest.mark.parametrize(
    "reply",
    [
        {"role": "assistant", "content": "\n</think>\n\nThe answer is 42."},
        {"role": "assistant", "content": "The answer is 42.", "reasoning_content": ""},
    ],
)
def test_a_reply_that_closed_an_empty_reasoning_block_is_an_answer(
    qwen3: PreTrainedTokenizerFast, reply: dict[str, Any]
) -> None:
    # "</think>" in the content, or an empty reasoning_content from a reasoning parser: the model closed
    # the block its prompt opened, so what follows is its answer (the empty block's closing, which the
    # model wrote too, is masked 0 with the template's).
    sample = to_training_sample(trajectory([SINGLE_TURN[0], reply]), qwen3)
    assert masked_text(qwen3, sample) == ["The answer is 42.<|im_end|>"]
    assert decode(qwen3, sample.tokens[: sample.prompt_length]).endswith("<think>\n\n</think>\n\n")


def test_a_tool_call_sampled_inside_the_prompt_s_reasoning_block_is_not_trained(
    qwen3: PreTrainedTokenizerFast,
) -> None:
    messages = tool_conversation(ARGUMENTS, "17 + 25 = 42.")
    sample = to_training_sample(trajectory(messages), qwen3, tools=TOOLS)
    assert masked_text(qwen3, sample) == ["17 + 25 = 42."]
    assert "message 2: sampled inside the reasoning block" in sample.metadata["rerender_notes"][1]
    with pytest.raises(SampleConversionError, match=r"no token .* can be trained.*message 2: sampled inside"):
        to_training_sample(trajectory(messages[:3]), qwen3, tools=TOOLS)


def test_a_reply_cut_off_in_its_reasoning_trains_the_reasoning_only(qwen3: PreTrainedTokenizerFast) -> None:
    # The template closes the reasoning ("\n</think>\n\n") and the turn; the model wrote neither.
    reply = {"role": "assistant", "content": "", "reasoning_content": "Add the tens and"}
    sample = convert(qwen3, [SINGLE_TURN[0], reply], finish_reason="length")
    assert masked_text(qwen3, sample) == ["Add the tens and"]
    assert (
        decode(qwen3, sample.tokens[sample.prompt_length :]) == "Add the tens and\n</think>\n\n<|im_end|>\n"
    )


# --- tools -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "arguments", "generated"),
    [
        (
            "qwen25",
            {"a": 17, "b": 25},
            [
                '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>',
                "17 + 25 = 42.<|im_end|>",
            ],
        ),
        (
            "qwen3",
            ARGUMENTS,
            [
                "Call add.",
                "</think>",
                '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>',
                "The tool says 42.",
                "</think>",
                "17 + 25 = 42.<|im_end|>",
            ],
        ),
        (
            "llama31",
            {"a": 17, "b": 25},
            ['{"name": "add", "parameters": {"a": 17, "b": 25}}<|eot_id|>', "17 + 25 = 42.<|eot_id|>"],
        ),
    ],
)
def test_tool_conversation_with_a_system_prompt(
    tokenizers: dict[str, PreTrainedTokenizerFast],
    name: str,
    arguments: str | dict[str, int],
    generated: list[str],
) -> None:
    tokenizer = tokenizers[name]
    if name == "qwen3":  # a thinking model reasons before each call and each answer
        answer = "<think>\nThe tool says 42.\n</think>\n\n17 + 25 = 42."
        messages = tool_conversation(arguments, answer, reasoning_content="Call add.")
    else:
        messages = tool_conversation(arguments, "17 + 25 = 42.")
    sample = convert(tokenizer, messages, TOOLS)
    assert masked_text(tokenizer, sample) == generated
    response = decode(tokenizer, sample.tokens[sample.prompt_length :])
    call = next(i for i, run in enumerate(generated) if '"add"' in run)
    assert (
        "42" in response.split(generated[call])[1].split(generated[call + 1])[0]
    )  # the tool result, unmasked


def test_deepseek_tool_conversations_are_refused(deepseek: PreTrainedTokenizerFast) -> None:
    converter = SampleConverter(deepseek, tools=TOOLS)
    # The template renders a call only for `content is none`, and transformers drops None fields.
    messages = tool_conversation(ARGUMENTS, "17 + 25 = 42.")
    with pytest.raises(SampleConversionError, match=r"uid-1.*message 2: .* does not render its tool calls"):
        converter.convert(trajectory(messages))


# --- token in, token out ---------------------------------------------------------------------------------


def engine_trajectory(tokenizer: PreTrainedTokenizerFast, **extra_info: Any) -> dict[str, Any]:
    """A single-turn trajectory as an engine returns it: the reply's ids as generated, one per character."""
    prompt_ids = tokenizer.apply_chat_template(SINGLE_TURN[:1], add_generation_prompt=True, return_dict=False)
    reply = [tokenizer.convert_tokens_to_ids(token) for token in [*"Add.", "<|im_end|>"]]
    logprobs = [[-0.5, -0.25, -1.0, -2.0, 0.0]]
    info = {"prompt_token_ids": prompt_ids, "token_ids": [reply], "logprobs": logprobs}
    return trajectory(SINGLE_TURN, **(info | extra_info))


def test_single_turn_engine_tokens_are_used_as_generated(qwen3: PreTrainedTokenizerFast) -> None:
    item = engine_trajectory(qwen3)
    info = item["extra_info"]
    sample = to_training_sample(item, qwen3)
    assert sample.tokens == info["prompt_token_ids"] + info["token_ids"][0]
    assert sample.tokens != template_ids(qwen3, SINGLE_TURN)  # not re-tokenised
    assert sample.response_length == 5
    assert sample.loss_mask == [1] * 5
    assert sample.rollout_log_probs == [-0.5, -0.25, -1.0, -2.0, 0.0]
    assert sample.metadata == {**info, "source": "engine_tokens"}


def test_flat_engine_token_lists_are_one_turn(qwen3: PreTrainedTokenizerFast) -> None:
    item = engine_trajectory(qwen3)
    info = item["extra_info"]
    flat = engine_trajectory(qwen3, token_ids=info["token_ids"][0], logprobs=info["logprobs"][0])
    sample, expected = to_training_sample(flat, qwen3), to_training_sample(item, qwen3)
    assert (sample.tokens, sample.loss_mask) == (expected.tokens, expected.loss_mask)
    assert sample.rollout_log_probs == expected.rollout_log_probs


def test_engine_tokens_without_logprobs(qwen3: PreTrainedTokenizerFast) -> None:
    item = engine_trajectory(qwen3)
    del item["extra_info"]["logprobs"]
    sample = to_training_sample(item, qwen3)
    assert sample.rollout_log_probs is None
    assert sample.loss_mask == [1] * 5


def test_logprobs_of_the_wrong_length_are_dropped_with_a_warning(
    qwen3: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    item = engine_trajectory(qwen3, logprobs=[[-0.5, -0.25]])
    with caplog.at_level(logging.WARNING, logger="buffer.trainer.samples.converter"):
        sample = to_training_sample(item, qwen3)
    assert sample.rollout_log_probs is None
    assert sample.tokens == item["extra_info"]["prompt_token_ids"] + item["extra_info"]["token_ids"][0]
    assert "do not match the 5 response tokens (got 2)" in caplog.text


def test_malformed_engine_tokens_fall_back_to_re_tokenising(
    qwen3: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    item = engine_trajectory(qwen3, token_ids=[[]])
    with caplog.at_level(logging.WARNING, logger="buffer.trainer.samples.converter"):
        sample = to_training_sample(item, qwen3)
    assert sample.tokens == template_ids(qwen3, SINGLE_TURN)
    assert sample.rollout_log_probs is None
    assert "re-tokenising instead" in caplog.text


def test_multi_turn_engine_tokens_are_re_tokenised_without_logprobs(qwen25: PreTrainedTokenizerFast) -> None:
    messages = multi_turn("2 + 3 = 5.", "5 times 4 is 20.", "20 minus 7 is 13.")
    item = trajectory(messages, prompt_token_ids=[1, 2], token_ids=[[3], [4], [5]], logprobs=[[-1.0]] * 3)
    sample = to_training_sample(item, qwen25)
    assert sample.tokens == template_ids(qwen25, messages)
    assert sample.rollout_log_probs is None
    assert masked_text(qwen25, sample)[-1] == "20 minus 7 is 13.<|im_end|>"


# --- status, reward, metadata ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish_reason", "status"),
    [
        ("stop", "completed"),
        ("length", "truncated"),
        ("abort", "aborted"),
        ("error", "completed"),
        ("tool_calls", "completed"),
        (None, "completed"),
    ],
)
def test_status_follows_the_finish_reason(
    qwen25: PreTrainedTokenizerFast, finish_reason: str | None, status: str
) -> None:
    assert sample_status(finish_reason) == status
    item = engine_trajectory(qwen25, finish_reason=finish_reason)
    assert to_training_sample(item, qwen25).status == status


def test_a_status_without_finish_reason_is_completed(qwen25: PreTrainedTokenizerFast) -> None:
    item = trajectory(PLAIN_SINGLE_TURN)
    del item["extra_info"]
    sample = to_training_sample(item, qwen25)
    assert sample.status == "completed"
    assert sample.metadata == {"source": "rerendered", "rerender_notes": [FLAGLESS]}


@pytest.mark.parametrize("finish_reason", ["length", "abort"])
def test_a_cut_off_reply_does_not_train_on_the_end_of_turn_the_template_adds(
    tokenizers: dict[str, PreTrainedTokenizerFast], finish_reason: str
) -> None:
    messages = multi_turn("2 + 3 = 5.", "5 times 4 is 20.", "20 minus 7 is")
    for name in OPENS_NO_REASONING:
        tokenizer = tokenizers[name]
        (end,) = analyse_chat_template(tokenizer).end_of_turn
        completed = masked_text(tokenizer, convert(tokenizer, messages))
        cut_off = masked_text(tokenizer, convert(tokenizer, messages, finish_reason=finish_reason))
        assert cut_off[:-1] == completed[:-1], name
        assert cut_off[-1] + end == completed[-1], name
        assert cut_off[-1].endswith("20 minus 7 is"), name


def test_reward_and_raw_reward(qwen25: PreTrainedTokenizerFast) -> None:
    item = trajectory(PLAIN_SINGLE_TURN) | {"reward": 0.5, "raw_reward": 1}
    sample = to_training_sample(item, qwen25)
    assert (sample.reward, sample.raw_reward) == (0.5, 1.0)
    assert isinstance(sample.raw_reward, float)
    item = trajectory(PLAIN_SINGLE_TURN) | {"reward": -1}
    sample = to_training_sample(item, qwen25)
    assert (sample.reward, sample.raw_reward) == (-1.0, -1.0)
    assert (sample.uid, sample.instance_id) == ("uid-1", "math-7")


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"reward": None}, "reward: expected a number, got None"),
        ({"reward": True}, "reward: expected a number, got True"),
        ({"raw_reward": "1.0"}, "raw_reward: expected a number"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "messages: no assistant message"),
        ({"messages": "Hi"}, "messages: not a list of messages"),
        ({"extra_info": ["stop"]}, "extra_info: not an object"),
    ],
)
def test_trajectories_that_cannot_be_samples_are_refused(
    qwen25: PreTrainedTokenizerFast, change: dict[str, Any], error: str
) -> None:
    with pytest.raises(SampleConversionError, match=f"^trajectory 'uid-1': {error}"):
        to_training_sample(trajectory(PLAIN_SINGLE_TURN) | change, qwen25)


# --- many trajectories -----------------------------------------------------------------------------------


def test_the_batch_form_analyses_the_template_once(
    tokenizers: dict[str, PreTrainedTokenizerFast], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []

    def counting(tokenizer: Any, **kwargs: Any) -> Any:
        calls.append(tokenizer)
        return analyse_chat_template(tokenizer, **kwargs)

    monkeypatch.setattr(converter_module, "analyse_chat_template", counting)
    for tokenizer in (tokenizers[name] for name in (*OPENS_NO_REASONING, "qwen3")):
        items = [
            trajectory(PLAIN_SINGLE_TURN),
            trajectory(multi_turn("2 + 3 = 5.", "5 times 4 is 20.", "20 minus 7 is 13.")),
            trajectory(PLAIN_SINGLE_TURN, finish_reason="length"),
        ] * 4
        calls.clear()
        samples = SampleConverter(tokenizer).convert_many(iter(items))
        assert calls == [tokenizer]
        assert samples == [to_training_sample(item, tokenizer) for item in items]
        assert len(calls) == 1 + len(items)


# --- how tokens are placed -------------------------------------------------------------------------------


def test_characters_split_into_bytes_are_masked_whole(tokenizers: dict[str, PreTrainedTokenizerFast]) -> None:
    messages = multi_turn("2 + 3 = 5 ✓", "Fünf mal vier: 20", "13 — done 🎉")
    for tokenizer in (tokenizers[name] for name in OPENS_NO_REASONING):
        (end,) = analyse_chat_template(tokenizer).end_of_turn
        generated = masked_text(tokenizer, convert(tokenizer, messages))
        assert generated == ["2 + 3 = 5 ✓" + end, "Fünf mal vier: 20" + end, "13 — done 🎉" + end]


class NoOffsetsTokenizer(PreTrainedTokenizerFast):
    """A tokenizer that cannot give character offsets, as slow (Python) tokenizers cannot."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError("return_offset_mapping is not available")
        return super().__call__(*args, **kwargs)


CONVERSATIONS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ("qwen25", tool_conversation({"a": 17, "b": 25}, "17 + 25 = 42."), TOOLS),
    ("qwen3", tool_conversation(ARGUMENTS, "17 + 25 = 42.", reasoning_content="Call add."), TOOLS),
    ("qwen3", PLAIN_SINGLE_TURN, None),
    ("llama31", tool_conversation({"a": 17, "b": 25}, "17 + 25 = 42."), TOOLS),
    ("qwen3", multi_turn("So 5", " 20\n", "13"), None),
    ("llama31", multi_turn("2 + 3 = 5 ✓", "Fünf mal vier: 20", "13 — done 🎉"), None),
]


@pytest.mark.parametrize(("name", "messages", "tools"), CONVERSATIONS)
@pytest.mark.parametrize("how", ["no offsets", "trimmed offsets"])
def test_without_usable_offsets_tokens_are_placed_by_decoding(
    tokenizers: dict[str, PreTrainedTokenizerFast],
    name: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    how: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    original = tokenizers[name]
    backend = Tokenizer.from_str(original.backend_tokenizer.to_str())
    if how == "trimmed offsets":  # offsets that leave out spaces: they no longer cover the text
        backend.post_processor = processors.ByteLevel(trim_offsets=True)
    cls = NoOffsetsTokenizer if how == "no offsets" else PreTrainedTokenizerFast
    tokenizer = cls(tokenizer_object=backend, bos_token=original.bos_token, eos_token=original.eos_token)
    tokenizer.chat_template = original.chat_template
    expected = to_training_sample(trajectory(messages), original, tools=tools)
    with caplog.at_level(logging.INFO, logger="buffer.trainer.samples.converter"):
        assert to_training_sample(trajectory(messages), tokenizer, tools=tools) == expected
    assert "placing tokens by decoding" in caplog.text


def test_the_base_package_imports_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import buffer.trainer.samples\n"
        "assert 'tokenizers' not in sys.modules"
    )
    root = REPO
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
