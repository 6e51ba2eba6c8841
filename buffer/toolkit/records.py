"""A trajectory's token records: one ``turn`` per assistant message the policy generated.

The shape is the trajectory schema's (README, "Token records"): ``prompt_ids`` from
``prompt_offset`` on, where the full prompt of a turn is ``(full prompt + output ids of the
previous turn)[:prompt_offset] + prompt_ids``. A turn's prompt usually extends the previous
one (always in token-in/token-out mode), so most turns store only their new tokens; a template
that rewrote history (Qwen3 drops old reasoning) just gets a shorter offset.

A turn with logprobs says what they are (``logprobs``: ``"sampling"``, ``"raw"`` or
``"unknown"``, ``buffer.logprob_kinds``), from the engine that answered (``TokenCapture.engine``),
its logprobs mode as the run declares it (``/start_rollout``'s ``logprobs_mode``) and the
request's sampling fields. The trainer side is handed only sampling logprobs; a run whose are
not says so once in the log (``LogprobsJudge``), naming what to change.

A turn also says the policy version of each output id, as runs ``weight_versions:
[[version, count], ...]`` (an answer continued across a weight update has several), and, where
asked (``return_routed_experts``), the engine's routed experts per request (``routed_experts``:
``[{"start", "rows", "data"}, ...]``, base64 of int32 as SGLang sent them); see ``parts``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from buffer.logprob_kinds import LogprobsKind, explain, logprobs_kind
from buffer.toolkit.types import Completion, Message

logger = logging.getLogger(__name__)

FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})


class LogprobsJudge:
    """What one run's logprobs are (``buffer.logprob_kinds``), with one warning for the run
    when they are not sampling logprobs.

    ``mode`` is the engine's logprobs mode as declared (vLLM's ``--logprobs-mode``; None: the
    engine's default); ``engine`` the engine's name where a capture does not say which answered."""

    def __init__(
        self,
        mode: str | None = None,
        *,
        engine: str = "auto",
        task_type: str | None = None,
        warn: bool = True,
    ) -> None:
        self.mode = mode
        self.engine = engine
        self.task_type = task_type
        self.warned = not warn  # warned once already, or never to

    def kind(self, engine: str | None, sampling: Mapping[str, Any] | None) -> LogprobsKind:
        """The kind of the logprobs of a request with ``sampling``, answered by ``engine``."""
        name = engine or self.engine
        kind = logprobs_kind(name, sampling, self.mode)
        if kind != "sampling" and not self.warned:
            self.warned = True
            logger.warning(
                "%sthe engine's logprobs are not the sampling distribution's (%s): %s. Their token "
                "records say logprobs: %r, and the trainer is not handed them as rollout logprobs",
                f"{self.task_type}: " if self.task_type else "",
                kind,
                explain(name, sampling, self.mode),
                kind,
            )
        return kind


def turn_records(
    messages: Sequence[Message], completions: Sequence[Completion], logprobs: LogprobsJudge | None = None
) -> list[dict[str, Any]] | None:
    """The turns of an episode, or ``None`` when any completion has no token ids (a server that
    ignored the capture fields, or capture off): a partial record would train on a partial
    conversation, so the trajectory stays text only. ``logprobs`` judges what the logprobs are
    (default: an engine's default mode, the engine as each capture names it)."""
    judge = logprobs or LogprobsJudge(warn=False)
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
        if tokens.output_logprobs is not None:
            turns[-1]["logprobs"] = judge.kind(tokens.engine, completion.sampling)
        if tokens.weight_versions is not None:  # per output id, as runs (``parts``)
            turns[-1]["weight_versions"] = tokens.weight_versions
        if tokens.routed_experts is not None:
            turns[-1]["routed_experts"] = tokens.routed_experts
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
