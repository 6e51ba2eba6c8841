"""Trajectories to training samples: `SampleConverter` and its one-off form `to_training_sample`.

Three paths, chosen per trajectory; each sample says which in ``metadata["source"]``, and the converter
counts them (``counts``: a trainer logs it):

- ``"token_records"``: a trajectory with ``turns`` (what the engine received and sampled, per policy
  request) is built from them alone (`buffer.trainer.samples.turns`): nothing is re-tokenised, and its
  logprobs become ``rollout_log_probs``. A turn whose prompt does not extend the previous one's starts
  a new branch: one sample per branch (``convert_all``, ``convert_many``).
- ``"engine_tokens"`` (the older single-turn form): a single-turn trajectory whose ``extra_info``
  carries the engine's ``prompt_token_ids`` and ``token_ids`` is used as generated; its ``logprobs``
  become ``rollout_log_probs``.
- ``"rerendered"``: anything else (text only: slime's own generators) is rendered whole by the
  tokenizer's chat template, so ``tokens`` is ``apply_chat_template(messages, tools=tools)`` with
  the trajectory's own ``tools`` (else the converter's), and the loss mask is 1 only on what the model
  generated of its generated messages (`buffer.trainer.samples.rerender`, ``spans``, ``sampled``), or
  the trajectory is refused. Two exceptions, each for what the model sampled: a last reply sampled inside
  a reasoning block its prompt opened is rendered as that reasoning, and a template that closes no reply
  (GLM-4.5) gets the stop token its model samples after the last reply appended. What the sample holds
  that the model did not see is listed in ``metadata["rerender_notes"]``. Text cannot say how the model
  tokenised it: a sampled non-canonical tokenisation comes back canonical, and no ``rollout_log_probs``
  are given.
  Per-turn token ids of a multi-turn trajectory are not spliced together: the tokens between the turns
  (tool results, user turns, headers) would have to be tokenised on their own, which need not match
  tokenising the conversation, and templates that rewrite earlier turns make the turns as generated differ
  from the conversation trained on. Their log probabilities are dropped for the same reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from buffer.trainer.samples import masking, rerender, sampled, spans, turns
from buffer.trainer.samples.multimodal import multimodal_inputs
from buffer.trainer.samples.sample import SampleConversionError, TrainingSample, sample_status
from buffer.trainer.samples.template import (
    ChatTemplateAnalysis,
    Tools,
    analyse_chat_template,
    render_chat,
    template_errors,
    template_tools,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class SampleConverter:
    """Converts trajectories with one tokenizer, analysing its chat template once, up front.

    ``counts`` counts what it made, by ``metadata["source"]`` (``token_records``, ``engine_tokens``,
    ``rerendered``), and the trajectories it ``refused``: log it with each step (slime's adapter does).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        tools: Tools | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.analysis: ChatTemplateAnalysis = analyse_chat_template(
            tokenizer, tools=tools, template_kwargs=chat_template_kwargs
        )
        self._offsets_warned = False
        self._flagless_warned = False
        self.counts: Counter[str] = Counter()

    def convert_many(self, trajectories: Iterable[Mapping[str, Any]]) -> list[TrainingSample]:
        """Every sample of the trajectories, in order (`convert_all` on each): one per trajectory, or one
        per branch of a trajectory whose token records branched.

        A branch's sample has its trajectory's ``uid``, ``reward`` and ``instance_id``, and ``branches``,
        ``branch`` and ``first_turn`` in its ``metadata``. For a group-normalised loss (GRPO) a trajectory
        is one member of its group however many branches it has: the buffer's ``reward`` is already
        normalised over the group's trajectories, so every branch takes its trajectory's reward as it is
        (docs/trainer.md, "Branches in a GRPO batch"). A trajectory that cannot be converted raises.
        """
        return [sample for trajectory in trajectories for sample in self.convert_all(trajectory)]

    def convert(self, trajectory: Mapping[str, Any]) -> TrainingSample:
        """The trajectory's one sample; `SampleConversionError` if its turns make several branches."""
        samples = self.convert_all(trajectory)
        if len(samples) != 1:
            raise SampleConversionError(
                f"trajectory {trajectory.get('uid')!r}: its turns make {len(samples)} branches (starting "
                f"at turns {', '.join(str(s.metadata.get('first_turn')) for s in samples)}): a turn's prompt "
                "does not extend what the turns before it hold; convert_all returns one sample per branch"
            )
        return samples[0]

    def convert_all(self, trajectory: Mapping[str, Any]) -> list[TrainingSample]:
        """Every sample of the trajectory: one, or one per branch of its token records."""
        try:
            if trajectory.get("turns"):
                samples = self._convert_turns(trajectory)
            else:
                samples = [self._convert(trajectory)]
        except SampleConversionError as exc:
            self.counts["refused"] += 1
            raise SampleConversionError(f"trajectory {trajectory.get('uid')!r}: {exc}") from exc
        self.counts.update(str(sample.metadata.get("source")) for sample in samples)
        return samples

    def _convert_turns(self, trajectory: Mapping[str, Any]) -> list[TrainingSample]:
        reward = _number(trajectory.get("reward"), "reward")
        raw = trajectory.get("raw_reward")
        return turns.samples_from_turns(
            trajectory, reward, reward if raw is None else _number(raw, "raw_reward")
        )

    def _convert(self, trajectory: Mapping[str, Any]) -> TrainingSample:
        messages = trajectory.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise SampleConversionError("messages: not a list of messages")
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        if not turns:
            raise SampleConversionError("messages: no assistant message, so nothing to train on")
        extra_info = trajectory.get("extra_info", {})
        if not isinstance(extra_info, dict):
            raise SampleConversionError("extra_info: not an object")
        reward = _number(trajectory.get("reward"), "reward")
        raw = trajectory.get("raw_reward")
        status = sample_status(extra_info.get("finish_reason"))
        tools = self._tools_of(trajectory)

        generated = None
        if turns == 1 and messages[-1].get("role") == "assistant":
            generated = _engine_tokens(extra_info)
        if generated is not None:
            prompt_ids, response_ids = generated
            tokens, loss_mask = prompt_ids + response_ids, [1] * len(response_ids)
            log_probs = _rollout_log_probs(extra_info, len(response_ids))
            metadata = {**extra_info, "source": "engine_tokens"}
        else:
            if "token_ids" in extra_info:
                logger.debug(
                    "re-tokenising trajectory %r: token ids are used for single-turn ones only",
                    trajectory.get("uid"),
                )
            last_turn_ended = status == "completed" or messages[-1].get("role") != "assistant"
            tokens, loss_mask, notes = self._tokenise(
                messages, tools=tools, last_turn_ended=last_turn_ended, uid=trajectory.get("uid")
            )
            log_probs = None
            metadata = {**extra_info, "source": "rerendered", "rerender_notes": notes}
        return TrainingSample(
            tokens=tokens,
            loss_mask=loss_mask,
            response_length=len(loss_mask),
            reward=reward,
            raw_reward=reward if raw is None else _number(raw, "raw_reward"),
            status=status,
            metadata=metadata,
            rollout_log_probs=log_probs,
            uid=trajectory.get("uid"),
            instance_id=trajectory.get("instance_id"),
            tools=[dict(tool) for tool in tools] if tools is not None else None,
            multimodal_inputs=multimodal_inputs(trajectory),
        )

    def _tools_of(self, trajectory: Mapping[str, Any]) -> Tools | None:
        """The tools the model was given: the trajectory's own, else the converter's."""
        tools = trajectory.get("tools")
        if tools is None:
            return self.tools
        if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
            raise SampleConversionError("tools: not a list of tool schemas")
        return tools

    def _tokenise(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Tools | None, last_turn_ended: bool, uid: Any
    ) -> tuple[list[int], list[int], list[str]]:
        """The conversation's tokens, the loss mask over its response (from the first generated token), and
        the notes on what the sample holds that the model did not see."""
        generated = rerender.generated_messages(messages)
        if not generated:
            raise SampleConversionError("messages: no generated assistant message, so nothing to train on")
        sampled.refuse_undecodable(messages, generated)
        conversation = rerender.prepare_messages(messages, self.analysis)
        moved, untrained = sampled.close_open_reasoning(
            self.tokenizer, self.analysis, conversation, generated, tools
        )
        try:
            text = render_chat(
                self.tokenizer, conversation, tools=tools, template_kwargs=self.analysis.template_kwargs
            )
            ids, offsets = self._encode(conversation, tools)
        except template_errors() as exc:
            raise SampleConversionError(f"the chat template cannot render the messages: {exc}") from exc
        located = spans.generated_spans(
            self.tokenizer,
            self.analysis,
            conversation,
            text,
            tools=tools,
            generated=generated,
            last_turn_ended=last_turn_ended,
            open_reasoning=moved,
            untrained=untrained,
        )
        if not any("generated" in m for m in messages):
            located.notes.insert(0, FLAGLESS)
            if not self._flagless_warned:
                self._flagless_warned = True
                logger.warning("trajectory %r: %s (logged once)", uid, FLAGLESS)
        if offsets is not None and masking.offsets_partition(offsets, len(text)):
            mask = masking.mask_from_offsets(offsets, located.spans)
        else:
            if not self._offsets_warned:
                self._offsets_warned = True
                logger.info(
                    "no usable token offsets from %s; placing tokens by decoding",
                    type(self.tokenizer).__name__,
                )
            mask = masking.mask_from_decoding(self.tokenizer, ids, text, located.spans)
        if located.stop_marker is not None:
            stop = self.tokenizer.encode(located.stop_marker, add_special_tokens=False)
            ids, mask = ids + list(stop), mask + [1] * len(stop)
        if 1 not in mask:
            raise SampleConversionError(
                "no token of the generated messages can be trained as the model's"
                + "".join(f"; {note}" for note in located.notes if note != FLAGLESS)
            )
        return ids, mask[mask.index(1) :], located.notes

    def _encode(
        self, conversation: list[dict[str, Any]], tools: Tools | None
    ) -> tuple[list[int], list[tuple[int, int]] | None]:
        """``apply_chat_template(tokenize=True)``'s token ids, and their character spans if it has them."""
        schemas = template_tools(tools)
        kwargs = dict(self.analysis.template_kwargs)
        try:
            encoding = self.tokenizer.apply_chat_template(
                conversation,
                tools=schemas,
                tokenize=True,
                return_dict=True,
                tokenizer_kwargs={"return_offsets_mapping": True},
                **kwargs,
            )
        except NotImplementedError:  # a tokenizer without offsets (a Python one)
            encoding = self.tokenizer.apply_chat_template(
                conversation, tools=schemas, tokenize=True, return_dict=True, **kwargs
            )
        if not isinstance(encoding, Mapping) or not encoding.get("input_ids"):
            raise SampleConversionError("apply_chat_template(tokenize=True) gave no token ids")
        ids: list[int] = list(encoding["input_ids"])
        offsets: list[tuple[int, int]] | None = encoding.get("offset_mapping")
        return ids, (list(offsets) if offsets is not None and len(offsets) == len(ids) else None)


