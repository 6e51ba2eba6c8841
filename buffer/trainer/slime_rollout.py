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
- each step tells the buffer the policy version in the engines' numbering (`policy_version`:
  slime's ``weight_version`` of the policy that trains on the step), and with
  ``rollout_buffer_pause`` set ("abort" or "drain") pauses generation once the step's batch
  is read, so no engine request starts while slime trains and syncs the weights; the next
  call resumes it at the new version. ``rollout_buffer_max_staleness`` is the task's
  ``max_staleness``; ``rollout_buffer_replay_ratio`` the share of each read the buffer's replay
  pool may serve again (its trajectories keep their rollout logprobs and versions).

``--rollout-top-p`` other than 1 is refused up front: slime then replays the engine's top-p
token sets in training, which the buffer's trajectories do not carry, and would fail its
assertion only after a step's rollout.
"""

from __future__ import annotations

import argparse
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
from buffer.trainer.sglang_router import engine_urls
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

__all__ = ["add_arguments", "close_sessions", "generate_rollout", "normalize_rewards_by_group"]

logger = logging.getLogger(__name__)

#: Each read waits up to this long for a group (it returns as soon as one is ready); between
#: empty reads the adapter checks that the rollout is still running.
WAIT_S = 5.0
#: A step stops with the reason once this many groups in a row (at least the minimum) were
#: refused whole: without it, a run whose every trajectory is refused reads on forever.
REFUSED_GROUPS_PER_STEP = 8
REFUSED_GROUPS_MIN = 32
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
    #: groups kept (not refused whole), and since the last one kept, the groups read
    groups_kept: int = 0
    refused_in_a_row: int = 0
    #: groups read and kept when the current pass started, and whether it skipped nothing
    groups_at_pass_start: int = 0
    kept_at_pass_start: int = 0
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


def add_arguments(parser: Any) -> Any:
    """The adapter's own settings as command-line flags: slime's ``add_custom_arguments`` hook
    (``slime.utils.arguments.parse_args(add_custom_arguments=add_arguments)``). Without it
    slime's parser drops them without a word (Megatron parses with ``parse_known_args``); a
    ``--custom-config-path`` YAML with the same names (``rollout_buffer_pause: abort``) works too."""
    group = parser.add_argument_group("rollout-buffer adapter (buffer.slime_rollout)")
    group.add_argument(
        "--rollout-buffer-pause",
        choices=["abort", "drain"],
        default=None,
        help="pause generation once a step's batch is read, until the next step (abort or drain "
        "the requests in flight); unset: generation goes on while slime trains",
    )
    group.add_argument(
        "--rollout-buffer-max-staleness",
        type=int,
        default=None,
        help="the task's max_staleness: admit trajectories at most this many policy versions old",
    )
    group.add_argument(
        "--rollout-buffer-replay-ratio",
        type=_replay_ratio,
        default=0.0,
        help="the share of each step's groups the buffer may serve again from its replay pool "
        "(the service started with --replay-capacity); 0: fresh groups only",
    )
    group.add_argument(
        "--rollout-num-process",
        type=int,
        default=None,
        help="trajectories the generator keeps in flight (the /start_rollout num_process; default 100)",
    )
    group.add_argument(
        "--rollout-buffer-api-key",
        default=None,
        help="the buffer's API key (its --api-key)",
    )
    return parser


def _replay_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share of each read, at least 0 and below 1")
    return value


def _differs(default: Any) -> Any:
    return lambda value, args: value is not None and value != default


#: slime's rollout flags the adapter cannot honour: (attribute, is it set?, why and what to do).
#: Each is a step of slime's own rollout (``slime/rollout/sglang_rollout.py``); with the buffer,
#: the task's generator makes the trajectories and their rewards.
_REFUSED: tuple[tuple[str, Any, str], ...] = (
    (
        "partial_rollout",
        _differs(False),
        "slime keeps aborted samples to continue them next step; the buffer's generator continues "
        "an aborted answer itself, each token's policy version recorded: --mask-offpolicy-in-partial-"
        "rollout alone masks the tokens sampled under an older one",
    ),
    (
        "over_sampling_batch_size",
        lambda value, args: value is not None and value != getattr(args, "rollout_batch_size", value),
        "the adapter reads exactly the groups a step needs; the buffer already drops groups with "
        "nothing to learn from (its is_valid_group hook)",
    ),
    (
        "dynamic_sampling_filter_path",
        _differs(None),
        "filter groups in the task's generator (its is_valid_group hook), where they are made",
    ),
    (
        "rollout_sample_filter_path",
        _differs(None),
        "filter samples in the task's generator (its is_valid_group or filter hooks)",
    ),
    (
        "rollout_all_samples_process_path",
        _differs(None),
        "the adapter sees only the groups it reads, not every sample generated",
    ),
    (
        "custom_generate_function_path",
        _differs(None),
        "the task's generator (--rollout-task-type) generates; put the custom generation there",
    ),
    (
        "rm_type",
        _differs(None),
        "the task's generator computes the rewards (e.g. the toolkit's MathReward); drop --rm-type",
    ),
    ("custom_rm_path", _differs(None), "the task's generator computes the rewards; drop --custom-rm-path"),
    ("group_rm", _differs(False), "the task's generator computes the rewards (its group_reward)"),
    (
        "metadata_key",
        _differs("metadata"),
        "the generator gets every field of a row as it is; name the field 'metadata' in the data set",
    ),
    (
        "tool_key",
        _differs("tools"),
        "the generator gets every field of a row as it is; name the field 'tools' in the data set",
    ),
)


def _flag(attribute: str) -> str:
    return "--" + attribute.replace("_", "-")


def _refuse_unhonoured(args: Any) -> None:
    refused = [
        f"{_flag(name)} {getattr(args, name)!r}: {why}"
        for name, is_set, why in _REFUSED
        if is_set(getattr(args, name, None), args)
    ]
    for name in ("eval_input_key", "eval_label_key", "eval_tool_key"):
        train_value = getattr(args, name.removeprefix("eval_"), None)
        value = getattr(args, name, None)
        if value is not None and value != train_value:
            refused.append(
                f"{_flag(name)} {value!r}: evaluation reads its data sets with the training keys "
                f"({_flag(name.removeprefix('eval_'))} {train_value!r}); name the fields alike"
            )
    for config in getattr(args, "eval_datasets", None) or []:
        for key in ("input_key", "label_key", "tool_key", "metadata_key", "rm_type", "custom_rm_path"):
            value = getattr(config, key, None)
            train_value = getattr(args, key, None)
            if value is not None and value != train_value:
                refused.append(
                    f"--eval-config data set {getattr(config, 'name', '?')!r}: {key} {value!r} "
                    f"differs from the training {train_value!r}; the adapter reads every data set alike"
                )
    max_prompt = getattr(args, "rollout_max_prompt_len", None)
    context = getattr(args, "rollout_max_context_len", None)
    if max_prompt is not None and (context is None or max_prompt != context - 1):
        refused.append(
            f"--rollout-max-prompt-len {max_prompt}: slime drops longer prompts from its own data "
            "source; the buffer's generator reads --prompt-data itself and drops none; filter the data set"
        )
    if refused:
        raise ValueError(
            "slime flags the rollout buffer adapter does not honour (rather than ignore them):\n- "
            + "\n- ".join(refused)
        )


def check_args(args: Any) -> None:
    """Refuse, before anything runs, what slime's trainer would fail on later, and slime's rollout
    flags the adapter cannot honour."""
    _refuse_unhonoured(args)
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
        # slime's data set flags: the fields of the prompt and the label, the seed of the plan
        # (its order and each sample's sampling seed); `--rollout-shuffle` is the training's only
        "input_key": getattr(args, "input_key", None) or "prompt",
        "label_key": getattr(args, "label_key", None) or "label",
        "seed": int(getattr(args, "rollout_seed", 42)),
        "shuffle": False,
    }


def _staleness(args: Any) -> dict[str, Any]:
    """The task's ``max_staleness``, with slime's batch in groups (``--rollout-batch-size``
    prompts), so admission is sized by what a step reads from its first group on."""
    bound = getattr(args, "rollout_buffer_max_staleness", None)
    if bound is None:
        return {}
    batch = getattr(args, "rollout_batch_size", None)
    return {"max_staleness": int(bound), **({"rollout_batch_size": int(batch)} if batch else {})}


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
    stop_token_ids = getattr(args, "rollout_stop_token_ids", None)
    if stop_token_ids:
        sampling["stop_token_ids"] = [int(token) for token in stop_token_ids]
    payload = _payload(
        args,
        input_file=args.prompt_data,
        n=args.n_samples_per_prompt,
        num_epoch=epochs or 1,
        sampling=sampling,
    )
    payload["shuffle"] = bool(getattr(args, "rollout_shuffle", False))
    return {**payload, **_staleness(args)}


def _start(args: Any, session: _Session, skip: list[Any]) -> None:
    session.client.start_rollout(args.rollout_task_type, **_train_payload(args), skip_instance_ids=skip)
    session.groups_at_pass_start = session.groups_read
    session.kept_at_pass_start = session.groups_kept
    session.fresh_pass = not skip


def policy_version(args: Any, rollout_id: int) -> int:
    """The policy that trains on step ``rollout_id``'s data, in the engines' numbering.

    slime's weight updaters count updates (``weight_version``, from
    ``update_weight_start_version``, 0 unless set): the push before the first step makes
    the engines serve version 1, and one more follows every ``--update-weights-interval``
    steps. Step ``rollout_id`` trains the policy the trainer holds then, which the engines
    will serve as this version: the same version that serves the step under ``train.py``,
    one past it under ``train_async.py`` (the step is generated while the previous one
    trains), so the buffer's lag is the true lag in both. A run resumed at
    ``--start-rollout-id`` counts from there, as the engines do."""
    start = getattr(args, "update_weight_start_version", None) or 0
    first = getattr(args, "start_rollout_id", None) or 0
    interval = getattr(args, "update_weights_interval", None) or 1
    return int(start) + 1 + max(0, rollout_id - int(first)) // int(interval)


def _policy_step(args: Any, rollout_id: int, session: _Session) -> None:
    """Tell the buffer the policy version of this step (`policy_version`); resume generation if
    this trainer paused it. A buffer that knows a higher version (a trainer resumed from an
    older checkpoint) keeps it: logged, not fatal."""
    version = policy_version(args, rollout_id)
    try:
        if session.paused:
            session.client.resume_generation(version)
            session.paused = False
        else:
            session.client.set_policy_version(version)
    except BufferClientError as exc:
        if exc.status_code != 409:
            raise
        logger.warning("the buffer keeps its policy version: %s", exc)
        if session.paused:
            session.client.resume_generation(None)
            session.paused = False


def _pause_after_step(args: Any, session: _Session) -> None:
    """Pause generation (``rollout_buffer_pause``); in ``abort`` mode the engines behind slime's
    router are named, so the buffer has them abort what is in flight (the router forwards no
    pause: ``buffer.trainer.sglang_router``)."""
    mode = getattr(args, "rollout_buffer_pause", None)
    if not mode:
        return
    if mode == "abort":
        router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
        session.client.pause_generation(mode, engine_urls=engine_urls(router))
    else:
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
        # The replay ratio only when one is set: a buffer without the pool knows no such field.
        replay = (
            {"replay_ratio": ratio} if (ratio := getattr(args, "rollout_buffer_replay_ratio", None)) else {}
        )
        batch = session.client.get_rollout_data(
            wanted, task_type=args.rollout_task_type, wait_s=WAIT_S, **replay
        )
        if batch.finished_groups:
            recorded = list((data_source.get_metadata() or {}).get(str(rollout_id), []))
            data_source.update_metadata({str(rollout_id): recorded + batch.finished_groups})
        groups = []
        for group in batch.groups(group_size=n):
            session.groups_read += 1
            session.refused_in_a_row += 1
            if len(group) != n:
                logger.warning("skipped a group of %d samples, expected %d", len(group), n)
                session.builder.last_refusal = f"a group of {len(group)} samples, expected {n}"
                continue
            built = session.builder.group([convert(converter, item) for item in group], counts)
            if built is not None:
                groups.append(built)
                session.groups_kept += 1
                session.refused_in_a_row = 0
        data_source.add_samples(groups)
        _check_refusals(args, session)
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


def refusal_limit(args: Any) -> int:
    """How many groups in a row may be refused whole before the step stops with the reason."""
    return max(REFUSED_GROUPS_MIN, REFUSED_GROUPS_PER_STEP * int(args.rollout_batch_size))


def _check_refusals(args: Any, session: _Session) -> None:
    if session.refused_in_a_row >= refusal_limit(args):
        raise RuntimeError(
            f"the last {session.refused_in_a_row} groups of the {args.rollout_task_type} rollout were all "
            f"refused (the last: {session.builder.last_refusal}); {session.groups_kept} of "
            f"{session.groups_read} groups read were kept"
        )


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
    read = session.groups_read - session.groups_at_pass_start
    if session.groups_kept == session.kept_at_pass_start and (read or session.fresh_pass):
        why = (
            f"all {read} groups read were refused (the last: {session.builder.last_refusal})"
            if read
            else "none"
        )
        raise RuntimeError(
            f"a whole pass of the {task} rollout over {args.prompt_data} gave no group to train on: "
            f"{why} ({progress})"
        )
    logger.info("the %s rollout's pass over its data ended (%s): starting another", task, progress)
    _start(args, session, skip=[])
    counts.epochs_started += 1


def _evaluate(args: Any, rollout_id: int, session: _Session) -> Any:
    """Run each eval data set through the buffer: slime's ``{name: {"rewards", "truncated",
    "samples"}}``, with what was left out in the metrics.

    Every data set's job starts first and all are collected after, so they run at once. Each data
    set is one task, ``eval-<name>``, reused by every evaluation; an evaluation leaves it with
    nothing ready, no group pending and no job running (`_collect`)."""
    specs = eval_sets(args)
    tasks = {spec.name: f"eval-{spec.name}" for spec in specs}  # one task per data set, reused
    for spec in specs:
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
        _drain(session, tasks[spec.name])
        session.client.start_rollout(
            args.rollout_task_type,
            rollout_name=tasks[spec.name],
            evaluation=True,
            restart=True,
            **payload,
        )
    data: dict[str, dict[str, Any]] = {}
    metrics: dict[str, float] = {}
    for spec in specs:
        groups = _collect(session, tasks[spec.name], _prompts(spec.path) * spec.n, spec.n)
        converter = session.converter(spec.chat_template_kwargs)
        converted: list[list[Converted]] = [[convert(converter, item) for item in group] for group in groups]
        result, counts = eval_output(args, spec, converted)
        metrics |= counts
        if result is not None:
            data[spec.name] = result
    return RolloutFnEvalOutput(data=data, metrics=metrics)


def _drain(session: _Session, rollout_name: str) -> None:
    """Stop an earlier evaluation of this data set still running and throw away what it left
    ready, so this one counts only its own groups."""
    earlier = [job for job in session.client.jobs() if job.task_type == rollout_name]
    if not earlier:
        return  # the first evaluation of this data set: the buffer has no such task yet
    for job in earlier:
        if job.status == "running":
            session.client.cancel_job(job.id)
    left = 0
    while batch := session.client.get_rollout_data(task_type=rollout_name, wait_s=0.0).items:
        left += len(batch)
    if left:
        logger.warning("evaluation %s: threw away %d samples an earlier evaluation left", rollout_name, left)


def _collect(
    session: _Session, rollout_name: str, expected: int, n: int, timeout_s: float = 3600.0
) -> list[list[dict[str, Any]]]:
    """The groups of an evaluation run: ``expected`` items, or what there is once its job has
    ended and no group of its task is pending (an open group finishes or times out on its own).
    Past ``timeout_s`` its job is cancelled, so nothing of it runs on after the evaluation."""
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
        for job in session.client.jobs():
            if job.task_type == rollout_name and job.status == "running":
                session.client.cancel_job(job.id)
    return groups


def _running(session: _Session, task_type: str) -> bool:
    """Whether more may come: the task's job runs, or a group of it is pending (open groups
    finish or time out on their own)."""
    if any(job.status == "running" for job in session.client.jobs() if job.task_type == task_type):
        return True
    return bool(session.client.stats().tasks.get(task_type, {}).get("pending_groups", 0))
