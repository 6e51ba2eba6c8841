"""What the simulated model says: a draft reply, then cut at ``max_tokens`` or by an abort.

A *token* is a whitespace-separated word together with the whitespace before it: joining the
tokens of a text gives the text back, ``usage`` counts words, and ``max_tokens=5`` keeps five words.
Each message of the prompt costs its words plus ``MESSAGE_OVERHEAD_TOKENS``.

The draft, from the conversation after its last user message:

- a ``tool`` message there: the answer is the (last) tool result, in ``\\boxed{}``;
- else an arithmetic question in the last user message, and a usable tool (one named
  ``calculator``, or any function whose parameters are a single string property): a call of the
  first such tool with the expression as its argument;
- else an arithmetic question: steps, then the answer in ``\\boxed{}``, right with probability
  ``accuracy`` and otherwise off by 1 to 3 (every step shown stays right except the last);
- else a short generic text.

``continue_final_message`` with a final assistant message drafts the reply to the messages before
it and returns what follows as many tokens as that message has. ``max_tokens`` then cuts the text
(``finish_reason`` "length"); an abort cuts it again, at a random token (``"abort"``, partial text).
A tool call is never cut at ``max_tokens``; an abort drops it (content ``""``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from buffer.simulator.arithmetic import find_question, format_number
from buffer.simulator.protocol import ChatMessage, ChatRequest, ToolSpec

MESSAGE_OVERHEAD_TOKENS = 3
WRONG_OFFSETS = (-3, -2, -1, 1, 2, 3)
GENERIC_REPLIES = (
    "I am a simulated language model without any knowledge. Ask me an arithmetic question, "
    "such as what is 17 + 25, and I will work it out step by step.",
    "This is a simulated reply from a server that has no model behind it. It answers arithmetic "
    "questions like compute 3 * (4 + 5) and says something short like this otherwise.",
    "Nothing here looks like arithmetic to me, so here is a generic answer of a reasonable length "
    "from the simulated model. Try asking for 6 * 7 instead.",
)

_TOKEN = re.compile(r"\s*\S+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def count_prompt_tokens(messages: Sequence[ChatMessage]) -> int:
    return sum(len(tokenize(message.text())) + MESSAGE_OVERHEAD_TOKENS for message in messages)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class Draft:
    text: str
    answer: str | None = None
    tool_call: ToolCall | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice; ``tokens`` are the generated ones (a tool call's: its arguments)."""

    content: str | None
    finish_reason: str  # stop, length, abort, tool_calls
    tokens: tuple[str, ...]
    tool_call: ToolCall | None = None


def complete(
    request: ChatRequest,
    accuracy: float,
    abort_rate: float,
    reply_rng: random.Random,
    fault_rng: random.Random,
) -> Choice:
    """One choice for ``request``. The reply is drawn from ``reply_rng``, aborts from ``fault_rng``."""
    messages = list(request.messages)
    prefix = None
    if request.continue_final_message and messages[-1].role == "assistant":
        prefix = messages.pop().text()
    draft = draft_reply(messages, request, reply_rng, accuracy)
    aborted = fault_rng.random() < abort_rate
    if draft.tool_call is not None and prefix is None:
        if aborted:  # nothing parseable yet
            return Choice("", "abort", ())
        return Choice(None, "tool_calls", tuple(tokenize(draft.tool_call.arguments)), draft.tool_call)
    tokens = tokenize(draft.text)
    if prefix is not None:
        tokens = _continuation(prefix, tokens, draft.answer)
    finish_reason = "stop"
    limit = request.token_limit
    if limit is not None and len(tokens) > limit:
        tokens, finish_reason = tokens[:limit], "length"
    if aborted:
        cut = fault_rng.randint(1, len(tokens) - 1) if len(tokens) > 1 else 0
        tokens, finish_reason = tokens[:cut], "abort"
    return Choice("".join(tokens), finish_reason, tuple(tokens))


def draft_reply(
    messages: Sequence[ChatMessage], request: ChatRequest, rng: random.Random, accuracy: float
) -> Draft:
    """The whole reply the model would give to ``messages`` (see the module docstring)."""
    last_user = max((i for i, message in enumerate(messages) if message.role == "user"), default=-1)
    tool_results = [message for message in messages[last_user + 1 :] if message.role == "tool"]
    if tool_results:
        result = tool_results[-1].text().strip()
        return Draft(f"The tool returned {result}.\nSo the answer is \\boxed{{{result}}}.", answer=result)
    solution = find_question(messages[last_user].text()) if last_user >= 0 else None
    if solution is None:
        return Draft(rng.choice(GENERIC_REPLIES))
    tool = None if request.tool_choice == "none" else _usable_tool(request.tools or [])
    if tool is not None:
        name, parameter = tool
        call_id = f"call_{rng.getrandbits(64):016x}"
        return Draft("", tool_call=ToolCall(call_id, name, json.dumps({parameter: solution.expression})))
    value = solution.value if rng.random() < accuracy else solution.value + rng.choice(WRONG_OFFSETS)
    answer = format_number(value)
    steps = [*solution.steps[:-1], f"{solution.steps[-1].rpartition(' = ')[0]} = {answer}"]
    text = (
        "Let me work this out step by step.\n" + "\n".join(steps) + f"\nSo the answer is \\boxed{{{answer}}}."
    )
    return Draft(text, answer=answer)


def fake_logprobs(tokens: Sequence[str], top_logprobs: int, rng: random.Random) -> dict[str, Any]:
    """Well-formed ``choices[i].logprobs``: one entry per token, made-up numbers."""
    content = []
    for token in tokens:
        logprob = -round(rng.expovariate(4.0), 4)
        top = [{"token": token, "logprob": logprob, "bytes": list(token.encode())}]
        for rank in range(1, top_logprobs):
            alternative = f" <alt{rank}>"
            top.append({"token": alternative, "logprob": logprob - rank, "bytes": list(alternative.encode())})
        content.append({**top[0], "top_logprobs": top[:top_logprobs]})
    return {"content": content, "refusal": None}


def _continuation(prefix: str, tokens: list[str], answer: str | None) -> list[str]:
    """The rest of the draft after as many tokens as ``prefix`` has; a closing line if none is left."""
    done = len(tokenize(prefix))
    if done < len(tokens):
        return tokens[done:]
    if answer is None or "\\boxed{" in prefix:
        return []
    return tokenize(f"\nSo the answer is \\boxed{{{answer}}}.")


def _usable_tool(tools: Sequence[ToolSpec]) -> tuple[str, str] | None:
    """(name, string parameter) of the first tool the model can call with an expression."""
    for tool in tools:
        if tool.type != "function":
            continue
        properties = (tool.function.parameters or {}).get("properties") or {}
        strings = [
            name
            for name, schema in properties.items()
            if isinstance(schema, dict) and schema.get("type") == "string"
        ]
        if len(properties) == 1 and strings:
            return tool.function.name, strings[0]
        if tool.function.name == "calculator":
            return tool.function.name, strings[0] if strings else "expression"
    return None
