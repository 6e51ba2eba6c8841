"""The trajectory the toolkit writes for one sample of the plan: its messages, reward and
``extra_info`` (the row's fields, the plan's ``epoch`` and ``repeat``, the sampling, the usage
and latency of its completions, how it was generated), its turns' token records and the policy
versions of its requests. A sample that failed is written too, with ``FAILURE_REWARD`` and the
error, never with ``content: null``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from buffer.toolkit.records import LogprobsJudge, turn_records
from buffer.toolkit.stamp import stamp
from buffer.toolkit.types import Completion, Episode, Sample
from default_func import FAILURE_REWARD


def build_trajectory(
    sample: Sample,
    episode: Episode | None,
    reward: float | None,
    error: BaseException | None,
    *,
    task_type: str,
    sampling: dict[str, Any],
    client_mode: str | None,
    logprobs: LogprobsJudge,
    versions: list[int] | None,
) -> dict[str, Any]:
    """``sample``'s trajectory: ``episode`` scored ``reward``, or failed with ``error``.
    ``client_mode``: the client's mode, for one without answers; ``versions``: the policy
    versions its requests were served by (None: not recorded)."""
    completions = episode.completions if episode else []
    messages = list(episode.messages) if episode else [*sample.messages, {"role": "assistant", "content": ""}]
    info: dict[str, Any] = {key: value for key, value in sample.row.items() if key != "instance_id"}
    usage: dict[str, int] = {}
    for completion in completions:
        for key, count in completion.usage.items():
            usage[key] = usage.get(key, 0) + count
    info.update(
        finish_reason=episode.finish_reason if episode and error is None else "error",
        round_number=sum(1 for m in messages if m.get("role") == "assistant"),
        timestamp=time.time(),
        sampling_params=sampling,
        seed=sample.seed,
        epoch=sample.epoch,
        repeat=sample.repeat,
        latency_s=round(sum(c.latency_s for c in completions), 4),
        usage=usage,
        attempts=sum(c.attempts for c in completions),
        continuations=sum(c.continuations for c in completions),
        generation_mode=generation_mode(completions, client_mode),
        text_continuations=sum(c.text_continuations for c in completions),
        mismatched_continuations=sum(c.mismatched_continuations for c in completions),
    )
    if error is not None:
        info["error"] = f"{type(error).__name__}: {error}"
    trajectory: dict[str, Any] = {
        "uid": str(uuid.uuid4()),
        "instance_id": sample.instance_id,
        "messages": messages,
        "reward": FAILURE_REWARD if reward is None else reward,
        "extra_info": info,
        "task_type": task_type,
    }
    if episode is not None and episode.tools:
        trajectory["tools"] = episode.tools
    turns = turn_records(messages, completions, logprobs) if episode is not None else None
    if turns is not None:
        trajectory["turns"] = turns
    if versions is not None:
        stamp(trajectory, completions, versions)
    return trajectory


def generation_mode(completions: list[Completion], client_mode: str | None) -> str | None:
    """How a trajectory's answers were made: "token" (token in, token out) or "chat"."""
    modes = sorted({c.mode for c in completions if c.mode is not None})
    return "+".join(modes) if modes else client_mode
