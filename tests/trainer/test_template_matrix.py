"""The text path against real chat templates: every template in tests/support/templates on every
conversation shape.

Each case is converted by `SampleConverter` and judged by an oracle that knows nothing of the converter:
every text field of every message is a string unique in the conversation, so where the template wrote it is
found by `str.find`; what the model generated of a generated message runs from the end of the template's
assistant header before its first field (the headers and end-of-turn tokens of each template are written
by hand in tests/support/chat_templates.py) to the end of the first end-of-turn token after its last field, or
to its last field (and the whitespace it ended with, where the template keeps it) for a reply cut off. What
the oracle knows of each template besides (all by hand, in the same file):

- the whitespace of its reasoning slot ("<think>\\n", "\\n</think>\\n\\n") is the template's, never trained;
- the markers Llama 4 writes around a tool-call message's content are not known to be the model's;
- a template that closes no reply (GLM-4.5): the model ends a reply by sampling the next message's marker
  ("<|user|>", "<|observation|>" after a tool call), trained where the conversation has it and appended
  after the last reply;
- a generation prompt that opens the reasoning ("<think>\\n", Qwen3's thinking template): a reply with no
  reasoning was sampled inside it, so the last is rendered as that reasoning (cut off where it ends) and the
  others are not trained;
- a reply after the last user message is rendered after the very prompt it was generated from.

A case is

- right: the sample's tokens are the template's, and its mask is 1 exactly on the tokens wholly inside
  those spans;
- refused: the converter raised SampleConversionError (the reason is kept, and the expected refusals are
  listed below, as in docs/template-matrix.md);
- wrong: anything else, including a sample where the oracle finds that the template dropped or rewrote
  part of what the model generated.

Run ``python -m tests.trainer.test_template_matrix`` to print the table (docs/template-matrix.md holds its
output).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from buffer.trainer.samples import SampleConversionError, SampleConverter
from tests.support.chat_templates import TEMPLATE_SPECS, TemplateSpec, train_bpe

TOOL_NAME = "lookup"
SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


@dataclass
class Case:
    """A conversation, which of its messages are generated, and the strings each message's text holds."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    tools: bool = False
    # message index -> (kind, text): what the template should write somewhere, in order of the message
    texts: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    tails: dict[int, str] = field(default_factory=dict)  # message index -> the whitespace it ends with
    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def word(self, kind: str) -> str:
        return f"{kind} {next(self.counter):03d} zq"

    def add(
        self,
        role: str,
        content: str | None = "",
        *,
        generated: bool | None = None,
        texts: list[tuple[str, str]] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": role, "content": content, **fields}
        if generated is not None:
            message["generated"] = generated
        index = len(self.messages)
        self.messages.append(message)
        self.texts[index] = texts if texts is not None else ([("content", content)] if content else [])
        return message

    def system(self) -> None:
        self.add("system", self.word("System"))

    def user(self, content: str | None = None) -> None:
        self.add("user", self.word("Question") if content is None else content)

    def reply(
        self,
        *,
        generated: bool | None = None,
        reasoning: bool = False,
        calls: int = 0,
        content: bool = True,
        null_content: bool = False,
    ) -> list[str]:
        """An assistant message; returns the ids of its tool calls."""
        index = len(self.messages)
        texts: list[tuple[str, str]] = []
        fields: dict[str, Any] = {}
        if reasoning:
            thought = self.word("Thought")
            fields["reasoning_content"] = thought
            texts.append(("reasoning", thought))
        text = self.word("Reply") if content else ""
        if text:
            texts.append(("content", text))
        ids = []
        if calls:
            fields["tool_calls"] = []
            for _ in range(calls):
                call_id = f"call{next(self.counter):05d}"
                argument = self.word("Arg")
                fields["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": TOOL_NAME, "arguments": json.dumps({"query": argument})},
                    }
                )
                texts.append(("arguments", argument))
                ids.append(call_id)
            self.tools = True
        self.add("assistant", None if null_content else text, generated=generated, texts=texts, **fields)
        if generated or generated is None:
            self.generated.append(index)
        return ids

    def tool(self, call_id: str, content: str | None = None) -> None:
        self.add("tool", self.word("Result") if content is None else content, tool_call_id=call_id)


