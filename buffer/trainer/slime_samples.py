"""slime ``Sample``s from converted trajectories, and what a step's batch must be for slime's trainer.

slime's ``RolloutManager`` flattens what the rollout function returns, normalises the
rewards, builds one train-data dict and turns each per-sample list into a tensor. Each rule
here keeps one of those steps from failing or training on the wrong thing:

- ``reward``: the raw reward when slime normalises per group itself (a GRPO-family
  ``--advantage-estimator`` without ``--disable-rewards-normalization``), the buffer's
  task-normalised reward otherwise: normalised once either way. ``metadata["raw_reward"]``
  is always the raw one (slime logs it).
- ``metadata`` is the trajectory's ``extra_info`` with its ``uid``, ``instance_id``,
  ``raw_reward`` and ``round_number`` (assistant turns) on every sample: slime reads a key
  off every sample once the first has it.
- ``index`` counts trajectories in this process (instance ids may be strings; the id is in
  ``metadata["instance_id"]``), ``group_index`` counts groups, and ``rollout_id`` is the
  trajectory's ``index``.
- A trajectory the converter refuses (``SampleConversionError``) keeps its place and its
  reward in its group, as a placeholder slime trains nothing on (``remove_sample``, status
  FAILED, the reason in ``metadata["refused"]``), so the group's baseline and its size stay
  right; it holds a typical sibling's tokens and loss mask, so slime's response-length metrics
  are not pulled to 0 (`_placeholder`). A group with nothing convertible is dropped. Both are
  counted.
- One sample per trajectory, whatever branches: a group is exactly ``n_samples_per_prompt``
  samples, as slime's reward normalisation (``_post_process_rewards`` reshapes by it) and
  ``log_passrate`` (``compute_pass_rate`` asserts ``rollout_batch_size`` groups of it) require.
  A trajectory whose turns branched (a template that rewrote history) is its last branch:
  the tokens the engine saw for its last turns, the earlier turns in them as context (loss
  mask 0). The earlier branches' samples are not trained on (their tokens are not in the
  last branch's context as generated), counted in ``dropped_branches``.
- Images: slime's trainer takes a sample's pixels from ``multimodal_train_inputs`` alone (the
  processor's output for the images, minus the prompt's ``input_ids`` and ``attention_mask``, as
  slime's own rollout builds them), never from ``multimodal_inputs`` (the raw images, kept for
  logging). `ImageInputs` builds them with the processor of ``--hf-checkpoint``, loaded the first
  time a sample has images; a checkpoint without one (a text-only model) changes nothing. A
  sample whose image tokens are not as many as the processor makes for its images is refused
  (the model's forward would fail on the whole batch).
- ``rollout_log_probs`` are all set or all None in a step (slime decides from the first
  sample and cannot make a tensor of None). When ``--use-tis``, ``--use-rollout-logprobs``
  or ``--get-mismatch-metrics`` reads them, a sample without them (text only) stays in its
  group for the baseline but is removed from the loss, with 0.0 log probs; a step where no
  sample has them is a configuration error, said at once. When nothing reads them, a mixed
  step drops them all rather than log a mismatch against made-up values. A sample already
  removed from the loss (a refused one) gets 0.0 and never forces either choice.
- Policy versions and routed experts: with ``--mask-offpolicy-in-partial-rollout``, response
  tokens sampled under a policy older than the sample's newest (an answer continued across a
  weight update) are masked out of the loss (``TrainingSample.off_policy_mask``), counted
  (``off_policy_tokens``); ``rollout_routed_experts`` is the trajectory's routed experts
  (``return_routed_experts``), shape ``(len(tokens) - 1, num_layers, moe_router_topk)``.
- Sampling logprobs or none: a sample whose engine logprobs are not the sampling
  distribution's (``TrainingSample.log_probs_withheld``: vLLM without ``--logprobs-mode
  processed_logprobs`` at a temperature other than 1, SGLang with top-k, ...) has none, the
  reason in ``metadata["log_probs_withheld"]``, counted (``withheld_log_probs``) and said once
  per trainer process. A step that has such a sample is refused when a flag reads rollout log
  probs (``RolloutLogProbsNotSampling``): an importance ratio from them would be wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import math
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from buffer.keys import key_or_env
from buffer.trainer.samples import SampleConversionError, SampleConverter, TrainingSample
from buffer.trainer.samples.experts import INT32

try:
    from slime.utils.types import Sample
except ImportError as exc:  # pragma: no cover - the adapter runs inside slime's trainer
    raise ImportError(
        "buffer.trainer.slime_rollout runs inside slime's trainer: slime is not importable here"
    ) from exc

logger = logging.getLogger(__name__)

#: Estimators whose advantages slime normalises per group (``_post_process_rewards``), and those
#: it also divides by the group's std (unless ``--disable-grpo-std-normalization``).
GROUP_NORMALISED = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
STD_NORMALISED = frozenset({"grpo", "gspo", "cispo"})
#: slime's flags that read ``rollout_log_probs`` in the loss.
LOG_PROB_FLAGS = ("use_tis", "use_rollout_logprobs", "get_mismatch_metrics")
#: The reward a generator writes for a trajectory that failed (``default_func.FAILURE_REWARD``).
FAILURE_REWARD = -1.0

#: One trajectory in a group: its slime ``Sample``.
Entry = Any


class RolloutLogProbsMissing(RuntimeError):
    """A loss that needs rollout log probs, and a step in which no sample has them."""


class RolloutLogProbsNotSampling(RolloutLogProbsMissing):
    """A loss that needs rollout log probs, and a step with samples whose engine logprobs are not
    the sampling distribution's."""


