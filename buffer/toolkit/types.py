"""What a generator's task-specific code receives and returns.

A ``Sample`` is one trajectory to produce: a prompt of the data set, one of its repeats in
one epoch. A rollout turns it into an ``Episode``: the whole conversation and how it ended.
A reward scores an episode; a group reward scores all the episodes of one prompt at once.

A ``Completion`` may carry the tokens the engine received and sampled (``TokenCapture``): the
runner writes them as the trajectory's ``turns``, so the trainer trains on exactly those ids,
and says how they were made (``mode``, continuations as text, continuations that did not extend
the answer) in the trajectory's ``extra_info``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(slots=True)
class TokenCapture:
    """The token ids of one answer, as the engine reported them (after continuing any abort).

    ``prompt_ids`` is the whole prompt the engine received; ``output_ids`` every id it sampled
    after it and ``output_logprobs`` their sampling logprobs (``None`` when the engine gave
    none, else one per id). An aborted answer continued from its ids keeps one prompt; a part
    sampled after another prompt (a continuation as text the engine re-rendered) is recorded
    from that prompt instead. ``weight_version`` is the engine's, where it reports one."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None = None
    weight_version: str | int | None = None
    #: The engine that answered ("vllm" or "sglang"), where the client knows it: what its
    #: logprobs are depends on it (``buffer.logprob_kinds``).
    engine: str | None = None
    #: The policy version of each output id, as runs ``[[version, count], ...]`` (``parts``).
    weight_versions: list[list[Any]] | None = None
    #: The engine's routed experts, one segment per request (``parts.experts_segment``), or None.
    routed_experts: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class Completion:
    """One answer of the policy server (after any continuation of an aborted answer)."""

    text: str
    finish_reason: str
    tool_calls: list[dict[str, Any]] | None = None
    usage: dict[str, int] = field(default_factory=dict)
    latency_s: float = 0.0
    attempts: int = 1  # HTTP requests made, retries and continuations included
    continuations: int = 0  # aborted answers continued
    reasoning_content: str | None = None
    tokens: TokenCapture | None = None
    sampling: dict[str, Any] | None = None  # the request's sampling parameters
    #: How the prompt reached the engine: "token" (token in, token out: rendered once by the
    #: toolkit), "chat" (messages the engine rendered), or None (a client that does not say).
    mode: str | None = None
    #: Continuations made as text (``continue_final_message``: the engine re-rendered the reply
    #: so far), where the engine could not continue from the ids.
    text_continuations: int = 0
    #: Continuations whose prompt, as the engine reported it, was not the answer's so far: each
    #: was recorded from its own prompt (``tokens``), never spliced onto the earlier part.
    mismatched_continuations: int = 0

    @property
    def token_ids(self) -> list[int] | None:
        return self.tokens.output_ids if self.tokens else None

    @property
    def logprobs(self) -> list[float] | None:
        return self.tokens.output_logprobs if self.tokens else None

    def message(self) -> Message:
        """The assistant message to append to the conversation, marked as generated."""
        message: Message = {"role": "assistant", "content": self.text}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
            message["content"] = self.text or None
        message["generated"] = True
        return message


@dataclass(slots=True)
class Sample:
    instance_id: str | int
    row: dict[str, Any]  # the data set's row as read: prompt, label and any other fields
    messages: list[Message]  # the prompt as chat messages
    epoch: int
    repeat: int  # 0 .. num_repeat_per_sample - 1
    seed: int  # deterministic: base seed, instance, repeat and epoch

    @property
    def label(self) -> Any:
        return self.row.get("label")


@dataclass(slots=True)
class Episode:
    messages: list[Message]  # the whole conversation, prompt first
    finish_reason: str  # the last completion's: "stop", "length", "abort", "tool_calls"
    completions: list[Completion] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # the OpenAI tool schemas the model was given

    @property
    def response(self) -> str:
        """The text of the last assistant message ("" when there is none)."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                content = message.get("content")
                return content if isinstance(content, str) else ""
        return ""


RewardFn = Callable[[Sample, Episode], "float | Awaitable[float]"]
GroupRewardFn = Callable[
    [Sequence[Sample], Sequence[Episode]], "Sequence[float] | Awaitable[Sequence[float]]"
]