def _flagless(case: Case) -> Case:
    """Without flags, the generated messages are the assistant messages after the last user message."""
    last_user = max(i for i, m in enumerate(case.messages) if m["role"] == "user")
    case.generated = [i for i in case.generated if i > last_user]
    return case


def single(c: Case) -> None:
    c.user()
    c.reply()


def system(c: Case) -> None:
    c.system()
    single(c)


def turns_last_generated(c: Case) -> None:
    c.system()
    for _ in range(3):
        c.user()
        c.reply()
    _flagless(c)


def turns_all_generated(c: Case) -> None:
    c.system()
    for _ in range(3):
        c.user()
        c.reply(generated=True)


def few_shot(c: Case) -> None:
    c.system()
    for _ in range(2):
        c.user()
        c.reply(generated=False)
    c.user()
    c.reply(generated=True)


def tool_call(c: Case) -> None:
    c.system()
    c.user()
    (call,) = c.reply(calls=1, content=False)
    c.tool(call)
    c.reply()


def tool_call_null_content(c: Case) -> None:
    c.user()
    (call,) = c.reply(calls=1, content=False, null_content=True)
    c.tool(call)
    c.reply()


def tool_call_with_text(c: Case) -> None:
    c.user()
    (call,) = c.reply(calls=1)
    c.tool(call)
    c.reply()


def parallel_tool_calls(c: Case) -> None:
    c.user()
    first, second = c.reply(calls=2, content=False)
    c.tool(first)
    c.tool(second)
    c.reply()


def multi_step_tools(c: Case) -> None:
    c.user()
    for _ in range(2):
        (call,) = c.reply(calls=1, content=False)
        c.tool(call)
    c.reply()


def reasoning(c: Case) -> None:
    c.user()
    c.reply(reasoning=True)


def reasoning_with_tools(c: Case) -> None:
    c.user()
    (call,) = c.reply(reasoning=True, calls=1, content=False)
    c.tool(call)
    c.reply(reasoning=True)


def inline_reasoning(c: Case) -> None:
    c.user()
    thought, text = c.word("Thought"), c.word("Reply")
    c.add(
        "assistant",
        f"<think>\n{thought}\n</think>\n\n{text}",
        texts=[("reasoning", thought), ("content", text)],
    )
    c.generated.append(len(c.messages) - 1)


def truncated(c: Case) -> None:
    single(c)
    c.finish_reason = "length"


def truncated_in_reasoning(c: Case) -> None:
    c.user()
    c.reply(reasoning=True, content=False)
    c.finish_reason = "length"


def aborted(c: Case) -> None:
    single(c)
    c.finish_reason = "abort"


def truncated_after_a_space(c: Case) -> None:
    c.user()
    text = c.word("Reply")
    c.add("assistant", text + " ", texts=[("content", text)])
    c.tails[len(c.messages) - 1] = " "
    c.generated.append(len(c.messages) - 1)
    c.finish_reason = "length"


def undecodable_bytes(c: Case) -> None:
    c.user()
    text = f"{c.word('Reply')} caf\ufffd"  # a character cut between tokens, as a detokeniser writes it
    c.add("assistant", text, texts=[("content", text)])
    c.generated.append(len(c.messages) - 1)


def markers_in_user_message(c: Case, spec: TemplateSpec) -> None:
    c.user(f"{c.word('Question')} {' '.join(spec.headers + spec.ends)} {c.word('Question')}")
    c.reply()


def markers_in_tool_result(c: Case, spec: TemplateSpec) -> None:
    c.user()
    (call,) = c.reply(calls=1, content=False)
    c.tool(call, f"{c.word('Result')} {' '.join(spec.headers + spec.ends)} {c.word('Result')}")
    c.reply()


