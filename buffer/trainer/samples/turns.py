"""Training samples from a trajectory's token records (``turns``): what the engine received and sampled.

Each turn holds the ids the engine was given (``prompt_ids``, after the first ``prompt_offset`` ids of the
previous turn's prompt and output) and the ids it sampled (``output_ids``, with their logprobs). A sample
is built from them alone, nothing re-tokenised:

    tokens            = full prompt of the first turn
                        + for each later turn: its new prompt ids (mask 0), then its output ids (mask 1)
    response_length   = len(tokens) - len(first full prompt) = len(loss_mask)
    rollout_log_probs = one per response token: the sampling logprob under mask 1, 0.0 under mask 0
                        (slime's convention); None when a turn of the sample has no logprobs, never made up

Sampling logprobs or none. A turn's logprobs are handed over only where the turn says they are the
sampling distribution's (``logprobs: "sampling"``, ``buffer.logprob_kinds``): vLLM's by default are
taken before temperature and top-p/top-k, SGLang's before top-p/top-k/min-p, so at another setting an
importance ratio computed from them is wrong. A sample with a turn whose logprobs are ``raw`` or
``unknown`` (or that does not say) gets ``rollout_log_probs`` None, and ``log_probs_withheld`` says why.

Branches. A turn's full prompt normally starts with every token held so far (the previous prompt and
output): the toolkit's token-in/token-out mode guarantees it. When it does not (a chat template that
rewrites history, as Qwen3 drops earlier reasoning, or a context that was compacted), the turns are never
spliced: the sample so far is closed and a new one starts from that turn's full prompt, so a trajectory
gives one sample per branch, each trained on tokens the engine really saw. This is prime-rl's
"best-effort interleaving" and slime's fork (``slime/agent/trajectory.py``); slime also "realigns" a small
drift inside the last reply by overwriting it as context, which loses what was sampled there, so it is
not done here. Every branch gets the trajectory's reward. A trajectory with several branches has their
number, its own index and the turn it starts at in each sample's ``metadata`` (``branches``,
``branch``, ``first_turn``). ``metadata`` is a copy of ``extra_info`` with ``"source": "token_records"``.

Status. ``aborted`` when the trajectory was written aborted (``extra_info.finish_reason == "abort"``) or
a branch's last turn was; ``truncated`` for ``"length"``; else ``completed``.

Trajectories written through the buffer were validated on the way in (``buffer.service.models``); the
checks here
are the ones conversion depends on, so a trajectory from elsewhere (an old export, a file) is refused
with the reason rather than converted wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from buffer.logprob_kinds import turn_kind
from buffer.trainer.samples import experts
from buffer.trainer.samples.multimodal import multimodal_inputs
from buffer.trainer.samples.sample import SampleConversionError, SampleStatus, TrainingSample, sample_status

_SEVERITY: dict[SampleStatus, int] = {"completed": 0, "truncated": 1, "aborted": 2}


@dataclass(slots=True)
class Branch:
    """The turns of a trajectory that extend one another, as one token sequence."""

    tokens: list[int]
    prompt_length: int
    loss_mask: list[int] = field(default_factory=list)
    #: Per response token; None once a turn without (sampling) logprobs joined.
    log_probs: list[float] | None = field(default_factory=list)
    #: Why ``log_probs`` is None though the engine gave logprobs: they are not sampling logprobs.
    withheld: str | None = None
    weight_versions: list[Any] = field(default_factory=list)
    #: The policy version of each response token (None on context and where unknown).
    token_versions: list[int | None] = field(default_factory=list)
    #: The routed experts' segments of its turns (``experts``), in order.
    experts: list[tuple[int, int, bytes]] = field(default_factory=list)
    finish_reason: object = None
    first_turn: int = 0

    def add_context(self, ids: Sequence[int]) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.token_versions.extend([None] * len(ids))
        if self.log_probs is not None:
            self.log_probs.extend([0.0] * len(ids))

    def add_output(
        self, ids: Sequence[int], log_probs: Sequence[float] | None, versions: Sequence[int | None] = ()
    ) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.token_versions.extend(versions if len(versions) == len(ids) else [None] * len(ids))
        if self.log_probs is not None:
            if log_probs is None:
                self.log_probs = None
            else:
                self.log_probs.extend(float(value) for value in log_probs)


def branches(turns: Sequence[Mapping[str, Any]]) -> list[Branch]:
    """The turns as branches of token ids: one unless a turn's prompt does not extend what came before."""
    if not turns:
        raise SampleConversionError("turns: empty, so nothing to train on")
    result: list[Branch] = []
    current: Branch | None = None
    for n, turn in enumerate(turns):
        prompt_ids, offset, output_ids, log_probs = _turn(turn, n)
        if current is None:
            if offset:
                raise SampleConversionError(
                    f"turns.0.prompt_offset: is {offset}; the first turn has no previous tokens"
                )
            current = Branch(tokens=list(prompt_ids), prompt_length=len(prompt_ids))
        else:
            held = current.tokens
            if offset > len(held):
                raise SampleConversionError(
                    f"turns.{n}.prompt_offset: is {offset}, past the {len(held)} tokens of turn {n - 1}"
                )
            if offset == len(held):
                current.add_context(prompt_ids)
            elif offset + len(prompt_ids) >= len(held) and prompt_ids[: len(held) - offset] == held[offset:]:
                current.add_context(prompt_ids[len(held) - offset :])
            else:  # the prompt rewrites what is held: close this branch, start one from the full prompt
                result.append(current)
                full_prompt = [*held[:offset], *prompt_ids]
                current = Branch(tokens=full_prompt, prompt_length=len(full_prompt), first_turn=n)
        if log_probs is not None and current.log_probs is not None:
            kind = turn_kind(turn)
            if kind != "sampling":
                log_probs = None
                current.withheld = _withheld(n, kind, turn)
        current.add_output(output_ids, log_probs, _token_versions(turn, len(output_ids)))
        current.experts.extend(experts.segments(turn))
        current.weight_versions.append(turn.get("weight_version"))
        current.finish_reason = turn.get("finish_reason")
    assert current is not None
    result.append(current)
    return result


