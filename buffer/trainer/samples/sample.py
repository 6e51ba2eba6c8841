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
    it reported none; empty without token records); ``tools`` are the tools the model was given,
    as the trajectory records them.
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

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


def sample_status(finish_reason: object) -> SampleStatus:
    """The sample status for an engine's finish reason: "length" was cut off, "abort" was cancelled."""
    if finish_reason == "length":
        return "truncated"
    if finish_reason == "abort":
        return "aborted"
    return "completed"