def whitespace_around_content(c: Case) -> None:
    c.user()
    text = c.word("Reply")
    c.add("assistant", f"\n  {text} \n", texts=[("content", text)])
    c.tails[len(c.messages) - 1] = " \n"
    c.generated.append(len(c.messages) - 1)


def multi_byte_characters(c: Case) -> None:
    c.user(f"{c.word('Question')} — ünïcödé ✓")
    text = f"{c.word('Reply')} 🎉 — fünf ✓"
    c.add("assistant", text, texts=[("content", text)])
    c.generated.append(len(c.messages) - 1)


def empty_tool_result(c: Case) -> None:
    c.user()
    (call,) = c.reply(calls=1, content=False)
    c.tool(call, "")
    c.reply()


SHAPES: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (
        single, system, turns_last_generated, turns_all_generated, few_shot, tool_call,
        tool_call_null_content, tool_call_with_text, parallel_tool_calls, multi_step_tools,
        reasoning, reasoning_with_tools, inline_reasoning, truncated, truncated_in_reasoning,
        aborted, truncated_after_a_space, markers_in_user_message, markers_in_tool_result,
        empty_tool_result, whitespace_around_content, multi_byte_characters, undecodable_bytes,
    )
}  # fmt: skip


def build(shape: str, spec: TemplateSpec) -> Case:
    case = Case()
    builder = SHAPES[shape]
    if builder.__code__.co_argcount == 2:
        builder(case, spec)
    else:
        builder(case)
    return case


# --- the oracle --------------------------------------------------------------------------------------------


class CannotRender(Exception):
    """The oracle finds that the template does not write what the model generated."""


@dataclass
class Expected:
    """What the oracle says the sample must be: the text's tokens, a stop token after them, the spans."""

    text: str
    spans: list[tuple[int, int]]
    appended: str | None = None


def sampled_inside_reasoning(
    case: Case, spec: TemplateSpec, messages: list[dict[str, Any]]
) -> tuple[set[int], set[int]]:
    """Under a generation prompt that opens the reasoning, the generated replies recorded without any: the
    last of the conversation (no tool calls) is moved into reasoning_content, the others are not trained."""
    if not (spec.prompt_opens_reasoning and spec.reasoning_slot):
        return set(), set()
    moved, untrained = set(), set()
    last = len(messages) - 1
    for index in case.generated:
        kinds = {kind for kind, _ in case.texts[index]}
        if "reasoning" in kinds or not kinds:
            continue
        if index == last and "arguments" not in kinds:
            message = messages[index]
            message["reasoning_content"] = message["thinking"] = message["content"]
            message["content"] = ""
            moved.add(index)
        else:
            untrained.add(index)
    return moved, untrained