def samples_from_turns(
    trajectory: Mapping[str, Any], reward: float, raw_reward: float
) -> list[TrainingSample]:
    """Every training sample of a trajectory with token records, one per branch, in order."""
    turns = trajectory.get("turns")
    if not isinstance(turns, list) or not all(isinstance(turn, Mapping) for turn in turns):
        raise SampleConversionError("turns: not a list of turns")
    extra_info = trajectory.get("extra_info", {})
    if not isinstance(extra_info, dict):
        raise SampleConversionError("extra_info: not an object")
    tools = trajectory.get("tools")
    found = branches(turns)
    images = multimodal_inputs(trajectory)
    samples = []
    for index, branch in enumerate(found):
        status = sample_status(branch.finish_reason)
        if index == len(found) - 1:
            written = sample_status(extra_info.get("finish_reason"))
            status = max(status, written, key=_SEVERITY.__getitem__)
        metadata: dict[str, Any] = {**extra_info, "source": "token_records"}
        if len(found) > 1:
            metadata.update(branches=len(found), branch=index, first_turn=branch.first_turn)
        samples.append(
            TrainingSample(
                tokens=branch.tokens,
                loss_mask=branch.loss_mask,
                response_length=len(branch.loss_mask),
                reward=reward,
                raw_reward=raw_reward,
                status=status,
                metadata=metadata,
                rollout_log_probs=branch.log_probs,
                log_probs_withheld=branch.withheld if branch.log_probs is None else None,
                uid=trajectory.get("uid"),
                instance_id=trajectory.get("instance_id"),
                weight_versions=branch.weight_versions,
                token_versions=branch.token_versions
                if any(v is not None for v in branch.token_versions)
                else None,
                routed_experts=experts.layout(branch.experts, len(branch.tokens) - 1),
                tools=tools if isinstance(tools, list) else None,
                multimodal_inputs=images,
            )
        )
    return samples


def _turn(turn: Mapping[str, Any], n: int) -> tuple[list[int], int, list[int], list[float] | None]:
    """One turn's prompt ids, prompt offset, output ids and logprobs, checked as conversion needs them."""
    prompt_ids = _ids(turn.get("prompt_ids"), f"turns.{n}.prompt_ids")
    output_ids = _ids(turn.get("output_ids"), f"turns.{n}.output_ids")
    offset = turn.get("prompt_offset", 0)
    if type(offset) is not int or offset < 0:
        raise SampleConversionError(
            f"turns.{n}.prompt_offset: expected a non-negative integer, got {offset!r}"
        )
    if n == 0 and not prompt_ids:
        raise SampleConversionError(
            "turns.0.prompt_ids: empty; the first turn's prompt is the sample's prompt"
        )
    log_probs = turn.get("output_logprobs")
    if log_probs is not None:
        if not isinstance(log_probs, list) or not all(
            isinstance(value, (int, float)) and not isinstance(value, bool) for value in log_probs
        ):
            raise SampleConversionError(f"turns.{n}.output_logprobs: not a list of numbers")
        if len(log_probs) != len(output_ids):
            raise SampleConversionError(
                f"turns.{n}.output_logprobs: {len(log_probs)} values for {len(output_ids)} output_ids"
            )
    return prompt_ids, offset, output_ids, log_probs


def _token_versions(turn: Mapping[str, Any], count: int) -> list[int | None]:
    """The version of each of a turn's output ids: its runs (``weight_versions: [[version,
    count], ...]``) where they add up to its output, else its ``weight_version`` for all."""
    runs = turn.get("weight_versions")
    versions: list[int | None] = []
    if isinstance(runs, list):
        for run in runs:
            if not (isinstance(run, list) and len(run) == 2 and type(run[1]) is int and run[1] >= 0):
                versions = []
                break
            versions.extend([_version(run[0])] * run[1])
    if len(versions) == count:
        return versions
    return [_version(turn.get("weight_version"))] * count


def _version(value: object) -> int | None:
    """A version as a number (SGLang reports strings); None for anything else ("default")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _withheld(n: int, kind: object, turn: Mapping[str, Any]) -> str:
    if "logprobs" not in turn:
        return (
            f"turns.{n}.logprobs: absent, so its output_logprobs may not be the sampling distribution's "
            '(the toolkit says; a writer of its own turns adds "logprobs": "sampling" where they are)'
        )
    if kind == "raw":
        return (
            f'turns.{n}.logprobs: "raw": the engine took them before the temperature or filters the '
            "request set (vLLM without --logprobs-mode processed_logprobs; SGLang with top-p, top-k or min-p)"
        )
    if kind == "constrained":
        return (
            f'turns.{n}.logprobs: "constrained": sampled under a grammar (structured outputs), so they are '
            "the masked distribution's, not the model's a trainer computes"
        )
    return f'turns.{n}.logprobs: "unknown": whether they are the sampling distribution\'s cannot be known'


def _ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(i) is int and i >= 0 for i in value):
        raise SampleConversionError(f"{name}: expected a list of non-negative integer token ids")
    return value
