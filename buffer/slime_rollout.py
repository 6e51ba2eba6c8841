"""slime's rollout function: ``--rollout-function-path buffer.slime_rollout.generate_rollout``.

It replaces slime's ``slime_plugins/rollout_buffer/rollout_buffer_example.py`` with the same
arguments (``--rollout-buffer-url``, ``--rollout-task-type``, ``--prompt-data``,
``--n-samples-per-prompt``, ``--rollout-batch-size``, ...) and fixes what that example gets
wrong:

- it counts groups, not samples (the example subtracts a buffer length in groups from a
  number of samples);
- groups fetched beyond this step's need are kept in the data source for the next step
  instead of being dropped;
- every sample is converted by one ``SampleConverter`` (the tokenizer and template analysed
  once), with the template's exact tokens and a loss mask right for multi-turn tool use;
- the finished groups the buffer reports are recorded in the data source's metadata, so a
  resume sends them back as ``skip_instance_ids``;
- evaluation works: the eval data sets run through the buffer as evaluation rollouts (every
  group kept, raw rewards) and come back in slime's eval output.

slime's own types are used when slime is importable; without it (in this project's tests)
``Sample`` and the output types are structural stand-ins with the same fields.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.client import RolloutBufferClient
from buffer.samples import SampleConverter, TrainingSample

logger = logging.getLogger(__name__)

try:  # pragma: no cover - only with slime installed
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
    from slime.utils.types import Sample
except ImportError:

    @dataclass
    class Sample:  # type: ignore[no-redef]
        """The fields of slime's ``slime.utils.types.Sample`` this adapter sets."""

        class Status(enum.Enum):
            PENDING = "pending"
            COMPLETED = "completed"
            TRUNCATED = "truncated"
            ABORTED = "aborted"
            FAILED = "failed"

        group_index: int | None = None
        index: int | None = None
        prompt: str | list[dict[str, Any]] = ""
        tokens: list[int] = field(default_factory=list)
        response: str = ""
        response_length: int = 0
        label: str | None = None
        reward: float | dict[str, Any] | None = None
        loss_mask: list[int] | None = None
        rollout_log_probs: list[float] | None = None
        status: Sample.Status = Status.PENDING
        metadata: dict[str, Any] = field(default_factory=dict)

    @dataclass
    class RolloutFnTrainOutput:  # type: ignore[no-redef]
        samples: list[list[Sample]]
        metrics: dict[str, Any] | None = None

    @dataclass
    class RolloutFnEvalOutput:  # type: ignore[no-redef]
        data: dict[str, dict[str, Any]]
        metrics: dict[str, Any] | None = None


@dataclass
class _Session:
    """What one trainer process keeps between calls: slime calls ``generate_rollout`` afresh
    every step, so this is the one piece of process state, keyed by buffer URL and task."""

    client: RolloutBufferClient
    converter: SampleConverter
    started: bool = False
    groups_made: int = 0


_SESSIONS: dict[tuple[str, str], _Session] = {}

#: Each read waits up to this long for a group (it returns as soon as one is ready); between
#: empty reads the adapter checks that the rollout is still running.
WAIT_S = 5.0
CLIENT_ATTEMPTS = 20  # with backoff up to 10 s between them: about a minute and a half


def close_sessions() -> None:
    """Close the connections kept between calls (at the end of training)."""
    for session in _SESSIONS.values():
        session.client.close()
    _SESSIONS.clear()


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    session = _session(args)
    if evaluation:
        return _evaluate(args, rollout_id, session)
    return _train(args, rollout_id, data_source, session)


def _session(args: Any) -> _Session:
    key = (args.rollout_buffer_url, args.rollout_task_type)
    session = _SESSIONS.get(key)
    if session is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        # Patient: a restart of the buffer (on its --data-dir, with its jobs resumed) takes
        # seconds to a minute, and training should ride it out rather than stop.
        client = RolloutBufferClient(
            args.rollout_buffer_url,
            api_key=getattr(args, "rollout_buffer_api_key", None),
            max_attempts=CLIENT_ATTEMPTS,
        )
        session = _SESSIONS[key] = _Session(client, SampleConverter(tokenizer))
    return session


def _payload(args: Any) -> dict[str, Any]:
    """slime's ``/start_rollout`` payload, as its example builds it."""
    return {
        "num_process": str(getattr(args, "rollout_num_process", None) or 100),
        "num_epoch": str(getattr(args, "num_epoch", None) or 3),
        "remote_engine_url": f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        "remote_buffer_url": args.rollout_buffer_url,
        "input_file": args.prompt_data,
        "num_repeat_per_sample": str(args.n_samples_per_prompt),
        "max_tokens": str(args.rollout_max_response_len),
        "sampling_params": {
            "max_tokens": args.rollout_max_response_len,
            "temperature": args.rollout_temperature,
            "top_p": args.rollout_top_p,
        },
        "tokenizer_path": args.hf_checkpoint,
    }


def _train(args: Any, rollout_id: int, data_source: Any, session: _Session) -> Any:
    n = args.n_samples_per_prompt
    if not session.started:
        metadata = data_source.get_metadata() or {}
        skip = [instance_id for finished in metadata.values() for instance_id in finished]
        session.client.start_rollout(args.rollout_task_type, **_payload(args), skip_instance_ids=skip)
        session.started = True
        logger.info("started %s with %d finished groups to skip", args.rollout_task_type, len(skip))
    needed = args.rollout_batch_size - data_source.get_buffer_length()  # both in groups
    if needed > 0:
        groups, finished, meta = _fetch(args, session, needed, n)
        if finished:
            data_source.update_metadata({str(rollout_id): finished})
        data_source.add_samples([_samples(group, session) for group in groups])
        logger.info(
            "rollout %d: %d groups fetched (%d needed), mean raw reward %.4f",
            rollout_id,
            len(groups),
            needed,
            meta.get("avg_reward", float("nan")),
        )
    return RolloutFnTrainOutput(samples=data_source.get_samples(args.rollout_batch_size))


