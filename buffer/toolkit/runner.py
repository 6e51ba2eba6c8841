"""Running a task: the plumbing every generator shares.

A generator states what is specific to its task and hands the rest to ``run_rollouts``::

    async def run_rollout(data):
        async with MathReward() as reward:
            await run_rollouts(data, reward=reward)

``run_rollouts`` reads the data set, plans the samples (repeats, epochs, seeded shuffle,
skipped instances), keeps ``num_process`` trajectories in flight as asyncio tasks (not
operating-system processes), runs each rollout against the policy server, scores it and
writes it to the buffer. A trajectory that fails after its retries is written with
``FAILURE_REWARD`` (the default ``filter_item`` drops it) and counted: never lost silently,
never with ``content: null``. One the buffer refuses as invalid is counted (``rejected``), the
run goes on, and at its end fails with ``RejectedTrajectory`` saying how many and why the
first. Progress goes to the log and to the job (``GET /jobs/{id}``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import functools
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from typing import Annotated, Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from buffer.current import current_job
from buffer.logprob_kinds import LogprobsMode
from buffer.policy.admission import Admits
from buffer.policy.gate import Gate, recording
from buffer.policy.slots import SlotTime
from buffer.policy.stale import StaleGroups
from buffer.toolkit.agent import single_turn
from buffer.toolkit.dataset import Plan, ResumePoint, read_rows
from buffer.toolkit.engines import Engine
from buffer.toolkit.failfast import FailFast, MisconfiguredEngine
from buffer.toolkit.following import PlanSamples, follow
from buffer.toolkit.llm import ChatClient, ContinuePolicy, EngineClient, LLMStats, RetryPolicy
from buffer.toolkit.offload import Offload
from buffer.toolkit.pool import group_key, routing_key
from buffer.toolkit.records import LogprobsJudge
from buffer.toolkit.sink import HttpSink, RejectedTrajectory, TrajectorySink, open_sink
from buffer.toolkit.tito import TokenClient, TokenRenderer, tokenizer_for
from buffer.toolkit.trajectory import build_trajectory
from buffer.toolkit.transport import Transport
from buffer.toolkit.types import Completion, Episode, GroupRewardFn, Message, RewardFn, Sample

logger = logging.getLogger(__name__)

#: Upper bounds of the completion latency histogram on ``Progress`` (seconds; +Inf implied).
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

Rollout = Callable[..., Awaitable[Episode]]


class RolloutSettings(BaseModel):
    """The fields of the ``/start_rollout`` payload the toolkit reads; the rest is ignored."""

    model_config = ConfigDict(extra="ignore")

    task_type: str = "default"
    input_file: str
    remote_engine_url: str | Annotated[list[str], Field(min_length=1)] = Field(
        description="the policy server, or several: a pool (least in flight, a group on one engine)"
    )
    remote_buffer_url: str | None = None
    num_repeat_per_sample: int = Field(1, ge=1)
    num_epoch: int = Field(1, ge=1)
    num_process: int = Field(100, ge=1, description="trajectories in flight")
    max_tokens: int | None = Field(None, ge=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    skip_instance_ids: list[str | int] = Field(default_factory=list)
    resume: dict[str, Any] | None = Field(
        None, description="set by the service when it resumes the job: what its earlier run produced"
    )
    seed: int = 0
    shuffle: bool = True
    input_key: str = Field(
        "prompt", description="the data set's field holding the prompt (slime's --input-key)"
    )
    label_key: str = Field(
        "label", description="the data set's field holding the label (slime's --label-key)"
    )
    model: str = "default"
    engine_api_key: str | None = None
    buffer_api_key: str | None = None
    request_timeout_s: float = Field(600.0, gt=0)
    max_retry_s: float = Field(
        120.0, ge=0, description="how long a failed request to the policy server is retried, in seconds"
    )
    max_attempts: int | None = Field(
        None, ge=1, description="at most this many HTTP attempts per request to the policy server"
    )
    abort_retry_delay_s: float = Field(
        0.5, ge=0, description="wait before continuing an abort that brought no new token (doubled each time)"
    )
    max_continuations: int = Field(8, ge=0, description="continuations of one aborted answer at most")
    progress_interval_s: float = Field(10.0, gt=0)
    capture: bool = Field(True, description="ask the engine for token ids and logprobs; write them as turns")
    return_routed_experts: bool = Field(False, description="routed experts per turn (MoE routing replay)")
    engine: Engine = Field("auto", description="the policy server: vllm, sglang, or auto (fields of both)")
    token_mode: bool | None = Field(
        None,
        description="token in, token out: render with tokenizer_path, talk to /generate or /v1/completions; "
        "null (the default): whenever tokenizer_path is given and loads; false: the chat protocol",
    )
    tokenizer_path: str | None = Field(None, description="the served model's tokenizer (slime sends it)")
    logprobs_mode: LogprobsMode | None = Field(
        None,
        description="the engine's logprobs mode as it was started (vLLM's --logprobs-mode; SGLang with "
        "SGLANG_RETURN_ORIGINAL_LOGPROB: raw_logprobs); null: the engine's default. It says whether "
        "its logprobs are the sampling distribution's (turns' logprobs field)",
    )
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    fail_fast_after: int = Field(
        20,
        ge=1,
        description="trajectories in a row refused the same way (a 4xx, or a 500 the engine gives every "
        "time) before the run fails",
    )
    follow_policy: bool = Field(
        True,
        description="writing to a buffer in another process: mirror its pauses and staleness bound "
        "(GET /policy/watch, POST /policy/admit); false: ignore them",
    )

    def sampling(self) -> dict[str, Any]:
        params = dict(self.sampling_params)
        if self.max_tokens is not None:
            params.setdefault("max_tokens", self.max_tokens)
        return params


@dataclass
class Progress:
    task_type: str
    total: int
    started: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    cancelled_stale: int = 0  # samples of groups stale in flight: not written (``buffer.policy.stale``)
    #: Trajectories whose last answer was still aborted after its continuations (written with
    #: ``finish_reason: "abort"``, which the default ``filter_item`` drops).
    aborted: int = 0
    #: Continuations of aborted answers made as text (the engine could not take the ids), and
    #: those whose prompt was not the answer's so far (recorded from their own prompt).
    text_continuations: int = 0
    mismatched_continuations: int = 0
    #: LLM requests: HTTP requests to the policy server, and those that retried a failure,
    #: counted for the answers that came.
    requests: int = 0
    retries: int = 0
    #: HTTP requests to the policy server that failed (5xx, 429, a dropped connection, a
    #: timeout, ...), counted as they fail, whether a retry then got an answer or not; by kind.
    request_failures: int = 0
    request_failures_by_kind: dict[str, int] = field(default_factory=dict)
    #: Completions per latency bucket (not cumulative; the last one is +Inf), and their sum.
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0
    #: Answers by finish_reason ("length": truncated), and the length of those whose length is
    #: known (the engine's usage.completion_tokens, else the token ids captured).
    finish_reasons: dict[str, int] = field(default_factory=dict)
    response_tokens_sum: int = 0
    response_tokens_count: int = 0
    started_at: float = field(default_factory=time.monotonic)
    #: The gate the run's engine requests pass, under a buffer's policy (``buffer.policy``).
    gate: Gate | None = None
    #: Where the run's slots spent the open time (``buffer.policy.slots``).
    slot_time: SlotTime | None = None

    @property
    def in_flight(self) -> int:
        return self.started - self.completed - self.cancelled_stale

    def record(self, completions: list[Completion]) -> None:
        """Count the LLM requests of one episode's completions (a continuation is no retry)."""
        for completion in completions:
            self.requests += completion.attempts
            self.retries += max(0, completion.attempts - 1 - completion.continuations)
            self.text_continuations += completion.text_continuations
            self.mismatched_continuations += completion.mismatched_continuations
            self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_S, completion.latency_s)] += 1
            self.latency_sum_s += completion.latency_s
            reason = completion.finish_reason
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
            tokens = completion.usage.get("completion_tokens")
            if tokens is None and completion.token_ids is not None:
                tokens = len(completion.token_ids)
            if tokens is not None:
                self.response_tokens_sum += tokens
                self.response_tokens_count += 1

    def count_failures(self, stats: LLMStats, since: LLMStats) -> None:
        """Take the request failures a client has counted (``stats``) since ``since``."""
        self.request_failures = stats.failures - since.failures
        self.request_failures_by_kind = dict(stats.failures_by_kind - since.failures_by_kind)

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers for the job: the latency buckets cumulative, keyed by their bound."""
        elapsed = time.monotonic() - self.started_at
        hidden = ("started_at", "task_type", "latency_counts", "latency_sum_s", "gate", "slot_time")
        cumulative = list(itertools.accumulate(self.latency_counts))
        return {
            **{f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if f.name not in hidden},
            "in_flight": self.in_flight,
            "elapsed_s": round(elapsed, 1),
            "trajectories_per_s": round(self.completed / elapsed, 2) if elapsed > 0 else 0.0,
            "latency_s_buckets": {
                **{repr(le): count for le, count in zip(LATENCY_BUCKETS_S, cumulative, strict=False)},
                "+Inf": cumulative[-1],
            },
            "latency_s_count": cumulative[-1],
            "latency_s_sum": round(self.latency_sum_s, 6),
            **self._gate_figures(),
        }

    def _gate_figures(self) -> dict[str, Any]:
        """Under a buffer's policy: seconds paused, seconds open, and the integral of engine
        requests in flight over the open time (``gate_busy_s / gate_open_s``: their mean)."""
        if self.gate is None:
            return {}
        gate = self.gate.snapshot()
        open_s = float(gate["open_s"])
        return {
            "gate_paused_s": float(gate["paused_s"]),
            "gate_open_s": open_s,
            "gate_busy_s": round(float(gate["mean_in_flight_open"]) * open_s, 4),
            **({"slot_s": self.slot_time.snapshot()} if self.slot_time is not None else {}),
        }

    def line(self) -> str:
        s = self.snapshot()
        share = f" ({100 * s['completed'] / s['total']:.1f}%)" if s["total"] else ""
        failures = f", {s['request_failures']} LLM requests failed" if s["request_failures"] else ""
        aborted = f", {s['aborted']} left aborted" if s["aborted"] else ""
        return (
            f"{self.task_type}: {s['completed']}/{s['total']} trajectories{share}, "
            f"{s['trajectories_per_s']}/s, {s['failed']} failed{aborted}, "
            f"{s['in_flight']} in flight{failures}"
        )


async def run_rollouts(
    data: dict[str, Any],
    *,
    reward: RewardFn | None = None,
    group_reward: GroupRewardFn | None = None,
    rollout: Rollout = single_turn,
    prompt: Callable[[dict[str, Any]], list[Message]] | None = None,
    sink: TrajectorySink | None = None,
    llm: EngineClient | None = None,
) -> Progress:
    """Run the task ``data`` describes (the trainer's ``/start_rollout`` payload).

    - ``reward(sample, episode) -> float`` scores each trajectory, or ``group_reward(samples,
      episodes) -> [float]`` scores each prompt's group at once; sync or async.
    - ``rollout(llm, sample, **sampling) -> Episode`` runs one trajectory (default: one
      answer; ``functools.partial(run_tools, tools=[...])`` for a tool-using agent).
    - ``prompt(row) -> messages`` builds the prompt from a data set row (default: its
      ``prompt`` field, a string or chat messages).
    - ``sink`` and ``llm`` replace the defaults (the buffer ``data`` names, the engine it names).

    The run fails with ``MisconfiguredEngine`` (the engine's message) when the policy server
    refuses requests as a misconfigured one does (a wrong model name, ``failfast.py``).
    """
    if (reward is None) == (group_reward is None):
        raise TypeError("run_rollouts takes exactly one of reward and group_reward")
    settings = RolloutSettings.model_validate(data)
    rows = await asyncio.to_thread(
        read_rows, settings.input_file, input_key=settings.input_key, label_key=settings.label_key
    )
    if prompt is not None:
        rows = [{**row, "prompt": prompt(row)} for row in rows]
    plan = Plan(
        rows,
        num_repeat_per_sample=settings.num_repeat_per_sample,
        num_epoch=settings.num_epoch,
        seed=settings.seed,
        shuffle=settings.shuffle,
        skip_instance_ids=settings.skip_instance_ids,
        resume=ResumePoint.from_json(settings.resume) if settings.resume else None,
        share=_worker_share(data),
    )
    progress = Progress(settings.task_type, plan.total())
    own_sink = sink is None
    own_llm = llm is None
    if llm is None:  # first: a token mode without its tokenizer fails before anything is opened
        tokenizer = await asyncio.to_thread(token_mode_tokenizer, settings)  # from disk: off the loop
        llm = policy_client(
            settings.model_copy(update={"token_mode": tokenizer is not None}), tokenizer=tokenizer
        )
    try:
        sink = sink or await open_sink(settings.remote_buffer_url, api_key=settings.buffer_api_key)
    except BaseException:
        if own_llm:
            await llm.aclose()
        raise
    samples = PlanSamples(plan, settings.task_type, data.get("leases"))  # claims start now
    following = await follow(
        settings.remote_buffer_url, settings.task_type, sink, mirror=settings.follow_policy
    )
    gate = following.gate
    if gate is not None and llm.gate is None:  # obey the buffer's pauses
        llm.gate = gate
    if llm.gate is not None:
        if following.remote is not None:
            llm.gate.reset_stats()  # a mirror of its own: from this run's start
        progress.gate = llm.gate
    run = _Run(
        settings, progress, sink, functools.partial(rollout, llm, **settings.sampling()), reward, group_reward
    )
    run.mode = llm.mode
    run.admission = following.admission
    run.stamp_versions = gate is not None
    run.stale = StaleGroups(gate, data.get("max_staleness"), settings.num_repeat_per_sample, run.admission)
    publish = functools.partial(_publish, progress, llm.stats, llm.stats.copy())
    reporter = asyncio.create_task(
        _report(progress, settings.progress_interval_s, publish), name="rollout-progress"
    )
    try:
        await run.all(samples)
    finally:
        await samples.aclose()
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        try:
            if own_llm:
                await llm.aclose()
            if own_sink:
                await sink.aclose()
        except RejectedTrajectory as exc:  # an HTTP sink's, which counted them: raised below
            progress.rejected += sink.rejected if isinstance(sink, HttpSink) else 1
            run.first_rejection = run.first_rejection or getattr(sink, "first_rejection", None) or str(exc)
        finally:
            publish()
            logger.info("%s; done", progress.line())
            await following.aclose()
    if progress.rejected:  # the run went on without them; the job must not succeed as if whole
        raise RejectedTrajectory(
            f"the buffer refused {progress.rejected} of {progress.completed} trajectories "
            f"(the first: {run.first_rejection})"
        )
    return progress


def policy_client(
    settings: RolloutSettings,
    *,
    tokenizer: Any = None,
    transport: httpx.AsyncBaseTransport | Transport | None = None,
) -> EngineClient:
    """The client ``settings`` describe: in token mode the token client with the served model's
    tokenizer (SGLang's ``/generate``, vLLM's ``/v1/completions`` with ``engine: vllm``, either
    with ``auto``), else the chat client. ``token_mode`` null (the default) is token mode
    whenever a tokenizer is known: ``tokenizer`` (the one ``tokenizer_path`` names, if already
    loaded) or ``tokenizer_path`` (``token_mode_tokenizer``). ``transport`` replaces the HTTP
    transport (tests)."""
    common: dict[str, Any] = {
        "transport": transport,
        "api_key": settings.engine_api_key,
        "max_connections": settings.num_process,
        "timeout_s": settings.request_timeout_s,
        "retry": RetryPolicy(max_retry_s=settings.max_retry_s, max_attempts=settings.max_attempts),
        "routed_experts": settings.return_routed_experts,
        "continuation": ContinuePolicy(
            max_continuations=settings.max_continuations, delay_s=settings.abort_retry_delay_s
        ),
    }
    if settings.token_mode is False:
        tokenizer = None
    elif tokenizer is None:
        tokenizer = token_mode_tokenizer(settings)
    if tokenizer is None:
        return ChatClient(
            settings.remote_engine_url,
            model=settings.model,
            engine=settings.engine,
            capture=settings.capture,
            chat_template_kwargs=settings.chat_template_kwargs,
            **common,
        )
    renderer = TokenRenderer(tokenizer, settings.chat_template_kwargs)
    return TokenClient(
        settings.remote_engine_url, renderer, engine=settings.engine, model=settings.model, **common
    )


def token_mode_tokenizer(settings: RolloutSettings) -> Any:
    """The tokenizer token mode renders with, or ``None`` for chat mode (``tito.tokenizer_for``)."""
    return tokenizer_for(settings.tokenizer_path, settings.token_mode, settings.task_type)


class _Run:
    def __init__(
        self,
        settings: RolloutSettings,
        progress: Progress,
        sink: TrajectorySink,
        rollout: Callable[[Sample], Awaitable[Episode]],
        reward: RewardFn | None,
        group_reward: GroupRewardFn | None,
    ) -> None:
        self.settings = settings
        self.progress = progress
        self.sink = sink
        self.rollout = rollout
        self.offload = Offload()  # for a sync reward: off the event loop
        self.reward = _as_async(reward, self.offload) if reward is not None else None
        self.group_reward = _as_async(group_reward, self.offload) if group_reward is not None else None
        self.sampling = settings.sampling()
        self.logprobs = LogprobsJudge(
            settings.logprobs_mode, engine=settings.engine, task_type=settings.task_type
        )
        self.groups: dict[tuple[int, Any], list[tuple[Sample, Episode | BaseException]]] = {}
        self.fail_fast = FailFast(settings.fail_fast_after)
        self.fatal: MisconfiguredEngine | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        #: Demand-driven generation: a group starts only when admitted (``buffer.policy``).
        self.admission: Admits | None = None
        self.stale = StaleGroups(None, None, 1)  # groups cancelled once they cannot be served
        self.stamp_versions = False
        self.versions: dict[int, list[int]] = {}  # by id(sample): its requests' versions
        self.failure_kinds: set[str] = set()  # each kind of failure is logged once, with its reason
        self.mode: str | None = None  # the client's ("token", "chat"), for trajectories without answers
        self.first_rejection: str | None = None  # why the buffer refused the first it refused
        self.broken: BaseException | None = None  # the first error a sample's task raised
        self.written: dict[tuple[int, Any], int] = {}  # trajectories written, by group not yet whole

    async def all(self, samples: PlanSamples) -> None:
        slots = asyncio.Semaphore(self.settings.num_process)
        tasks = self.tasks
        clock = self.progress.slot_time = SlotTime(self.progress.gate, self.settings.num_process)

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            slots.release()
            clock.freed()
            if self.admission is not None:  # the room its slot leaves, asked for before it is needed
                self.admission.offer(-(-(self.settings.num_process - len(tasks)) // group_size))
            # A sample's task raised (its sink or its scoring broke, not its rollout, which is
            # written as failed): the run fails with the first such error, never silently short.
            if not task.cancelled() and (error := task.exception()) is not None and self.broken is None:
                self.broken = error

        group_size = self.settings.num_repeat_per_sample
        if self.admission is not None:  # every slot is free: asked for before the first sample
            self.admission.offer(-(-self.settings.num_process // group_size))
        last_group: tuple[int, Any] | None = None
        watch = asyncio.create_task(self.stale.watch())
        try:
            async for sample in clock.samples(aiter(samples)):
                group = (sample.epoch, sample.instance_id)
                if self.admission is not None and group != last_group:
                    clock.admitting()
                    free = self.settings.num_process - len(tasks)  # one ask for all their groups
                    clock.admitted(await self.admission.admit(max(1, -(-free // group_size))))
                last_group = group
                await slots.acquire()
                if self.fatal is not None or self.broken is not None:
                    break
                self.progress.started += 1
                task = asyncio.create_task(self.one(sample))
                clock.took()
                tasks.add(task)
                task.add_done_callback(finished)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)  # their errors: ``finished``
            if self.fatal is None and self.broken is not None:
                raise self.broken
            if self.fatal is None:
                await self._score_rest()
        finally:
            for task in [*tasks, watch]:
                task.cancel()
            await asyncio.gather(*tasks, watch, return_exceptions=True)
            self.offload.close()
        if self.fatal is not None:
            raise self.fatal

    async def one(self, sample: Sample) -> None:
        if self.stamp_versions:  # in this task's own context: only its requests are recorded
            self.versions[id(sample)] = recording()
        # This task's requests carry the group's key: its samples stay on one engine.
        routing_key.set(group_key(self.settings.task_type, sample.epoch, sample.instance_id))
        with self.stale.sample((sample.epoch, sample.instance_id)) as kept:
            try:
                outcome: Episode | BaseException = await self.rollout(sample)
            except Exception as exc:  # retries are spent: the trajectory fails, the run goes on
                outcome = exc
        if not kept:  # its group was cancelled as stale: nothing written, counted apart
            self.progress.cancelled_stale += 1
            self.versions.pop(id(sample), None)
            return
        if isinstance(outcome, BaseException):
            fatal = self.fail_fast.failed(outcome)
            if fatal is not None or self.fatal is not None:
                self._stop(fatal)
                return  # the run fails: no failed trajectory is written for a misconfiguration
        else:
            self.fail_fast.succeeded()
            self.progress.record(outcome.completions)
        if self.group_reward is not None:
            await self._collect(sample, outcome)
        else:
            await self._score(sample, outcome)

    def _stop(self, fatal: MisconfiguredEngine | None) -> None:
        if self.fatal is not None or fatal is None:
            return
        self.fatal = fatal
        logger.error("%s: stopping the run: %s", self.settings.task_type, fatal)
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()

    async def _score(self, sample: Sample, outcome: Episode | BaseException) -> None:
        if isinstance(outcome, BaseException):
            await self._write(sample, None, None, outcome)
            return
        try:
            assert self.reward is not None
            value = await self.reward(sample, outcome)
        except Exception as exc:
            await self._write(sample, outcome, None, exc)
            return
        await self._write(sample, outcome, value, None)

    async def _collect(self, sample: Sample, outcome: Episode | BaseException) -> None:
        key = (sample.epoch, sample.instance_id)
        group = self.groups.setdefault(key, [])
        group.append((sample, outcome))
        if len(group) < self.settings.num_repeat_per_sample:
            return
        del self.groups[key]
        await self._score_group(group)

    async def _score_rest(self) -> None:
        """Score the groups this run got only part of: the rest of their samples were made
        elsewhere (by a lost worker before it stopped, or before a resume), so the run's end,
        not a full group, is when they are complete here."""
        while self.groups:
            _, group = self.groups.popitem()
            await self._score_group(group)

    async def _score_group(self, group: list[tuple[Sample, Episode | BaseException]]) -> None:
        done = [(s, o) for s, o in group if isinstance(o, Episode)]
        failure: Exception | None = None
        scores: list[float] = []
        try:
            assert self.group_reward is not None
            scores = list(await self.group_reward([s for s, _ in done], [o for _, o in done]))
            if len(scores) != len(done):
                raise ValueError(f"group_reward returned {len(scores)} rewards for {len(done)} episodes")
        except Exception as exc:
            failure = exc
        remaining = iter(scores)
        for s, o in group:
            if isinstance(o, BaseException):
                await self._write(s, None, None, o)
            elif failure is not None:
                await self._write(s, o, None, failure)
            else:
                await self._write(s, o, next(remaining), None)

    async def _write(
        self, sample: Sample, episode: Episode | None, reward: float | None, error: BaseException | None
    ) -> None:
        trajectory = self._trajectory(sample, episode, reward, error)
        try:
            await self.sink.write(trajectory)
            self._group_written((sample.epoch, sample.instance_id))
        except RejectedTrajectory as exc:  # counted; the run fails at its end (``run_rollouts``)
            self.progress.rejected += 1
            self.first_rejection = self.first_rejection or f"{trajectory['uid']}: {str(exc)[:500]}"
            logger.error("%s: trajectory of %r refused: %s", self.settings.task_type, sample.instance_id, exc)
        self.progress.completed += 1
        if error is not None:
            self.progress.failed += 1
            kind = type(error).__name__
            if kind not in self.failure_kinds:  # a run whose every request fails says why, once
                self.failure_kinds.add(kind)
                logger.warning(
                    "%s: trajectory of %r failed: %s: %s (the first %s; the progress counts the others)",
                    self.settings.task_type,
                    sample.instance_id,
                    kind,
                    error,
                    kind,
                )
        elif trajectory["extra_info"]["finish_reason"] == "abort":
            self.progress.aborted += 1

    def _group_written(self, key: tuple[int, Any]) -> None:
        """A trajectory of group ``key`` was written; its last: the sink sends it now, not at
        the end of its flush interval (only a whole group is served, or dropped and its room
        in admission freed)."""
        written = self.written.pop(key, 0) + 1
        if written < self.settings.num_repeat_per_sample:
            self.written[key] = written
        elif (flush := getattr(self.sink, "flush", None)) is not None:
            flush()

    def _trajectory(
        self, sample: Sample, episode: Episode | None, reward: float | None, error: BaseException | None
    ) -> dict[str, Any]:
        return build_trajectory(
            sample,
            episode,
            reward,
            error,
            task_type=self.settings.task_type,
            sampling=self.sampling,
            client_mode=self.mode,
            logprobs=self.logprobs,
            versions=self.versions.pop(id(sample), None),
        )


def _as_async(fn: Callable[..., Any], offload: Offload) -> Callable[..., Awaitable[Any]]:
    """``fn`` as a coroutine function: an async one as it is, a sync one run in ``offload``'s
    threads, so a slow reward never blocks the event loop. Decided once per run, not once per
    trajectory."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004
        return fn

    async def in_thread(*args: Any) -> Any:
        result = await offload.run(fn, *args)
        return await result if inspect.isawaitable(result) else result

    return in_thread


def _worker_share(data: dict[str, Any]) -> tuple[int, int]:
    """Which worker process of the job this is (the service sets ``data["worker"]``)."""
    worker = data.get("worker") or {}
    return int(worker.get("index", 0)), max(1, int(worker.get("count", 1)))


async def _report(progress: Progress, interval_s: float, publish: Callable[[], None]) -> None:
    """Publish the counts on the job every second; log them every ``interval_s``."""
    last_logged = time.monotonic()
    while True:
        await asyncio.sleep(min(1.0, interval_s))
        publish()
        if time.monotonic() - last_logged >= interval_s:
            last_logged = time.monotonic()
            logger.info("%s", progress.line())


def _publish(progress: Progress, llm: LLMStats, llm_at_start: LLMStats) -> None:
    """Bring the LLM's failures up to date on ``progress``, and put it on the job."""
    progress.count_failures(llm, llm_at_start)
    job = current_job()
    if job is not None:
        job.progress.update(progress.snapshot())
