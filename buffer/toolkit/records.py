"""A trajectory's token records: one ``turn`` per assistant message the policy generated.

The shape is the trajectory schema's (README, "Token records"): ``prompt_ids`` from
``prompt_offset`` on, where the full prompt of a turn is ``(full prompt + output ids of the
previous turn)[:prompt_offset] + prompt_ids``. A turn's prompt usually extends the previous
one (always in token-in/token-out mode), so most turns store only their new tokens; a template
that rewrote history (Qwen3 drops old reasoning) just gets a shorter offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from buffer.toolkit.types import Completion, Message

FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})


def turn_records(
    messages: Sequence[Message], completions: Sequence[Completion]
) -> list[dict[str, Any]] | None:
    """The turns of an episode, or ``None`` when any completion has no token ids (a server that
    ignored the capture fields, or capture off): a partial record would train on a partial
    conversation, so the trajectory stays text only."""
    if not completions or any(c.tokens is None for c in completions):
        return None
    generated = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("generated")]
    if len(generated) != len(completions):
        return None  # a rollout that did not append each completion's message once
    turns: list[dict[str, Any]] = []
    before: list[int] = []  # the previous turn's full prompt + output ids
    for completion, index in zip(completions, generated, strict=True):
        tokens = completion.tokens
        assert tokens is not None
        prompt = tokens.prompt_ids
        offset = _common_prefix(before, prompt)
        turns.append(
            {
                "prompt_ids": prompt[offset:],
                "prompt_offset": offset,
                "output_ids": tokens.output_ids,
                "output_logprobs": tokens.output_logprobs,
                "finish_reason": _finish_reason(completion.finish_reason),
                "message_index": index,
                "weight_version": tokens.weight_version,
                "sampling": completion.sampling,
            }
        )
        before = [*prompt, *tokens.output_ids]
    return turns


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _finish_reason(reason: str) -> str:
    if reason in FINISH_REASONS:
        return reason
    return "tool_calls" if reason == "function_call" else "stop"
