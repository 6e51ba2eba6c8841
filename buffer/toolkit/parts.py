"""An answer's token record as its parts come in: ids, logprobs, policy versions, routed experts.

An aborted answer is continued (``llm``, ``tito``), possibly across a weight update, so one answer
may be sampled under several policies. Each part keeps:

- the policy version it was sampled under, per token, as runs over the output ids
  (``TokenCapture.weight_versions``: ``[[version, count], ...]``): the engine's where it reports
  a number, else the version its request passed the gate under (``buffer.policy``: 0 before the
  trainer said one), else None (no engine version and no gate);
- the engine's routed experts for MoE routing replay, where asked (SGLang's
  ``return_routed_experts``): one segment per request, kept as the engine sent it, base64 of
  int32, with its ``start`` (SGLang's ``routed_experts_start_len``) and ``rows``
  (the request's ``prompt + output - 1 - start``); the trainer lays them out
  (``buffer.trainer.samples.experts``).
"""

from __future__ import annotations

import contextvars
from typing import Any

from buffer.policy.versions import as_version
from buffer.toolkit.engines import Generated
from buffer.toolkit.types import TokenCapture

#: The policy version the current task's last engine request passed the gate under (None: no gate).
_entered: contextvars.ContextVar[int | None] = contextvars.ContextVar("entered_version", default=None)


def entered(version: int | None) -> None:
    """Say the version an engine request passes the gate under (None before any: 0)."""
    _entered.set(0 if version is None else version)


def part_version(engine_version: Any) -> int | None:
    """The version a part was sampled under: the engine's number, else its request's gate version."""
    version = as_version(engine_version)
    return version if version is not None else _entered.get()


def versioned(step: TokenCapture) -> TokenCapture:
    """``step`` (one request's answer) with the version of its output ids as one run (None where
    no version is known)."""
    version = part_version(step.weight_version)
    step.weight_versions = None if version is None else [[version, len(step.output_ids)]]
    return step


def experts_segment(data: Any, start: Any, sent: int, output: int) -> dict[str, Any] | None:
    """One request's routed experts, as the engine gave them (``None`` when it gave none)."""
    if not isinstance(data, str) or not data:
        return None
    begin = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else 0
    return {"start": begin, "rows": max(0, sent + output - 1 - begin), "data": data}


def join_runs(first: TokenCapture, then: TokenCapture) -> list[list[Any]] | None:
    """The runs of ``first``'s output ids, then ``then``'s, neighbours of one version merged
    (a part without runs is one run of None); None when no version is known."""
    runs: list[list[Any]] = []
    for part in (first, then):
        for version, count in part.weight_versions or [[None, len(part.output_ids)]]:
            if runs and runs[-1][0] == version:
                runs[-1][1] += count
            elif count:
                runs.append([version, count])
    return runs if any(version is not None for version, _ in runs) else None


def continued(so_far: TokenCapture, part: TokenCapture) -> tuple[TokenCapture, bool]:
    """An answer's token record after one more part, and whether the part extended it.

    A part whose prompt (as the engine reported it, or as sent) is the answer's so far, its
    prompt and output ids, is appended: one prompt, every id sampled after it, the versions'
    runs and the experts' segments joined. Any other part was sampled after another prompt (the
    engine re-rendered the reply so far): it becomes the record, from its own prompt, so nothing
    is trained in a context it was not sampled in."""
    prompt, output = so_far.prompt_ids, so_far.output_ids
    held = len(prompt)
    version = part.weight_version if part.weight_version is not None else so_far.weight_version
    engine = part.engine if part.engine is not None else so_far.engine
    if (
        len(part.prompt_ids) == held + len(output)
        and part.prompt_ids[:held] == prompt
        and part.prompt_ids[held:] == output
    ):
        logprobs = None
        if so_far.output_logprobs is not None and part.output_logprobs is not None:
            logprobs = so_far.output_logprobs + part.output_logprobs
        experts = (so_far.routed_experts or []) + (part.routed_experts or [])
        record = TokenCapture(prompt, output + part.output_ids, logprobs, version, engine=engine)
        record.weight_versions = join_runs(so_far, part)
        record.routed_experts = experts or None
        return record, True
    record = TokenCapture(part.prompt_ids, part.output_ids, part.output_logprobs, version, engine=engine)
    record.weight_versions, record.routed_experts = part.weight_versions, part.routed_experts
    return record, False


def step_of(part: Generated, sent: list[int]) -> TokenCapture:
    """One token route answer's record: its prompt as the engine echoed it (else as sent), its
    versions and its experts."""
    prompt = part.prompt_ids if part.prompt_ids is not None else sent
    step = versioned(TokenCapture(prompt, part.output_ids, part.output_logprobs, part.weight_version))
    segment = experts_segment(part.routed_experts, part.routed_experts_start, len(sent), len(part.output_ids))
    step.routed_experts = None if segment is None else [segment]
    return step
