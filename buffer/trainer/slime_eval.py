"""Evaluation for slime through the buffer: the data sets slime configured, and its eval output.

slime resolves ``--eval-config`` (or the ``--eval-prompt-data`` name/path pairs) into
``args.eval_datasets``, one entry per data set with its own samples per prompt, sampling
settings and chat-template kwargs, each falling back to the ``--eval-*`` and then the
``--rollout-*`` flags. `eval_sets` reads those, or the pairs when slime did not resolve them.

`eval_output` shapes one data set's groups for ``log_eval_rollout_data``, which divides by the
number of rewards and, with ``--log-passrate``, reshapes them into groups of
``n_samples_per_eval_prompt``. So only whole groups count: a group with a failed trajectory
(the generator's reward -1: a failure of the run, not a wrong answer) or one that came back
short is left out of the rewards, its samples counted in the metrics instead; a data set with
no whole group is left out of the output, said in the log and the metrics.

A trajectory is exactly one eval sample with the trajectory's reward, however its turns
branched: one whose turns branched holds every branch's response (`merged`), since an eval
sample is logged, never trained, and slime's response-length metrics should count all that was
generated, not the last branch alone. A trajectory the converter refused counts its reward and
holds a typical sibling's tokens (`buffer.trainer.slime_samples.typical`), so those metrics do
not log it as an empty answer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from buffer.trainer.samples import TrainingSample
from buffer.trainer.slime_samples import FAILURE_REWARD, Converted, number, to_sample, typical

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EvalSet:
    """One evaluation data set as the buffer runs it."""

    name: str
    path: str
    n: int
    sampling: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def sampling_params(
    *,
    max_tokens: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any = None,
    stop: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The generator's ``sampling_params`` (sent as the engine request's fields): what is set."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
    if top_k is not None and top_k != -1:
        params["top_k"] = top_k
    if stop:
        params["stop"] = list(stop)
    if chat_template_kwargs:  # vLLM's and SGLang's OpenAI servers take it as a request field
        params["chat_template_kwargs"] = dict(chat_template_kwargs)
    return params


def eval_sets(args: Any) -> list[EvalSet]:
    configs = getattr(args, "eval_datasets", None)
    if configs:
        return [_from_config(args, config) for config in configs]
    pairs = list(getattr(args, "eval_prompt_data", None) or [])
    if len(pairs) == 1:  # slime's legacy form: one path, named aime
        pairs = ["aime", pairs[0]]
    if len(pairs) % 2:
        raise ValueError("--eval-prompt-data takes name/path pairs")
    return [_from_flags(args, name, path) for name, path in zip(pairs[::2], pairs[1::2], strict=True)]


def template_kwargs(value: Any) -> dict[str, Any]:
    """``--apply-chat-template-kwargs``: a dict once slime has parsed it, JSON text before."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else {}
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"--apply-chat-template-kwargs: expected a JSON object, got {value!r}")
    return dict(value)


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _from_flags(args: Any, name: str, path: str) -> EvalSet:
    kwargs = template_kwargs(getattr(args, "apply_chat_template_kwargs", None))
    return EvalSet(
        name=name,
        path=path,
        n=_first(getattr(args, "n_samples_per_eval_prompt", None), 1),
        sampling=sampling_params(
            max_tokens=_first(getattr(args, "eval_max_response_len", None), args.rollout_max_response_len),
            temperature=_first(getattr(args, "eval_temperature", None), args.rollout_temperature),
            top_p=_first(getattr(args, "eval_top_p", None), getattr(args, "rollout_top_p", None), 1.0),
            top_k=_first(getattr(args, "eval_top_k", None), getattr(args, "rollout_top_k", None)),
            stop=getattr(args, "rollout_stop", None),
            chat_template_kwargs=kwargs,
        ),
        chat_template_kwargs=dict(kwargs),
    )


