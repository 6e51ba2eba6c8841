"""slime's rollout function: ``--rollout-function-path buffer.trainer.slime_rollout.generate_rollout``.

It replaces slime's ``slime_plugins/rollout_buffer/rollout_buffer_example.py`` with the same
arguments (``--rollout-buffer-url``, ``--rollout-task-type``, ``--prompt-data``,
``--n-samples-per-prompt``, ``--rollout-batch-size``, ...) and returns what slime's trainer
takes (``RolloutFnTrainOutput`` of ``rollout_batch_size`` groups, ``RolloutFnEvalOutput``):

- it counts groups, not samples, and asks the buffer for the groups the step still needs;
  groups fetched beyond that (a group refused whole) stay in the data source for the next
  step, and every group read is put there as soon as it is converted, so a failure later in
  the step loses nothing;
- a trajectory the converter refuses never fails the step: it is a placeholder in its group,
  counted and logged (`buffer.trainer.slime_samples` has the rules for samples, rewards, log probs
  and branches);
- the rollout keeps going when the generator's pass over the data ends: another pass starts
  (slime's ``--num-rollout`` may need more groups than the passes give, since the buffer
  drops groups with nothing to learn from); a job that failed is an error with its reason;
- ``--apply-chat-template-kwargs`` reach both the engine (the request's
  ``chat_template_kwargs``) and the conversion, so the trained tokens are rendered as the
  generated ones were;
- evaluation runs slime's eval data sets (``--eval-config`` or ``--eval-prompt-data``, see
  `buffer.trainer.slime_eval`) through the buffer as evaluation rollouts;
- the finished groups the buffer reports are recorded in the data source's metadata, so a
  resume sends them back as ``skip_instance_ids``;
- each step tells the buffer the policy version (the ``rollout_id``: slime updates the weights
  between calls), and with ``rollout_buffer_pause`` set ("abort" or "drain") pauses generation
  once the step's batch is read, so no engine request starts while slime trains and syncs the
  weights; the next call resumes it at the new version. ``rollout_buffer_max_staleness`` is
  the task's ``max_staleness``.

``--rollout-top-p`` other than 1 is refused up front: slime then replays the engine's top-p
token sets in training, which the buffer's trajectories do not carry, and would fail its
assertion only after a step's rollout.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput

from buffer.trainer.client import RolloutBufferClient
from buffer.trainer.client.errors import BufferClientError
from buffer.trainer.samples import SampleConverter
from buffer.trainer.slime_eval import eval_output, eval_sets, sampling_params, template_kwargs
from buffer.trainer.slime_samples import (
    Converted,
    RolloutLogProbsMissing,
    SampleBuilder,
    StepCounts,
    convert,
    finish_step,
    log_prob_flags,
    needs_rollout_log_probs,
    normalize_rewards_by_group,
)

__all__ = ["close_sessions", "generate_rollout", "normalize_rewards_by_group"]

logger = logging.getLogger(__name__)

#: Each read waits up to this long for a group (it returns as soon as one is ready); between
#: empty reads the adapter checks that the rollout is still running.
WAIT_S = 5.0
CLIENT_RETRY_S = 90.0  # how long a request to the buffer is retried: a restart takes seconds to a minute


class _TemplateKwargs:
    """A tokenizer whose ``apply_chat_template`` always gets slime's chat-template kwargs
    (``--apply-chat-template-kwargs``, e.g. ``enable_thinking``); the rest is the tokenizer's."""

    def __init__(self, tokenizer: Any, kwargs: Mapping[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._kwargs = dict(kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(*args, **{**self._kwargs, **kwargs})


@dataclass
class _Session:
    """What one trainer process keeps between calls: slime calls ``generate_rollout`` afresh
    every step, so this is the one piece of process state, keyed by buffer URL and task."""

    client: RolloutBufferClient
    tokenizer: Any
    builder: SampleBuilder
    converters: dict[str, SampleConverter] = field(default_factory=dict)
    started: bool = False
    groups_read: int = 0
    #: groups read when the current pass started, and whether it skipped nothing
    groups_at_pass_start: int = 0
    fresh_pass: bool = False
    #: generation is paused by this trainer, until the next step resumes it
    paused: bool = False

    def converter(self, chat_template_kwargs: Mapping[str, Any] | None) -> SampleConverter:
        """One converter per set of chat-template kwargs (each analyses its template once)."""
        key = json.dumps(dict(chat_template_kwargs or {}), sort_keys=True, default=str)
        converter = self.converters.get(key)
        if converter is None:
            tokenizer = self.tokenizer
            if chat_template_kwargs:
                tokenizer = cast(Any, _TemplateKwargs(tokenizer, chat_template_kwargs))
            converter = self.converters[key] = SampleConverter(tokenizer)
        return converter


_SESSIONS: dict[tuple[str, str], _Session] = {}


def close_sessions() -> None:
    """Close the connections kept between calls (at the end of training)."""
    for session in _SESSIONS.values():
        session.client.close()
    _SESSIONS.clear()


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    session = _session(args)
    if evaluation:
        if session.paused:  # evaluation generates too: the pause was for the weight update
            session.client.resume_generation(None)
            session.paused = False
        return _evaluate(args, rollout_id, session)
    return _train(args, rollout_id, data_source, session)


def check_args(args: Any) -> None:
    """Refuse, before anything runs, what slime's trainer would fail on later."""
    top_p = getattr(args, "rollout_top_p", 1.0)
    if top_p != 1.0:
        raise ValueError(
            f"--rollout-top-p {top_p}: slime then trains on the engine's top-p token sets "
            "(rollout_top_p_token_ids), which trajectories from the rollout buffer do not carry; "
            "run with --rollout-top-p 1.0 (--eval-top-p is free to differ)"
        )
    top_k = getattr(args, "rollout_top_k", -1)
    if needs_rollout_log_probs(args) and top_k not in (None, -1, 0):
        flags = log_prob_flags(args)
        raise ValueError(
            f"{flags} with --rollout-top-k {top_k}: SGLang returns logprobs before its top-k filter "
            "(whatever its flags), so they are not the sampling distribution's and an importance ratio "
            f"from them is wrong; run with --rollout-top-k -1, or without {flags}"
        )


def _session(args: Any) -> _Session:
    key = (args.rollout_buffer_url, args.rollout_task_type)
    session = _SESSIONS.get(key)
    if session is None:
        check_args(args)
        session = _SESSIONS[key] = _Session(_client(args), _tokenizer(args), SampleBuilder(args))
    return session


def _tokenizer(args: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)


def _client(args: Any) -> RolloutBufferClient:
    # Patient: a restart of the buffer (on its --data-dir, with its jobs resumed) takes
    # seconds to a minute, and training should ride it out rather than stop.
    return RolloutBufferClient(
        args.rollout_buffer_url,
        api_key=getattr(args, "rollout_buffer_api_key", None),
        max_retry_s=CLIENT_RETRY_S,
    )


def _prompts(path: str) -> int:
    with Path(path).open("rb") as lines:
        return sum(1 for line in lines if line.strip())


def _payload(
    args: Any, *, input_file: str, n: int, num_epoch: int, sampling: dict[str, Any]
) -> dict[str, Any]:
    """slime's ``/start_rollout`` payload, as its example builds it."""
    return {
        "num_process": str(getattr(args, "rollout_num_process", None) or 100),
        "num_epoch": str(num_epoch),
        "remote_engine_url": f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        "remote_buffer_url": args.rollout_buffer_url,
        "input_file": input_file,
        "num_repeat_per_sample": str(n),
        "max_tokens": str(sampling["max_tokens"]),
        "sampling_params": sampling,
        "tokenizer_path": args.hf_checkpoint,
    }


def _staleness(args: Any) -> dict[str, Any]:
    bound = getattr(args, "rollout_buffer_max_staleness", None)
    return {} if bound is None else {"max_staleness": int(bound)}


def _train_payload(args: Any) -> dict[str, Any]:
    """The generator's passes over ``--prompt-data``: ``--num-epoch``, or as many as
    ``--num-rollout`` steps of ``--rollout-batch-size`` groups need (another starts if short)."""
    epochs = getattr(args, "num_epoch", None)
    num_rollout = getattr(args, "num_rollout", None)
    if not epochs and num_rollout:
        prompts = _prompts(args.prompt_data)
        epochs = math.ceil(num_rollout * args.rollout_batch_size / prompts) if prompts else 1
    sampling = sampling_params(
        max_tokens=args.rollout_max_response_len,
        temperature=args.rollout_temperature,
        top_p=getattr(args, "rollout_top_p", 1.0),
        top_k=getattr(args, "rollout_top_k", None),
        stop=getattr(args, "rollout_stop", None),
        chat_template_kwargs=template_kwargs(getattr(args, "apply_chat_template_kwargs", None)),
    )
    # Said, not left to the engine: both take an unset one from the model's generation_config
    # (Qwen3's top_k is 20), and the logprobs are the sampling distribution's only without filters.
    sampling.setdefault("top_k", -1)
    sampling.setdefault("min_p", 0.0)
    payload = _payload(
        args,
        input_file=args.prompt_data,
        n=args.n_samples_per_prompt,
        num_epoch=epochs or 1,
        sampling=sampling,
    )
    return {**payload, **_staleness(args)}


def _start(args: Any, session: _Session, skip: list[Any]) -> None:
    session.client.start_rollout(args.rollout_task_type, **_train_payload(args), skip_instance_ids=skip)
    session.groups_at_pass_start = session.groups_read
    session.fresh_pass = not skip


def _policy_step(args: Any, rollout_id: int, session: _Session) -> None:
    """Tell the buffer which policy the engines serve now; resume generation if this trainer
    paused it. A buffer that knows a higher version (a trainer resumed from an older
    checkpoint) keeps it: logged, not fatal."""
    try:
        if session.paused:
            session.client.resume_generation(rollout_id)
            session.paused = False
        else:
            session.client.set_policy_version(rollout_id)
    except BufferClientError as exc:
        if exc.status_code != 409:
            raise
        logger.warning("the buffer keeps its policy version: %s", exc)
        if session.paused:
            session.client.resume_generation(None)
            session.paused = False


def _pause_after_step(args: Any, session: _Session) -> None:
    mode = getattr(args, "rollout_buffer_pause", None)
    if mode:
        session.client.pause_generation(mode)
        session.paused = True


def _train(args: Any, rollout_id: int, data_source: Any, session: _Session) -> Any:
    counts = StepCounts()
    _policy_step(args, rollout_id, session)
    if not session.started:
        metadata = data_source.get_metadata() or {}
        skip = [instance_id for finished in metadata.values() for instance_id in finished]
        _start(args, session, skip)
        session.started = True
        logger.info("started %s with %d finished groups to skip", args.rollout_task_type, len(skip))
    _fetch(args, rollout_id, data_source, session, counts)
    _pause_after_step(args, session)
    groups = data_source.get_samples(args.rollout_batch_size)
    try:
        shaped = finish_step(args, groups, counts)
    except RolloutLogProbsMissing:
        data_source.add_samples(groups)  # kept for the run that fixes its flags
        raise
    return RolloutFnTrainOutput(samples=shaped, metrics=counts.metrics())


def _fetch(args: Any, rollout_id: int, data_source: Any, session: _Session, counts: StepCounts) -> None:
    """Read until the data source holds ``rollout_batch_size`` groups; each group read is put
    there at once (converted), and the finished instance ids recorded."""
    n = args.n_samples_per_prompt
    converter = session.converter(template_kwargs(getattr(args, "apply_chat_template_kwargs", None)))
    patience = getattr(args, "fetch_trajectory_retry_times", -1)
    waited = 0
    while (held := data_source.get_buffer_length()) < args.rollout_batch_size:
        # Only what the step still needs: groups read ahead would age in the data source,
        # past the buffer's staleness bound, and the buffer learns the batch size it serves.
        wanted = (args.rollout_batch_size - held) * n
        batch = session.client.get_rollout_data(wanted, task_type=args.rollout_task_type, wait_s=WAIT_S)
        if batch.finished_groups:
            recorded = list((data_source.get_metadata() or {}).get(str(rollout_id), []))
            data_source.update_metadata({str(rollout_id): recorded + batch.finished_groups})
        groups = []
        for group in batch.groups(group_size=n):
            session.groups_read += 1
            if len(group) != n:
                logger.warning("skipped a group of %d samples, expected %d", len(group), n)
                continue
            built = session.builder.group([convert(converter, item) for item in group], counts)
            if built is not None:
                groups.append(built)
        data_source.add_samples(groups)
        if batch.items:
            waited = 0
            continue
        waited += 1
        if patience not in (None, -1) and waited >= patience:
            raise TimeoutError(
                f"the buffer gave {held} of {args.rollout_batch_size} groups "
                f"in {waited} waits of {WAIT_S:.0f} s"
            )
        _when_idle(args, session, counts, f"{held} of {args.rollout_batch_size} groups")


def _when_idle(args: Any, session: _Session, counts: StepCounts, progress: str) -> None:
    """Nothing came: wait on while the job runs or groups are still open; when the pass ended
    well, start another; when it failed, say why."""
    task = args.rollout_task_type
    jobs = [job for job in session.client.jobs() if job.task_type == task]
    if any(job.status == "running" for job in jobs):
        logger.info("waiting for the buffer: %s", progress)
        return
    if session.client.stats().tasks.get(task, {}).get("pending_groups", 0):
        return  # open groups finish or time out on their own
    last = max(jobs, key=lambda job: job.started_at or 0.0, default=None)
    if last is None or last.status != "succeeded":
        how = (
            "no job" if last is None else f"its job {last.id} {last.status}: {last.error or 'no error given'}"
        )
        raise RuntimeError(
            f"the {task} rollout is not running ({how}) and the buffer has nothing ready ({progress})"
        )
    if session.fresh_pass and session.groups_read == session.groups_at_pass_start:
        raise RuntimeError(
            f"a whole pass of the {task} rollout over {args.prompt_data} gave no group ({progress})"
        )
    logger.info("the %s rollout's pass over its data ended (%s): starting another", task, progress)
    _start(args, session, skip=[])
    counts.epochs_started += 1


def _evaluate(args: Any, rollout_id: int, session: _Session) -> Any:
    """Run each eval data set through the buffer: slime's ``{name: {"rewards", "truncated",
    "samples"}}``, with what was left out in the metrics."""
    data: dict[str, dict[str, Any]] = {}
    metrics: dict[str, float] = {}
    for spec in eval_sets(args):
        rollout_name = f"eval-{spec.name}-{rollout_id}"
        if getattr(args, "log_passrate", False) and spec.n != getattr(
            args, "n_samples_per_eval_prompt", spec.n
        ):
            logger.warning(
                "evaluation %s: %d samples per prompt, but slime computes pass@k over groups of "
                "--n-samples-per-eval-prompt (%s)",
                spec.name,
                spec.n,
                args.n_samples_per_eval_prompt,
            )
        payload = _payload(args, input_file=spec.path, n=spec.n, num_epoch=1, sampling=spec.sampling)
        session.client.start_rollout(
            args.rollout_task_type, rollout_name=rollout_name, evaluation=True, restart=True, **payload
        )
        groups = _collect(session, rollout_name, _prompts(spec.path) * spec.n, spec.n)
        converter = session.converter(spec.chat_template_kwargs)
        converted: list[list[Converted]] = [[convert(converter, item) for item in group] for group in groups]
        result, counts = eval_output(args, spec, converted)
        metrics |= counts
        if result is not None:
            data[spec.name] = result
    return RolloutFnEvalOutput(data=data, metrics=metrics)


def _collect(
    session: _Session, rollout_name: str, expected: int, n: int, timeout_s: float = 3600.0
) -> list[list[dict[str, Any]]]:
    """The groups of an evaluation run: ``expected`` items, or what there is once its job has
    ended and the buffer has nothing more."""
    groups: list[list[dict[str, Any]]] = []
    items = 0
    deadline = time.monotonic() + timeout_s
    while items < expected and time.monotonic() < deadline:
        batch = session.client.get_rollout_data(task_type=rollout_name, wait_s=WAIT_S)
        groups += batch.groups(group_size=n)
        items += len(batch.items)
        if not batch.items and not _running(session, rollout_name):
            break
    if items < expected:
        logger.warning("evaluation %s: %d of %d samples came back", rollout_name, items, expected)
    return groups


def _running(session: _Session, task_type: str) -> bool:
    return any(job.status == "running" for job in session.client.jobs() if job.task_type == task_type)