def slime_normalises_rewards(args: Any) -> bool:
    return getattr(args, "advantage_estimator", "grpo") in GROUP_NORMALISED and bool(
        getattr(args, "rewards_normalization", True)
    )


def needs_rollout_log_probs(args: Any) -> bool:
    return any(getattr(args, flag, False) for flag in LOG_PROB_FLAGS)


def log_prob_flags(args: Any) -> str:
    """The flags set that read rollout log probs, as slime's command line spells them."""
    return ", ".join("--" + flag.replace("_", "-") for flag in LOG_PROB_FLAGS if getattr(args, flag, False))


@dataclass(slots=True)
class Converted:
    """One trajectory read from the buffer and what conversion made of it: one sample, one
    per branch, or none with the reason it was refused."""

    item: dict[str, Any]
    samples: list[TrainingSample]
    refusal: str | None = None


def convert(converter: SampleConverter, item: dict[str, Any]) -> Converted:
    """Convert one trajectory; a refusal is recorded, never raised.

    A converter with ``convert_all`` (one sample per branch) is used through it; one with
    ``convert`` alone gives one sample."""
    convert_all = getattr(converter, "convert_all", None)
    try:
        samples = list(convert_all(item)) if convert_all is not None else [converter.convert(item)]
    except SampleConversionError as exc:
        return Converted(item, [], str(exc))
    if not samples:
        return Converted(item, [], "the converter gave no sample")
    return Converted(item, samples)


@dataclass(slots=True)
class StepCounts:
    """What one step's samples needed besides converting, for slime's rollout metrics."""

    refused_samples: int = 0
    refused_groups: int = 0
    branched_trajectories: int = 0
    #: Samples of earlier branches of branched trajectories: not trained on (the last branch is).
    dropped_branches: int = 0
    removed_without_log_probs: int = 0
    dropped_log_probs: int = 0
    withheld_log_probs: int = 0
    #: Samples re-rendered from text (``metadata["source"] == "rerendered"``), not from token records.
    rerendered_samples: int = 0
    epochs_started: int = 0
    #: Response tokens masked out as sampled under an older policy (``--mask-offpolicy-in-partial-rollout``).
    off_policy_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"rollout_buffer/{name}": float(value) for name, value in asdict(self).items()}


#: What slime's rollout leaves out of the processor's output (``_PROCESSOR_PROMPT_KEYS`` in
#: slime/rollout/sglang_rollout.py): the prompt's ids, which are the sample's tokens here.
PROCESSOR_PROMPT_KEYS = frozenset({"input_ids", "attention_mask"})
#: The buffer's own reference to an image it keeps (``<service>/images/<sha256>``).
_BUFFER_IMAGE = re.compile(r"/images/([0-9a-f]{64})$")
IMAGE_TIMEOUT_S = 60.0