def expected(
    tokenizer: PreTrainedTokenizerFast, converter: SampleConverter, case: Case, spec: TemplateSpec
) -> Expected:
    messages = converter_messages(case, converter)
    moved, untrained = sampled_inside_reasoning(case, spec, messages)
    tools = [SCHEMA] if case.tools else None
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    found: dict[int, list[tuple[str, int, int]]] = {}
    for index, texts in case.texts.items():
        for kind, value in texts:
            at = text.find(value)
            if at >= 0:
                found.setdefault(index, []).append((kind, at, at + len(value)))
    result = Expected(text, [])
    last = len(case.messages) - 1
    last_user = max(i for i, m in enumerate(case.messages) if m["role"] == "user")
    for index in case.generated:
        if index in untrained:
            continue
        own = found.get(index, [])
        kinds = {kind for kind, _, _ in own}
        for kind, _ in case.texts[index]:
            if kind not in kinds and (kind != "reasoning" or index == last):
                raise CannotRender(f"message {index}: its {kind} is not in the rendered text")
        if not own:
            raise CannotRender(f"message {index}: nothing of it is rendered")
        for kind, value in case.texts[index]:
            if kind == "arguments" and f'\\"{value}\\"' in text:
                raise CannotRender(f"message {index}: its arguments are rendered as a quoted JSON string")
        if index > last_user:
            prompt = tokenizer.apply_chat_template(
                messages[:index], tools=tools, tokenize=False, add_generation_prompt=True
            )
            if not text.startswith(prompt):
                raise CannotRender(f"message {index}: not rendered after the prompt it was generated from")
        start, stop = min(s for _, s, _ in own), max(e for _, _, e in own)
        others = [(s, e) for i, fs in found.items() if i != index for _, s, e in fs]
        previous = max((e for s, e in others if e <= start), default=0)
        following = min((s for s, e in others if s >= stop), default=len(text))
        header_ends = [
            previous + gap_at + len(header)
            for header in spec.headers
            if (gap_at := text.rfind(header, previous, start) - previous) >= 0
        ]
        if not header_ends:
            raise CannotRender(f"message {index}: no assistant header before it")
        begin = max(header_ends)
        calls = "arguments" in {kind for kind, _ in case.texts[index]}
        if (index == last and case.finish_reason != "stop") or index in moved:
            tail = case.tails.get(index, "")
            end = stop + len(tail) if text.startswith(tail, stop) else stop
        else:
            ends = [(at, end) for end in spec.ends if (at := text.find(end, stop, following)) >= 0]
            if ends:
                at, marker = min(ends)
                end = at + len(marker)
            elif spec.closes_every_reply:
                raise CannotRender(f"message {index}: no end-of-turn token after it")
            else:
                end = stop
            if spec.stops is not None:
                stop_token = spec.stops[1] if calls else spec.stops[0]
                if text.startswith(stop_token, end):
                    end += len(stop_token)
                elif index == last:
                    result.appended = stop_token
        holes = []
        if calls:
            holes += [(at, at + len(m)) for m in spec.untrained if (at := text.find(m, begin, end)) >= 0]
        for slot in spec.reasoning_slot or ():
            at = text.find(slot, begin)
            if 0 <= at < end:
                holes += [(i, i + 1) for i in range(at, min(at + len(slot), end)) if text[i].isspace()]
        position = begin
        for hole_start, hole_stop in sorted(holes):
            result.spans.append((position, hole_start))
            position = hole_stop
        result.spans.append((position, end))
    return result


def expected_mask(tokenizer: PreTrainedTokenizerFast, text: str, spans: list[tuple[int, int]]) -> list[int]:
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [
        int(any(start <= s and e <= stop for start, stop in spans) and s < e)
        for s, e in encoding["offset_mapping"]
    ]


@dataclass
class Outcome:
    verdict: str  # "right", "refused", "wrong"
    detail: str = ""


def judge(
    converter: SampleConverter, tokenizer: PreTrainedTokenizerFast, case: Case, spec: TemplateSpec
) -> Outcome:
    trajectory: dict[str, Any] = {
        "uid": "u",
        "instance_id": "i",
        "messages": case.messages,
        "reward": 1.0,
        "extra_info": {"finish_reason": case.finish_reason},
    }
    if case.tools:
        trajectory["tools"] = [SCHEMA]
    try:
        sample = converter.convert(trajectory)
    except SampleConversionError as exc:
        return Outcome("refused", str(exc).removeprefix("trajectory 'u': "))
    try:
        oracle = expected(tokenizer, converter, case, spec)
    except CannotRender as exc:
        return Outcome("wrong", f"converted, but {exc}")
    mask = expected_mask(tokenizer, oracle.text, oracle.spans)
    ids = tokenizer(oracle.text, add_special_tokens=False)["input_ids"]
    if oracle.appended is not None:
        appended = tokenizer(oracle.appended, add_special_tokens=False)["input_ids"]
        ids, mask = ids + appended, mask + [1] * len(appended)
    if sample.tokens != ids:
        return Outcome("wrong", "the tokens are not the template's")
    if (
        1 not in mask
        or mask.index(1) != sample.prompt_length
        or mask[sample.prompt_length :] != sample.loss_mask
    ):
        return Outcome("wrong", "the mask differs from the oracle's")
    return Outcome("right")


