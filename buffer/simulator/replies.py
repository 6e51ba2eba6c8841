"""What the simulated model says, as token ids: a draft reply, then cut by a stop, ``max_tokens`` or an abort.

The draft, from the conversation after its last user message (raw output text, as the model
writes it: a ``<think>`` block first when thinking, a tool call as Hermes' ``<tool_call>`` block):

- a ``tool`` message there: the answer is the (last) tool result, in ``\\boxed{}``;
- else an arithmetic question in the last user message, and a usable tool (one named
  ``calculator``, or any function whose parameters are a single string property): a call of the
  first such tool with the expression as its argument, or, with probability ``tool_error_rate``,
  with the expression mistyped (its result off by 1 to 3), so a tool task's rewards vary as a
  real model's do;
- else an arithmetic question: steps, then the answer in ``\\boxed{}``, right with probability
  ``accuracy`` and otherwise off by 1 to 3 (every step shown stays right except the last);
- else a short generic text.

The output ids are the tokenizer's ids of the draft, then the end-of-turn token. They are cut at
the first ``stop`` string or stop token id (``finish_reason`` "stop"), then at ``max_tokens``
("length"), then, with probability ``abort_rate``, at a random token ("abort", no end-of-turn).
Each output id gets a made-up logprob (finite, <= 0), drawn from the reply's generator.

Time, as an engine spends it, per token sampled: ``share`` is the part of the whole reply (the
reply so far and the rest, had nothing interrupted it) a generation sampled. A reply from the
start that is not aborted is the whole (1, however ``max_tokens`` or a stop cut it); an aborted
one is the tokens it got of the whole; a continuation is its new tokens of the whole. The server
charges a request its latency times its ``share``, so an aborted reply and its continuation take
together the time of the uninterrupted one.

A prompt that ends inside an assistant reply is continued: of every draft the model could give
here, the first whose ids (else text) begin with the reply so far goes on from there, so an
aborted reply continued from its tokens ends as the uninterrupted one would have; a reply so far
that no draft begins with gets a closing line with the answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from buffer.simulator.arithmetic import find_question, format_number
from buffer.simulator.conversation import SimMessage
from buffer.simulator.model import SimModel

WRONG_OFFSETS = (-3, -2, -1, 1, 2, 3)
GENERIC_REPLIES = (
    "I am a simulated language model without any knowledge. Ask me an arithmetic question, "
    "such as what is 17 + 25, and I will work it out step by step.",
    "This is a simulated reply from a server that has no model behind it. It answers arithmetic "
    "questions like compute 3 * (4 + 5) and says something short like this otherwise.",
    "Nothing here looks like arithmetic to me, so here is a generic answer of a reasonable length "
    "from the simulated model. Try asking for 6 * 7 instead.",
)


@dataclass(frozen=True, slots=True)
class Draft:
    text: str  # the raw output, without the end-of-turn token
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    """Every reply the model may give to a conversation; ``draw`` picks one."""

    options: tuple[Draft, ...]
    arithmetic: bool = False  # options[0] is right, the others wrong
    tool_call: bool = False  # options[0] calls the tool rightly, the others with a mistyped expression

    def draw(self, rng: random.Random, accuracy: float, tool_error_rate: float = 0.0) -> Draft:
        if len(self.options) == 1:
            return self.options[0]
        if self.tool_call:
            if not tool_error_rate:  # nothing drawn: seeded replies stay what they were
                return self.options[0]
            return self.options[0] if rng.random() >= tool_error_rate else rng.choice(self.options[1:])
        if self.arithmetic:
            return self.options[0] if rng.random() < accuracy else rng.choice(self.options[1:])
        return rng.choice(self.options)


@dataclass(frozen=True, slots=True)
class Limits:
    """What ends a generation early, from the request."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Generation:
    """One choice: the ids the model sampled, their logprobs, and why it stopped."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop, length, abort
    matched_stop: int | str | None = None  # the end-of-turn or stop token id, or the stop string
    stop_at: int | None = None  # where a matched stop string starts in the decoded text
    #: The part of the whole reply this generation sampled (its time, see the module docstring).
    share: float = 1.0


def plan_reply(
    messages: Sequence[SimMessage], tools: Sequence[dict[str, Any]], tool_choice: Any, thinking: bool
) -> ReplyPlan:
    """The replies to ``messages`` (see the module docstring)."""
    last_user = max((i for i, message in enumerate(messages) if message.role == "user"), default=-1)
    tool_results = [message for message in messages[last_user + 1 :] if message.role == "tool"]
    if tool_results:
        result = tool_results[-1].text.strip()
        return ReplyPlan(
            (
                _draft(
                    thinking, f"The tool returned {result}.", f"So the answer is \\boxed{{{result}}}.", result
                ),
            )
        )
    solution = find_question(messages[last_user].text) if last_user >= 0 else None
    if solution is None:
        thought = "Nothing here looks like arithmetic."
        return ReplyPlan(tuple(_draft(thinking, thought, reply) for reply in GENERIC_REPLIES))
    tool = None if tool_choice == "none" else _usable_tool(tools)
    if tool is not None:
        name, parameter = tool
        calls = []
        for offset in (0, *WRONG_OFFSETS):
            expression = solution.expression if not offset else f"({solution.expression}) {offset:+d}"
            call = json.dumps({"name": name, "arguments": {parameter: expression}})
            thought = f"I need the {name} tool for {expression}."
            calls.append(_draft(thinking, thought, f"<tool_call>\n{call}\n</tool_call>"))
        return ReplyPlan(tuple(calls), tool_call=True)
    drafts = []
    for offset in (0, *WRONG_OFFSETS):
        answer = format_number(solution.value + offset)
        steps = [*solution.steps[:-1], f"{solution.steps[-1].rpartition(' = ')[0]} = {answer}"]
        work = "Let me work this out step by step.\n" + "\n".join(steps)
        final = f"So the answer is \\boxed{{{answer}}}."
        drafts.append(
            _draft(thinking, work, final, answer) if thinking else Draft(f"{work}\n{final}", answer)
        )
    return ReplyPlan(tuple(drafts), arithmetic=True)


def generate(
    model: SimModel,
    plan: ReplyPlan,
    limits: Limits,
    accuracy: float,
    abort_rate: float,
    reply_rng: random.Random,
    fault_rng: random.Random,
    partial_ids: Sequence[int] | None = None,
    partial_text: str | None = None,
    logprobs: bool = True,
    tool_error_rate: float = 0.0,
) -> Generation:
    """One choice (see the module docstring): the reply from ``reply_rng``, aborts from ``fault_rng``.

    Logprobs are drawn only when asked for (else ``[]``), so a server seeded with ``--seed`` gives
    the same sequence of replies to requests that do not ask as it did before they existed."""
    draft = plan.draw(reply_rng, accuracy, tool_error_rate)
    aborted = fault_rng.random() < abort_rate
    if partial_text:
        ids = _continuation(model, plan, draft, partial_ids or (), partial_text)
    else:
        ids = [*model.encode_reply(draft.text), model.eos_id]
    finish_reason = "stop"
    matched: int | str | None = None
    stop_at: int | None = None
    if ids and ids[-1] == model.eos_id:
        matched = model.eos_id
    cut = _first_stop(model, ids, limits)
    if cut is not None:
        ids, matched, stop_at = ids[: cut[0]], cut[1], cut[2]
    if limits.max_tokens is not None and len(ids) > limits.max_tokens:
        ids, finish_reason, matched, stop_at = ids[: limits.max_tokens], "length", None, None
    whole = len(partial_ids or ()) + len(ids)  # the reply, had nothing interrupted it
    if aborted:
        body = ids[:-1] if ids and ids[-1] == model.eos_id else ids
        end = fault_rng.randint(1, len(body) - 1) if len(body) > 1 else 0
        ids, finish_reason, matched, stop_at = body[:end], "abort", None, None
    draw = reply_rng.expovariate
    drawn = [-round(draw(4.0), 4) for _ in ids] if logprobs else []
    share = len(ids) / whole if whole else 1.0
    return Generation(ids, drawn, finish_reason, matched, stop_at, share)


def _draft(thinking: bool, thought: str, reply: str, answer: str | None = None) -> Draft:
    return Draft(f"<think>\n{thought}\n</think>\n\n{reply}" if thinking else reply, answer)


def _continuation(
    model: SimModel, plan: ReplyPlan, draft: Draft, partial_ids: Sequence[int], partial_text: str
) -> list[int]:
    """The rest of the reply that begins with ``partial_text`` (see the module docstring)."""
    for option in (draft, *plan.options):
        if not option.text.startswith(partial_text):
            continue
        ids = model.encode_reply(option.text)
        if partial_ids and list(ids[: len(partial_ids)]) == list(partial_ids):
            return [*ids[len(partial_ids) :], model.eos_id]
        return [*model.encode(option.text[len(partial_text) :]), model.eos_id]
    if draft.answer is None or "\\boxed{" in partial_text:
        return [model.eos_id]
    return [*model.encode(f"\nSo the answer is \\boxed{{{draft.answer}}}."), model.eos_id]


def _first_stop(model: SimModel, ids: list[int], limits: Limits) -> tuple[int, int | str, int | None] | None:
    """(ids kept, what matched, where a stop string starts) for the first stop in ``ids``; else None."""
    if not limits.stop and not limits.stop_token_ids:
        return None
    text = ""
    for index, token in enumerate(ids):
        if token in limits.stop_token_ids:
            return index + 1, token, None
        if token == model.eos_id:
            return None
        text += model.token_text[token]
        for stop in limits.stop:
            position = text.find(stop)
            if position >= 0:
                return index + 1, stop, position
    return None


def _usable_tool(tools: Sequence[dict[str, Any]]) -> tuple[str, str] | None:
    """(name, string parameter) of the first tool the model can call with an expression."""
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            continue
        properties = (function.get("parameters") or {}).get("properties") or {}
        strings = [
            name
            for name, schema in properties.items()
            if isinstance(schema, dict) and schema.get("type") == "string"
        ]
        if len(properties) == 1 and strings:
            return str(function.get("name")), strings[0]
        if function.get("name") == "calculator":
            return "calculator", strings[0] if strings else "expression"
    return None