class ImageInputs:
    """slime's ``multimodal_train_inputs`` for a sample with images: what the processor of
    ``--hf-checkpoint`` makes of them (pixel values, grids), minus ``PROCESSOR_PROMPT_KEYS``, as
    slime's own rollout builds them (``_prepare_prompt_ids``, with ``build_processor_kwargs``).

    The processor gets the images as the engine got them (the trajectory's URLs, loaded) and
    one image token per image as its text: only its count of image tokens is read, to check that
    the sample's tokens hold as many (``SampleConversionError`` otherwise: the model's forward
    would fail on the whole batch). It is loaded the first time a sample has images; a checkpoint
    with none (a text-only model, slime's ``load_processor`` gives None) leaves the inputs None.
    """

    def __init__(self, args: Any) -> None:
        self.checkpoint = getattr(args, "hf_checkpoint", None)
        self.buffer_url = getattr(args, "rollout_buffer_url", None)
        self.api_key = key_or_env(getattr(args, "rollout_buffer_api_key", None))
        self.loaded = False
        self.processor: Any = None

    def _load(self) -> Any:
        if not self.loaded:
            from slime.utils.processing_utils import load_processor

            self.loaded = True
            self.processor = load_processor(self.checkpoint, trust_remote_code=True)
            if self.processor is None:
                logger.warning(
                    "samples have images and %s has no processor (a text-only model): trained as text",
                    self.checkpoint,
                )
        return self.processor

    def build(self, sample: TrainingSample) -> dict[str, Any] | None:
        urls = list((sample.multimodal_inputs or {}).get("images") or [])
        if not urls or (processor := self._load()) is None:
            return None
        from slime.utils.processing_utils import build_processor_kwargs

        token = getattr(processor, "image_token", None)
        if not isinstance(token, str):
            raise SampleConversionError(f"the processor of {self.checkpoint} names no image_token")
        images = [load_image(url, self.buffer_url, self.api_key) for url in urls]
        output = processor(text=token * len(images), **build_processor_kwargs({"images": images}))
        token_id = getattr(processor, "image_token_id", None)
        if token_id is not None:
            made = list(output["input_ids"][0]).count(token_id)
            held = sample.tokens.count(token_id)
            if made != held:
                raise SampleConversionError(
                    f"the processor of {self.checkpoint} makes {made} image tokens of the sample's "
                    f"{len(images)} images, and its tokens hold {held} (the engine processed them otherwise)"
                )
        return {key: value for key, value in output.items() if key not in PROCESSOR_PROMPT_KEYS} or None


def load_image(url: str, buffer_url: str | None, api_key: str | None) -> Any:
    """A trajectory's image (a ``data:`` URL, or one to fetch) as a PIL image."""
    from PIL import Image, UnidentifiedImageError  # type: ignore[import-not-found, unused-ignore]  # slime installs it

    try:
        image = Image.open(io.BytesIO(image_bytes(url, buffer_url, api_key)))
        image.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise SampleConversionError(f"image {url[:80]!r} cannot be read: {exc}") from exc
    return image