def _fetch(
    args: Any, session: _Session, needed: int, n: int
) -> tuple[list[list[TrainingSample]], list[Any], dict[str, Any]]:
    """At least ``needed`` groups of exactly ``n`` samples, converted; the finished instance
    ids and the last statistics the buffer reported."""
    groups: list[list[TrainingSample]] = []
    finished: list[Any] = []
    meta: dict[str, Any] = {}
    patience = getattr(args, "fetch_trajectory_retry_times", -1)
    waited = 0
    while len(groups) < needed:
        batch = session.client.get_rollout_data(task_type=args.rollout_task_type, wait_s=WAIT_S)
        finished += batch.finished_groups
        if batch.items:
            meta = batch.meta_info
        for group in batch.groups(group_size=n):
            if len(group) != n:
                logger.warning("skipped a group of %d samples, expected %d", len(group), n)
                continue
            groups.append(session.converter.convert_many(group))
        if not batch.items:
            waited += 1
            if patience not in (None, -1) and waited >= patience:
                raise TimeoutError(
                    f"the buffer gave {len(groups)} of {needed} groups in {waited} waits of {WAIT_S:.0f} s"
                )
            _check_running(session, args.rollout_task_type, f"{len(groups)} of {needed} groups")
            logger.info("waiting for the buffer: %d of %d groups", len(groups), needed)
    return groups, finished, meta


def _samples(group: list[TrainingSample], session: _Session) -> list[Any]:
    session.groups_made += 1
    return [_sample(item, session.groups_made) for item in group]


def _sample(item: TrainingSample, group_index: int) -> Any:
    status = {"truncated": Sample.Status.TRUNCATED, "aborted": Sample.Status.ABORTED}.get(
        item.status, Sample.Status.COMPLETED
    )
    metadata = {
        **item.metadata,
        "uid": item.uid,
        "instance_id": item.instance_id,
        "raw_reward": item.raw_reward,
    }
    return Sample(
        group_index=group_index,
        index=item.instance_id if isinstance(item.instance_id, int) else None,
        prompt=item.uid,
        tokens=item.tokens,
        response_length=item.response_length,
        label=item.metadata.get("label"),
        reward=item.reward,
        loss_mask=item.loss_mask,
        rollout_log_probs=item.rollout_log_probs,
        status=status,
        metadata=metadata,
    )


def _evaluate(args: Any, rollout_id: int, session: _Session) -> Any:
    """Run each eval data set through the buffer and return slime's eval output:
    ``{name: {"rewards": [...], "truncated": [...], "samples": [...]}}``."""
    specs = list(getattr(args, "eval_prompt_data", None) or [])
    n = getattr(args, "n_samples_per_eval_prompt", None) or 1
    max_tokens = getattr(args, "eval_max_response_len", None) or args.rollout_max_response_len
    temperature = getattr(args, "eval_temperature", None)
    top_p = getattr(args, "eval_top_p", None)
    data: dict[str, dict[str, Any]] = {}
    for name, path in zip(specs[::2], specs[1::2], strict=True):
        rollout_name = f"eval-{name}-{rollout_id}"
        payload = {
            **_payload(args),
            "input_file": path,
            "num_repeat_per_sample": str(n),
            "num_epoch": "1",
            "sampling_params": {
                "max_tokens": max_tokens,
                "temperature": args.rollout_temperature if temperature is None else temperature,
                "top_p": args.rollout_top_p if top_p is None else top_p,
            },
        }
        session.client.start_rollout(
            args.rollout_task_type, rollout_name=rollout_name, evaluation=True, restart=True, **payload
        )
        prompts = sum(1 for line in Path(path).read_text().splitlines() if line.strip())
        items = _collect(session, rollout_name, prompts * n)
        samples = [
            _sample(sample, index) for index, sample in enumerate(session.converter.convert_many(items))
        ]
        data[name] = {
            "rewards": [sample.reward for sample in samples],
            "truncated": [sample.status == Sample.Status.TRUNCATED for sample in samples],
            "samples": samples,
        }
    return RolloutFnEvalOutput(data=data)


def _collect(
    session: _Session, rollout_name: str, expected: int, timeout_s: float = 3600.0
) -> list[dict[str, Any]]:
    """Every item of an evaluation run: ``expected`` of them, or what there is once its job
    has ended and the buffer has nothing more."""
    items: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(items) < expected and time.monotonic() < deadline:
        batch = session.client.get_rollout_data(task_type=rollout_name, wait_s=WAIT_S)
        items += batch.items
        if not batch.items and not _running(session, rollout_name):
            break
    if len(items) < expected:
        logger.warning("evaluation %s: %d of %d samples came back", rollout_name, len(items), expected)
    return items


def _running(session: _Session, task_type: str) -> bool:
    return any(job.status == "running" for job in session.client.jobs() if job.task_type == task_type)


def _check_running(session: _Session, task_type: str, progress: str) -> None:
    """Waiting on a task whose job has ended would wait forever: say so instead."""
    if not _running(session, task_type):
        raise RuntimeError(
            f"the {task_type} rollout is not running and the buffer has nothing ready ({progress}); "
            "see GET /jobs on the buffer for how it ended"
        )