#: Said once per converter, and on each sample it concerns.
FLAGLESS = (
    "no message is flagged 'generated', so only the assistant messages after the last user message are "
    "trained (flag each generated message 'generated: true' to train earlier ones)"
)


def to_training_sample(
    trajectory: Mapping[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    *,
    tools: Tools | None = None,
) -> TrainingSample:
    """One trajectory as a training sample (for many, build one `SampleConverter` and reuse it)."""
    return SampleConverter(tokenizer, tools=tools).convert(trajectory)


def _number(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SampleConversionError(f"{field}: expected a number, got {value!r}")
    return float(value)


def _per_turn(value: object) -> list[list[Any]] | None:
    """Per-turn lists, accepting one flat list as a single turn."""
    if not isinstance(value, list):
        return None
    if value and all(isinstance(turn, list) for turn in value):
        return value
    if all(not isinstance(item, list) for item in value):
        return [value]
    return None


def _int_list(value: object) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    return None


def _engine_tokens(extra_info: Mapping[str, Any]) -> tuple[list[int], list[int]] | None:
    """The engine's prompt and response token ids of a single-turn trajectory, if it kept valid ones."""
    if "prompt_token_ids" not in extra_info or "token_ids" not in extra_info:
        return None
    prompt_ids = _int_list(extra_info["prompt_token_ids"])
    turns = _per_turn(extra_info["token_ids"])
    response_ids = _int_list(turns[0]) if turns is not None and len(turns) == 1 else None
    if prompt_ids is None or not response_ids:
        logger.warning(
            "extra_info token ids are not one non-empty list of ints for the one turn; re-tokenising instead"
        )
        return None
    return list(prompt_ids), list(response_ids)


def _rollout_log_probs(extra_info: Mapping[str, Any], response_length: int) -> list[float] | None:
    if extra_info.get("logprobs") is None:
        return None
    turns = _per_turn(extra_info["logprobs"])
    values = turns[0] if turns is not None and len(turns) == 1 else None
    if values is None or len(values) != response_length:
        logger.warning(
            "extra_info logprobs do not match the %d response tokens (got %s); rollout_log_probs left None",
            response_length,
            "a malformed value" if values is None else f"{len(values)}",
        )
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        logger.warning("extra_info logprobs hold non-numbers; rollout_log_probs left None")
        return None
    return [float(v) for v in values]