def image_bytes(url: str, buffer_url: str | None, api_key: str | None) -> bytes:
    if url.startswith("data:"):
        try:
            return base64.b64decode(url.partition(",")[2], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise SampleConversionError(f"image {url[:80]!r}: not base64: {exc}") from exc
    if not url.startswith(("http://", "https://")):
        raise SampleConversionError(f"image {url[:80]!r}: neither a data: URL nor an http(s) one")
    headers = {}
    if buffer_url and (match := _BUFFER_IMAGE.search(url)):
        # the buffer's own reference names its local address, which the trainer may not reach
        url = f"{buffer_url.rstrip('/')}/images/{match.group(1)}"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    import httpx

    try:
        response = httpx.get(url, headers=headers, timeout=IMAGE_TIMEOUT_S, follow_redirects=True)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise SampleConversionError(f"image {url[:80]!r} cannot be fetched: {exc}") from exc
    return response.content


class SampleBuilder:
    """Builds slime's groups for one trainer process, numbering groups and trajectories."""

    def __init__(self, args: Any) -> None:
        self.raw_rewards = slime_normalises_rewards(args)
        self.images = ImageInputs(args)
        self.mask_off_policy = bool(getattr(args, "mask_offpolicy_in_partial_rollout", False))
        self.experts_shape = (getattr(args, "num_layers", None), getattr(args, "moe_router_topk", None))
        self.groups_made = 0
        self.trajectories_made = 0
        self.said_withheld = False
        #: Why the last group dropped was dropped (for the error when no group is ever kept).
        self.last_refusal: str | None = None

    def group(self, converted: Sequence[Converted], counts: StepCounts) -> list[Entry] | None:
        """One group's entries, or None when nothing in it can be trained on."""
        converted, images = self._with_images(converted)
        kept = [(c.samples[-1], inputs) for c, inputs in zip(converted, images, strict=True) if c.samples]
        template, template_images = typical(kept) if kept else (None, None)
        rewards = [_reward(c.item, raw=self.raw_rewards) for c in converted]
        if template is None or None in rewards:
            counts.refused_groups += 1
            counts.refused_samples += sum(1 for c in converted if c.refusal is not None)
            reasons = "; ".join(sorted({c.refusal for c in converted if c.refusal}))
            self.last_refusal = reasons or "a reward that is not a number"
            logger.warning(
                "dropped the group of %r: %s", converted[0].item.get("instance_id"), self.last_refusal
            )
            return None
        group_index = self.groups_made
        self.groups_made += 1
        entries: list[Entry] = []
        for c, reward, train_inputs in zip(converted, rewards, images, strict=True):
            index = self.trajectories_made
            self.trajectories_made += 1
            if c.refusal is not None:
                counts.refused_samples += 1
                logger.warning(
                    "refused trajectory %r kept as a placeholder: %s", c.item.get("uid"), c.refusal
                )
                entries.append(_placeholder(c, template, template_images, group_index, index, reward))
                continue
            last = c.samples[-1]  # a branched trajectory: its last branch (see the module's docstring)
            if len(c.samples) > 1:
                counts.branched_trajectories += 1
                counts.dropped_branches += len(c.samples) - 1
            counts.rerendered_samples += int(last.metadata.get("source") == "rerendered")
            self._count_withheld([last], counts)
            sample = to_sample(c.item, last, group_index, index, reward)
            sample.multimodal_train_inputs = train_inputs
            if self.mask_off_policy and last.token_versions is not None:
                sample.loss_mask = last.on_policy_loss_mask()
                counts.off_policy_tokens += sum(last.off_policy_mask())
            if last.routed_experts is not None:
                sample.rollout_routed_experts = routed_experts(
                    last.routed_experts, len(last.tokens) - 1, self.experts_shape
                )
            entries.append(sample)
        return entries

    def _with_images(self, converted: Sequence[Converted]) -> tuple[list[Converted], list[Any]]:
        """The group with each sample's ``multimodal_train_inputs`` (`ImageInputs`); a sample whose
        images cannot be made train inputs is refused."""
        kept: list[Converted] = []
        images: list[Any] = []
        for c in converted:
            inputs = None
            if c.samples:
                try:
                    inputs = self.images.build(c.samples[-1])
                except SampleConversionError as exc:
                    c = Converted(c.item, [], str(exc))
            kept.append(c)
            images.append(inputs)
        return kept, images

    def _count_withheld(self, samples: Sequence[TrainingSample], counts: StepCounts) -> None:
        for one in samples:
            reason = getattr(one, "log_probs_withheld", None)
            if reason is None:
                continue
            counts.withheld_log_probs += 1
            if not self.said_withheld:
                self.said_withheld = True
                logger.warning(
                    "rollout log probs withheld: %s (said once; rollout_buffer/withheld_log_probs counts "
                    "the samples). --use-tis and --use-rollout-logprobs refuse such steps",
                    reason,
                )


def to_sample(
    item: Mapping[str, Any], converted: TrainingSample | None, group_index: int, index: int, reward: Any
) -> Any:
    """slime's ``Sample`` for one trajectory (or one of its branches)."""
    metadata = {
        **(converted.metadata if converted is not None else item.get("extra_info") or {}),
        "uid": item.get("uid"),
        "instance_id": item.get("instance_id"),
        "raw_reward": item.get("raw_reward", item.get("reward")),
        # slime reads it off every sample once the first has it (its multi-turn metrics)
        "round_number": _rounds(item),
    }
    sample = Sample(
        group_index=group_index,
        index=index,
        rollout_id=index,
        prompt=_prompt(item),
        response=_response(item),
        label=_label(metadata),
        reward=reward,
        status=_status(converted.status if converted is not None else None),
        metadata=metadata,
    )
    if converted is not None:
        sample.tokens = list(converted.tokens)
        sample.response_length = converted.response_length
        sample.loss_mask = list(converted.loss_mask)
        sample.rollout_log_probs = (
            None if converted.rollout_log_probs is None else list(converted.rollout_log_probs)
        )
        withheld = getattr(converted, "log_probs_withheld", None)
        if withheld is not None:
            sample.metadata["log_probs_withheld"] = withheld
        versions = getattr(converted, "weight_versions", None) or []
        sample.weight_versions = [str(version) for version in versions if version is not None]
        images = getattr(converted, "multimodal_inputs", None)
        if images is not None:
            sample.multimodal_inputs = images
    return sample


def routed_experts(raw: bytes, rows: int, shape: tuple[Any, Any]) -> Any:
    """slime's ``rollout_routed_experts``: int32 of shape ``(rows, num_layers, moe_router_topk)``
    (``--num-layers``, ``--moe-router-topk``; without them, one layer of the row's width), a torch
    tensor in slime (lists where torch is not installed: the tests' stand-in)."""
    width = len(raw) // (INT32 * rows)
    layers, topk = shape
    if not isinstance(layers, int) or not isinstance(topk, int) or layers * topk != width:
        layers, topk = 1, width
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]  # slime installs it
    except ImportError:
        flat = array("i", raw).tolist()
        return [
            [flat[(r * layers + layer) * topk : (r * layers + layer + 1) * topk] for layer in range(layers)]
            for r in range(rows)
        ]
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(rows, layers, topk)