def converter_messages(case: Case, converter: SampleConverter) -> list[dict[str, Any]]:
    """The messages as the template is given them (arguments as objects where it takes objects)."""
    from buffer.trainer.samples.rerender import prepare_messages

    return prepare_messages(case.messages, converter.analysis)


# --- running the matrix ------------------------------------------------------------------------------------


def run_matrix() -> dict[tuple[str, str], Outcome]:
    bpe = train_bpe()
    outcomes = {}
    for spec in TEMPLATE_SPECS:
        tokenizer = spec.tokenizer(bpe)
        converter = SampleConverter(tokenizer)
        for shape in SHAPES:
            outcomes[spec.name, shape] = judge(converter, tokenizer, build(shape, spec), spec)
    return outcomes


@pytest.fixture(scope="module")
def matrix() -> dict[tuple[str, str], Outcome]:
    return run_matrix()


def test_no_case_gets_a_wrong_mask(matrix: dict[tuple[str, str], Outcome]) -> None:
    wrong = {case: outcome.detail for case, outcome in matrix.items() if outcome.verdict == "wrong"}
    assert wrong == {}


def test_the_refusals_are_the_documented_ones(matrix: dict[tuple[str, str], Outcome]) -> None:
    refused = {case: outcome.detail for case, outcome in matrix.items() if outcome.verdict == "refused"}
    assert {case: reason_of(detail) for case, detail in refused.items()} == EXPECTED_REFUSALS


def reason_of(detail: str) -> str:
    """The refusal's reason without the message index and the template's own wording."""
    for reason in REASONS:
        if reason in detail:
            return reason
    return detail


REASONS = (
    "does not render its tool calls",
    "does not render its content",
    "does not render the reasoning of the last reply",
    "rewrites its content",
    "cannot render the messages",
    "no end-of-turn token",
    "is not how the whole conversation renders it",
    "cut off with tool calls",
    "holds U+FFFD",
)