def _from_config(args: Any, config: Any) -> EvalSet:
    """An ``EvalDatasetConfig``: slime has already filled its fields from the flags."""
    base = _from_flags(args, config.name, config.path)
    own = getattr(config, "apply_chat_template_kwargs", None)
    kwargs = base.chat_template_kwargs if own is None else template_kwargs(own)
    return EvalSet(
        name=config.name,
        path=config.path,
        n=_first(getattr(config, "n_samples_per_eval_prompt", None), base.n),
        sampling=sampling_params(
            max_tokens=_first(getattr(config, "max_response_len", None), base.sampling["max_tokens"]),
            temperature=_first(getattr(config, "temperature", None), base.sampling["temperature"]),
            top_p=_first(getattr(config, "top_p", None), base.sampling["top_p"]),
            top_k=_first(getattr(config, "top_k", None), base.sampling.get("top_k")),
            stop=_first(getattr(config, "stop", None), base.sampling.get("stop")),
            chat_template_kwargs=kwargs,
        ),
        chat_template_kwargs=dict(kwargs),
    )


def eval_output(
    args: Any, spec: EvalSet, groups: Sequence[Sequence[Converted]]
) -> tuple[dict[str, Any] | None, dict[str, float]]:
    """``{"rewards", "truncated", "samples"}`` over the whole groups, or None when there is no
    whole group; and the counts of what was left out, as ``eval/<name>-...`` metrics.

    Each trajectory of a whole group is one sample and one reward, in the same order, so every
    trajectory's reward counts once (pass@k and the mean alike): a branched one is its branches
    `merged` into one sample, never a sample per branch, nor its last branch alone."""
    reward_key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    samples: list[Any] = []
    rewards: list[float] = []
    failed = dropped = refused = 0
    for group in groups:
        values = [_eval_reward(c.item, reward_key) for c in group]
        failures = sum(1 for value in values if value is None or value == FAILURE_REWARD)
        if failures or len(group) != spec.n:
            failed += failures
            dropped += 1
            continue
        group_index = len(rewards) // spec.n
        whole = [merged(c.samples) if c.samples else None for c in group]
        kept = [(one, None) for one in whole if one is not None]
        stand_in = typical(kept)[0] if kept else None
        for c, converted, value in zip(group, whole, values, strict=True):
            refused += c.refusal is not None
            sample = to_sample(c.item, converted, group_index, len(rewards), c.item.get("reward"))
            if converted is None and stand_in is not None:  # logged as a typical answer, not an empty one
                sample.tokens = list(stand_in.tokens)
                sample.response_length = stand_in.response_length
                sample.loss_mask = list(stand_in.loss_mask)
                sample.metadata["refused"] = c.refusal
            samples.append(sample)
            rewards.append(value)  # type: ignore[arg-type]  # not None: checked above
    metrics = {
        f"eval/{spec.name}-groups": float(len(rewards) // spec.n),
        f"eval/{spec.name}-dropped_groups": float(dropped),
        f"eval/{spec.name}-failed_samples": float(failed),
        f"eval/{spec.name}-refused_samples": float(refused),
    }
    if dropped:
        logger.warning(
            "evaluation %s: %d groups left out (%d failed samples, or the group came back short)",
            spec.name,
            dropped,
            failed,
        )
    if not rewards:
        logger.warning("evaluation %s: no whole group came back; the data set is left out", spec.name)
        return None, metrics
    truncated = [sample.status == type(sample).Status.TRUNCATED for sample in samples]
    return {"rewards": rewards, "truncated": truncated, "samples": samples}, metrics


def _eval_reward(item: Mapping[str, Any], reward_key: str | None) -> float | None:
    reward = item.get("reward")
    if isinstance(reward, Mapping):
        reward = reward.get(reward_key) if reward_key else None
    return number(reward)


def merged(samples: Sequence[TrainingSample]) -> TrainingSample:
    """One sample holding every branch's response, after the first branch's prompt: for logging
    only (the tokens of a later branch's response follow a context it was not generated in)."""
    if len(samples) == 1:
        return samples[0]
    first, last = samples[0], samples[-1]
    responses = [one.tokens[one.prompt_length :] for one in samples]
    log_probs = [one.rollout_log_probs for one in samples]
    return dataclasses.replace(
        last,
        tokens=first.tokens[: first.prompt_length] + [token for part in responses for token in part],
        loss_mask=[mask for one in samples for mask in one.loss_mask],
        response_length=sum(one.response_length for one in samples),
        rollout_log_probs=None
        if any(part is None for part in log_probs)
        else [value for part in log_probs for value in part or []],
        weight_versions=[version for one in samples for version in one.weight_versions],
    )