def typical(samples: Sequence[tuple[TrainingSample, Any]]) -> tuple[TrainingSample, Any]:
    """The sample (with its image inputs) of median trained length: a refused sibling's stand-in."""
    return sorted(samples, key=lambda pair: sum(pair[0].loss_mask))[(len(samples) - 1) // 2]


def _placeholder(
    c: Converted, template: TrainingSample, images: Any, group_index: int, index: int, reward: Any
) -> Any:
    """A refused trajectory in its group: its reward counts, its tokens (a sibling's) do not.

    slime logs response lengths (``log_rollout_data``: ``response_len/*`` and the effective
    tokens per second, over ``effective_response_length``, the sum of the loss mask) before it
    builds the train data, over every sample of the step: a loss mask of zeros would log the
    refused trajectory as an empty answer (min 0, the mean pulled down). The placeholder holds a
    sibling's tokens, images and loss mask, the sibling of median trained length (`typical`),
    so it counts as a typical answer of its group. ``remove_sample`` keeps it out of the loss:
    slime zeroes the loss mask of such a sample when it builds the train data, as it does for a
    sample without rollout log probs (`finish_step`)."""
    sample = to_sample(c.item, None, group_index, index, reward)
    sample.tokens = list(template.tokens)
    sample.response_length = template.response_length
    sample.loss_mask = list(template.loss_mask)
    sample.multimodal_train_inputs = images
    sample.remove_sample = True
    sample.status = Sample.Status.FAILED
    sample.metadata["refused"] = c.refusal
    return sample


def finish_step(args: Any, groups: list[list[Entry]], counts: StepCounts) -> list[list[Entry]]:
    """The step's groups as slime's trainer takes them: ``rollout_log_probs`` on every sample or
    on none (see the module's docstring)."""
    samples = list(flatten(groups))
    have = [sample for sample in samples if sample.rollout_log_probs is not None]
    if have:  # a removed sample's log probs are never read: zeros never force a choice
        for sample in samples:
            if sample.rollout_log_probs is None and sample.remove_sample:
                sample.rollout_log_probs = [0.0] * sample.response_length
    lacking = [sample for sample in samples if sample.rollout_log_probs is None]
    if needs_rollout_log_probs(args):
        flags = log_prob_flags(args)
        withheld = [
            sample.metadata["log_probs_withheld"]
            for sample in lacking
            if not sample.remove_sample and "log_probs_withheld" in sample.metadata
        ]
        if withheld:
            raise RolloutLogProbsNotSampling(
                f"{flags} needs the sampling distribution's log probs, and {len(withheld)} of this step's "
                f"{len(samples)} samples have engine logprobs that are not: {withheld[0]}. An importance "
                f"ratio from them would be wrong; fix the engine's setting or run without {flags}."
            )
        if not have:
            raise RolloutLogProbsMissing(
                f"{flags} needs rollout log probs, and none of this step's {len(samples)} samples has them: "
                "the task's generator writes text only. Record the engine's tokens (the trajectory's turns) "
                f"or run without {flags}."
            )
        for sample in lacking:
            sample.rollout_log_probs = [0.0] * sample.response_length
            sample.remove_sample = True
        counts.removed_without_log_probs = len(lacking)
        if lacking:
            logger.warning(
                "%d samples have no rollout log probs (text only): kept in their groups, not trained on",
                len(lacking),
            )
    elif have and lacking:
        for sample in samples:
            sample.rollout_log_probs = None
        counts.dropped_log_probs = len(have)
        logger.info(
            "dropped the rollout log probs of %d samples: %d of the step's samples have none",
            len(have),
            len(lacking),
        )
    return groups


def flatten(node: Iterable[Any]) -> Iterable[Any]:
    for child in node:
        if isinstance(child, list):
            yield from flatten(child)
        else:
            yield child


def normalize_rewards_by_group(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """slime's ``--custom-reward-post-process-path`` for groups of uneven size.

    slime's own normalisation reshapes the rewards by ``n_samples_per_prompt`` and, when the
    step is not exactly that many per group, treats the whole batch as one group (the adapter
    always gives whole groups, one sample per trajectory; kept for runs that set it). This normalises
    within each ``group_index``, counting each trajectory (``rollout_id``) once, with slime's
    arithmetic: minus the mean, and over the (sample) std plus 1e-6 for GRPO, GSPO and CISPO.
    """
    raw = [float(sample.get_reward_value(args)) for sample in samples]
    if not slime_normalises_rewards(args):
        return raw, raw
    divide = args.advantage_estimator in STD_NORMALISED and getattr(args, "grpo_std_normalization", True)
    per_group: dict[Any, dict[Any, float]] = {}
    for sample, reward in zip(samples, raw, strict=True):
        per_group.setdefault(sample.group_index, {})[sample.rollout_id] = reward
    scale: dict[Any, tuple[float, float]] = {}
    for group_index, by_trajectory in per_group.items():
        values = list(by_trajectory.values())
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        scale[group_index] = (mean, std + 1e-6 if divide else 1.0)
    normalised = []
    for sample, reward in zip(samples, raw, strict=True):
        mean, divisor = scale[sample.group_index]
        normalised.append((reward - mean) / divisor)
    return raw, normalised


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _reward(item: Mapping[str, Any], *, raw: bool) -> float | None:
    if raw and item.get("raw_reward") is not None:
        return number(item["raw_reward"])
    return number(item.get("reward"))


def _status(status: str | None) -> Any:
    return {
        "truncated": Sample.Status.TRUNCATED,
        "aborted": Sample.Status.ABORTED,
    }.get(status or "", Sample.Status.COMPLETED)


def _label(metadata: Mapping[str, Any]) -> str | None:
    label = metadata.get("label")
    return None if label is None else str(label)


def _prompt(item: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages before the first assistant message (slime's chat-format prompt)."""
    messages = item.get("messages") or []
    prompt = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") == "assistant":
            break
        prompt.append(dict(message))
    return prompt


def _rounds(item: Mapping[str, Any]) -> int:
    """The assistant turns of the trajectory (as slime's rollout-buffer generators count them)."""
    messages = item.get("messages") or []
    return sum(1 for m in messages if isinstance(m, Mapping) and m.get("role") == "assistant")


def _response(item: Mapping[str, Any]) -> str:
    """The last assistant message's text (slime logs it and checks it for repetition)."""
    for message in reversed(item.get("messages") or []):
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""