EXPECTED_REFUSALS: dict[tuple[str, str], str] = {
    ("qwen2.5", "reasoning"): "does not render the reasoning of the last reply",
    ("qwen2.5", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("qwen2.5", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("llama-3.0", "tool_call"): "does not render its tool calls",
    ("llama-3.0", "tool_call_null_content"): "does not render its tool calls",
    ("llama-3.0", "tool_call_with_text"): "does not render its tool calls",
    ("llama-3.0", "parallel_tool_calls"): "does not render its tool calls",
    ("llama-3.0", "multi_step_tools"): "does not render its tool calls",
    ("llama-3.0", "reasoning"): "does not render the reasoning of the last reply",
    ("llama-3.0", "reasoning_with_tools"): "does not render its tool calls",
    ("llama-3.0", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("llama-3.0", "markers_in_tool_result"): "does not render its tool calls",
    ("llama-3.0", "empty_tool_result"): "does not render its tool calls",
    ("llama-3.1", "tool_call_with_text"): "does not render its content",
    ("llama-3.1", "parallel_tool_calls"): "cannot render the messages",
    ("llama-3.1", "reasoning"): "does not render the reasoning of the last reply",
    ("llama-3.1", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("llama-3.1", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("llama-3.2", "tool_call_with_text"): "does not render its content",
    ("llama-3.2", "parallel_tool_calls"): "cannot render the messages",
    ("llama-3.2", "reasoning"): "does not render the reasoning of the last reply",
    ("llama-3.2", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("llama-3.2", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("llama-4", "reasoning"): "does not render the reasoning of the last reply",
    ("llama-4", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("llama-4", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-v3", "reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-v3", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("deepseek-v3", "inline_reasoning"): "rewrites its content",
    ("deepseek-v3", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-r1", "reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-r1", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("deepseek-r1", "inline_reasoning"): "rewrites its content",
    ("deepseek-r1", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-v3.1", "reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-v3.1", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("deepseek-v3.1", "inline_reasoning"): "rewrites its content",
    ("deepseek-v3.1", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-r1-distill", "tool_call"): "does not render its tool calls",
    ("deepseek-r1-distill", "tool_call_null_content"): "does not render its tool calls",
    ("deepseek-r1-distill", "tool_call_with_text"): "does not render its tool calls",
    ("deepseek-r1-distill", "parallel_tool_calls"): "does not render its tool calls",
    ("deepseek-r1-distill", "multi_step_tools"): "does not render its tool calls",
    ("deepseek-r1-distill", "reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-r1-distill", "reasoning_with_tools"): "does not render its tool calls",
    ("deepseek-r1-distill", "inline_reasoning"): "rewrites its content",
    ("deepseek-r1-distill", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("deepseek-r1-distill", "markers_in_tool_result"): "does not render its tool calls",
    ("deepseek-r1-distill", "empty_tool_result"): "does not render its tool calls",
    ("mistral-v0.3", "system"): "is not how the whole conversation renders it",
    ("mistral-v0.3", "turns_last_generated"): "is not how the whole conversation renders it",
    ("mistral-v0.3", "turns_all_generated"): "is not how the whole conversation renders it",
    ("mistral-v0.3", "few_shot"): "is not how the whole conversation renders it",
    ("mistral-v0.3", "tool_call"): "is not how the whole conversation renders it",
    ("mistral-v0.3", "tool_call_with_text"): "does not render its content",
    ("mistral-v0.3", "reasoning"): "does not render the reasoning of the last reply",
    ("mistral-v0.3", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("mistral-v0.3", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("mistral-nemo", "system"): "is not how the whole conversation renders it",
    ("mistral-nemo", "turns_last_generated"): "is not how the whole conversation renders it",
    ("mistral-nemo", "turns_all_generated"): "is not how the whole conversation renders it",
    ("mistral-nemo", "few_shot"): "is not how the whole conversation renders it",
    ("mistral-nemo", "tool_call"): "is not how the whole conversation renders it",
    ("mistral-nemo", "tool_call_with_text"): "does not render its content",
    ("mistral-nemo", "reasoning"): "does not render the reasoning of the last reply",
    ("mistral-nemo", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("mistral-nemo", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("mistral-small-3", "tool_call_with_text"): "does not render its content",
    ("mistral-small-3", "reasoning"): "does not render the reasoning of the last reply",
    ("mistral-small-3", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("mistral-small-3", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("gemma-2", "system"): "cannot render the messages",
    ("gemma-2", "turns_last_generated"): "cannot render the messages",
    ("gemma-2", "turns_all_generated"): "cannot render the messages",
    ("gemma-2", "few_shot"): "cannot render the messages",
    ("gemma-2", "tool_call"): "cannot render the messages",
    ("gemma-2", "tool_call_null_content"): "cannot render the messages",
    ("gemma-2", "tool_call_with_text"): "cannot render the messages",
    ("gemma-2", "parallel_tool_calls"): "cannot render the messages",
    ("gemma-2", "multi_step_tools"): "cannot render the messages",
    ("gemma-2", "reasoning"): "does not render the reasoning of the last reply",
    ("gemma-2", "reasoning_with_tools"): "cannot render the messages",
    ("gemma-2", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("gemma-2", "markers_in_tool_result"): "cannot render the messages",
    ("gemma-2", "empty_tool_result"): "cannot render the messages",
    ("gemma-3", "tool_call"): "cannot render the messages",
    ("gemma-3", "tool_call_null_content"): "cannot render the messages",
    ("gemma-3", "tool_call_with_text"): "cannot render the messages",
    ("gemma-3", "parallel_tool_calls"): "cannot render the messages",
    ("gemma-3", "multi_step_tools"): "cannot render the messages",
    ("gemma-3", "reasoning"): "does not render the reasoning of the last reply",
    ("gemma-3", "reasoning_with_tools"): "cannot render the messages",
    ("gemma-3", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("gemma-3", "markers_in_tool_result"): "cannot render the messages",
    ("gemma-3", "empty_tool_result"): "cannot render the messages",
    ("phi-3", "tool_call"): "does not render its tool calls",
    ("phi-3", "tool_call_null_content"): "does not render its tool calls",
    ("phi-3", "tool_call_with_text"): "does not render its tool calls",
    ("phi-3", "parallel_tool_calls"): "does not render its tool calls",
    ("phi-3", "multi_step_tools"): "does not render its tool calls",
    ("phi-3", "reasoning"): "does not render the reasoning of the last reply",
    ("phi-3", "reasoning_with_tools"): "does not render its tool calls",
    ("phi-3", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("phi-3", "markers_in_tool_result"): "does not render its tool calls",
    ("phi-3", "empty_tool_result"): "does not render its tool calls",
    ("kimi-k2", "reasoning"): "does not render the reasoning of the last reply",
    ("kimi-k2", "reasoning_with_tools"): "does not render the reasoning of the last reply",
    ("kimi-k2", "truncated_in_reasoning"): "does not render the reasoning of the last reply",
    ("gpt-oss", "tool_call_with_text"): "does not render its content",
}


PROMPT_DROPS_THINK = "is not how the whole conversation renders it"
# DeepSeek-R1's templates prompt with "<think>\n" and render no reply after it.
EXPECTED_REFUSALS |= {
    (name, shape): PROMPT_DROPS_THINK
    for name in ("deepseek-r1", "deepseek-r1-distill")
    for shape in (
        "single", "system", "turns_last_generated", "turns_all_generated", "few_shot", "truncated",
        "aborted", "truncated_after_a_space", "markers_in_user_message", "whitespace_around_content",
        "multi_byte_characters",
    )
}  # fmt: skip
EXPECTED_REFUSALS |= {
    ("deepseek-r1", shape): PROMPT_DROPS_THINK
    for shape in (
        "tool_call", "tool_call_null_content", "tool_call_with_text", "parallel_tool_calls",
        "multi_step_tools", "reasoning_with_tools", "markers_in_tool_result", "empty_tool_result",
    )
}  # fmt: skip
# gpt-oss drops a tool call's reasoning once a final answer follows: the answer's prompt held it.
EXPECTED_REFUSALS[("gpt-oss", "reasoning_with_tools")] = PROMPT_DROPS_THINK
EXPECTED_REFUSALS |= {(spec.name, "undecodable_bytes"): "holds U+FFFD" for spec in TEMPLATE_SPECS}


def table(outcomes: dict[tuple[str, str], Outcome]) -> str:
    """The tables of docs/template-matrix.md: the counts per template, then the cases not right, grouped by
    template and reason."""
    shapes = len(SHAPES)
    lines = ["| template | taken from | right | refused | wrong |", "|---|---|---|---|---|"]
    total: Counter[str] = Counter()
    for spec in TEMPLATE_SPECS:
        counts = Counter(outcome.verdict for (name, _), outcome in outcomes.items() if name == spec.name)
        total += counts
        lines.append(
            f"| {spec.name} | {spec.source} | {counts['right']} | {counts['refused']} | {counts['wrong']} |"
        )
    lines.append(
        f"| **all {len(TEMPLATE_SPECS)}** | {shapes} shapes each | **{total['right']}** | "
        f"**{total['refused']}** | **{total['wrong']}** |"
    )
    lines += ["", "| template | shapes | outcome | reason |", "|---|---|---|---|"]
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for (name, shape), outcome in outcomes.items():
        if outcome.verdict != "right":
            grouped.setdefault((name, outcome.verdict, label(outcome)), []).append(shape)
    for (name, verdict, reason), cases in grouped.items():
        lines.append(f"| {name} | {', '.join(cases)} | {verdict} | {reason.replace('|', '/')} |")
    return "\n".join(lines)


def label(outcome: Outcome) -> str:
    """A refusal's reason as the docs give it; a wrong case's detail."""
    if outcome.verdict != "refused":
        return outcome.detail
    reason = reason_of(outcome.detail)
    if reason == "cannot render the messages":
        return "the template raises: " + outcome.detail.rpartition(": ")[2]
    return reason


if __name__ == "__main__":
    import sys

    sys.stdout.write(table(run_matrix()) + "\n")
