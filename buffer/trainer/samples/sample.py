"""What the trainer gets for one trajectory: a `TrainingSample`, and the error for one it cannot convert."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

SampleStatus = Literal["completed", "truncated", "aborted"]


class SampleConversionError(ValueError):
    """A trajectory cannot become a training sample; the message says which part and why."""


@dataclass(slots=True)
class TrainingSample:
    """One trajectory as token ids, with the loss mask over its response.

    ``tokens`` is the whole conversation. The prompt is the messages before the first assistant message
    and that message's header (the generation prompt the engine was given); the last ``response_length``
    tokens are the response, from the first generated token on. ``loss_mask`` has one entry per response
    token: 1 where the model generated it (replies, reasoning, tool calls, end-of-turn tokens), 0 on tool
    results, user turns and the template's own headers and whitespace. ``metadata`` is a copy of the
    trajectory's ``extra_info`` with ``source``: ``"token_records"``, ``"engine_tokens"`` or
    ``"rerendered"`` (then ``rerender_notes`` lists what the sample holds that the model did not see); one
    of several branches of a trajectory adds ``branches``, ``branch`` and ``first_turn``
    (`buffer.trainer.samples.turns`).

    ``rollout_log_probs`` has one entry per response token, the sampling logprob under mask 1 and 0.0
    under mask 0, or is None where the engine's are not known, or not known to be the sampling
    distribution's: then ``log_probs_withheld`` says why (``buffer.logprob_kinds``).
    ``weight_versions`` holds the engine's weight version of each turn of the sample (None where
    it reported none; empty without token records); ``token_versions`` the policy version of each
    response token (None on context and where unknown; None without per-token records), for
    ``off_policy_mask``; ``routed_experts`` the engine's routed experts of every token but the last
    (int32 bytes, rows of ``layers * topk``; ``buffer.trainer.samples.experts``), or None;
    ``tools`` are the tools the model was given, as the trajectory records them.
    ``multimodal_inputs`` holds the trajectory's images (``{"images": [url, ...]}``, slime's field;
    ``buffer.trainer.samples.multimodal``), or None.
    """

    tokens: list[int]
    loss_mask: list[int]
    response_length: int
    reward: float
    raw_reward: float
    status: SampleStatus
    metadata: dict[str, Any]
    rollout_log_probs: list[float] | None
    uid: Any
    instance_id: Any
    weight_versions: list[Any] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    multimodal_inputs: dict[str, Any] | None = None
    log_probs_withheld: str | None = None
    token_versions: list[int | None] | None = None
    routed_experts: bytes | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def off_policy_mask(self, version: int | None = None) -> list[int]:
        """1 on each response token sampled under a policy older than ``version`` (default: the
        sample's newest), 0 elsewhere (context, unknown versions, no versions at all)."""
        versions = self.token_versions or []
        known = [v for v in versions if v is not None]
        if not known:
            return [0] * self.response_length
        bound = max(known) if version is None else version
        return [int(v is not None and v < bound) for v in versions]

    def on_policy_loss_mask(self, version: int | None = None) -> list[int]:
        """The loss mask with the tokens of ``off_policy_mask(version)`` taken out."""
        return [m * (1 - off) for m, off in zip(self.loss_mask, self.off_policy_mask(version), strict=True)]


def sample_status(finish_reason: object) -> SampleStatus:
    """The sample status for an engine's finish reason: "length" was cut off, "abort" was cancelled."""
    if finish_reason == "length":
        return "truncated"
    if finish_reason == "abort":
        return "aborted"
    return "completed"
