"""The service's Prometheus metrics, read at scrape time.

``BufferCollector.collect`` reads the buffer's counters (``RolloutBuffer.stats()``) and every
job's published progress when ``/metrics`` is scraped. One count is kept on the write path,
by a write observer the app registers at start (``watch_logprobs``): trajectories written with
token logprobs, by what those are (``buffer.logprob_kinds``: only ``sampling`` ones reach a
trainer as rollout logprobs).

The LLM figures (requests, retries, failed trajectories, latency histogram, throughput, answers
by finish_reason, answer lengths) are those of ``buffer.toolkit.run_rollouts`` as it publishes
them on ``job.progress``, read as ``GET /jobs/{id}`` shows them (``Job.reported_progress``: a
job's worker processes push their reports down a pipe, ``buffer.workers.progress``, their last
one at their exit); they are summed over the jobs of a task the job manager still keeps, so a
forgotten job's share leaves its counters (Prometheus reads that as a counter reset).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from buffer.core.rollout_buffer import RolloutBuffer
from buffer.logprob_kinds import KINDS, trajectory_kind
from buffer.policy.metrics import policy_metrics
from buffer.service.jobs import JobManager, JobStatus

PREFIX = "rollout_buffer_"
GROUP_STATES = ("pending", "ready")
JOB_STATES = tuple(status.value for status in JobStatus)
#: The counters ``run_rollouts`` publishes on a job, and the metric each one sums into.
JOB_COUNTERS = {
    "completed": ("generator_trajectories_completed", "Trajectories a generator finished (failed included)"),
    "failed": ("llm_errors", "Trajectories that failed after their LLM retries, or in their reward"),
    "requests": ("llm_requests", "HTTP requests to the policy server, retries and continuations included"),
    "retries": ("llm_retries", "LLM requests that retried a failed one (continuations excluded)"),
    "request_failures": (
        "llm_request_failures",
        "HTTP requests to the policy server that failed, retried or not",
    ),
}


class WrittenLogprobs:
    """Trajectories written with token logprobs, by task and what the logprobs are: ``raw`` if
    any turn's are known not to be the sampling distribution's, else ``constrained`` if any turn
    was sampled under a grammar, else ``unknown`` if any turn's cannot be known (or do not say),
    else ``sampling`` (``logprob_kinds.trajectory_kind``). A write observer of the buffer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def observe(self, task_type: str, item: Mapping[str, Any]) -> None:
        turns = item.get("turns")
        if not turns:
            return
        kind = trajectory_kind(turns)
        if kind is not None:
            with self._lock:
                self._counts[task_type, kind] += 1

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


def watch_logprobs(buffer: RolloutBuffer) -> WrittenLogprobs:
    """The buffer's count of written logprobs, registered as its write observer on first call."""
    for observe in buffer.write_observers:
        owner = getattr(observe, "__self__", None)
        if isinstance(owner, WrittenLogprobs):
            return owner
    written = WrittenLogprobs()
    buffer.write_observers.append(written.observe)
    return written


class BufferCollector(Collector):
    """Every metric of one service, built afresh from its buffer and jobs on each scrape."""

    def __init__(self, buffer: RolloutBuffer, jobs: JobManager) -> None:
        self._buffer = buffer
        self._jobs = jobs
        self._logprobs = watch_logprobs(buffer)

    def collect(self) -> Iterator[Metric]:
        yield from self._buffer_metrics(self._buffer.stats())
        yield from _replay_metrics(self._buffer.replay_pool())
        yield self._logprobs_metric()
        yield from self._job_metrics()
        yield from policy_metrics(PREFIX, self._buffer.policy.snapshot())

    def _logprobs_metric(self) -> Metric:
        family = _counter(
            "trajectories_logprobs",
            "Trajectories written with token logprobs, by what they are: sampling (the sampling "
            "distribution's, handed to a trainer), raw (known not to be: the engine took them before "
            "the temperature or filters the request set), unknown (cannot be known, or not said)",
            ["task", "kind"],
        )
        counts = self._logprobs.counts()
        for task in sorted({task for task, _ in counts}):
            for kind in KINDS:
                family.add_metric([task, kind], counts.get((task, kind), 0))
        return family

    def _buffer_metrics(self, stats: dict[str, Any]) -> Iterator[Metric]:
        tasks: dict[str, dict[str, Any]] = stats["tasks"]
        written = _counter("trajectories_written", "Trajectories buffered (duplicates excluded)")
        delivered = _counter("trajectories_delivered", "Trajectories handed to the trainer")
        items = _gauge("items", "Trajectories buffered now, by state", ["task", "state"])
        groups = _gauge("groups", "Groups buffered now, by state", ["task", "state"])
        groups_delivered = _counter("groups_delivered", "Groups handed to the trainer")
        discarded = _counter("groups_discarded", "Groups dropped, by reason", ["task", "reason"])
        set_aside = _counter("groups_set_aside", "Groups set aside because a hook failed on them")
        rewards = _counter("rewards", "Rewards written")
        # _sum and _count: rate(sum)/rate(count) is the mean reward over any window.
        reward = SummaryMetricFamily(
            PREFIX + "reward", "Rewards written: their sum and count", labels=["task"]
        )
        served_age = SummaryMetricFamily(
            PREFIX + "served_group_age_seconds",
            "How long each group a read returned had waited since it finished (the trainer's lag)",
            labels=["task"],
        )
        reward_mean = _gauge("reward_mean", "Mean of every reward written")
        reward_std = _gauge("reward_std", "Sample standard deviation of every reward written")
        for task, counters in tasks.items():
            written.add_metric([task], counters["total_written"])
            delivered.add_metric([task], counters["delivered_items"])
            groups_delivered.add_metric([task], counters["delivered_groups"])
            set_aside.add_metric([task], counters["set_aside_groups"])
            for state in GROUP_STATES:
                items.add_metric([task, state], counters[f"{state}_items"])
                groups.add_metric([task, state], counters[f"{state}_groups"])
            for reason, count in sorted(counters["discarded_groups"].items()):
                discarded.add_metric([task, reason], count)
            rewards.add_metric([task], counters["reward_count"])
            reward.add_metric([task], counters["reward_count"], counters["reward_sum"])
            served_age.add_metric([task], counters["served_age_count"], counters["served_age_s_sum"])
            reward_mean.add_metric([task], counters["reward_mean"])
            reward_std.add_metric([task], counters["reward_std"])
        duplicates = CounterMetricFamily(PREFIX + "duplicates", "Writes of a uid already seen, ignored")
        duplicates.add_metric([], stats["duplicates"])
        refused = CounterMetricFamily(
            PREFIX + "writes_refused_full", "Writes refused with 429 (--max-buffered-trajectories)"
        )
        refused.add_metric([], stats["refused_full"])
        yield from (written, delivered, items, groups, groups_delivered, discarded, set_aside)
        yield from (rewards, reward, served_age, reward_mean, reward_std, duplicates, refused)
        journal = stats["journal"]
        if journal is not None:
            for name, documentation in (
                ("bytes_written", "Bytes the journal wrote to the data folder"),
                ("commits", "Journal commits (one write, and fdatasync with --durability sync)"),
                ("compactions", "Journal compactions into a snapshot"),
            ):
                family = CounterMetricFamily(PREFIX + "journal_" + name, documentation)
                family.add_metric([], journal[name])
                yield family

    def _job_metrics(self) -> Iterator[Metric]:
        by_state: Counter[str] = Counter()
        by_task: Counter[tuple[str, str]] = Counter()
        totals: dict[str, Counter[str]] = {key: Counter() for key in JOB_COUNTERS}
        throughput: Counter[str] = Counter()
        latency: dict[str, Counter[str]] = {}
        latency_sum: Counter[str] = Counter()
        finish_reasons: Counter[tuple[str, str]] = Counter()
        response_tokens: dict[str, list[int]] = {}
        for job in self._jobs.list():
            task, state = job.task_type, job.status.value
            by_state[state] += 1
            by_task[task, state] += 1
            progress = job.reported_progress()  # what /jobs shows: the workers' reports, or inline its own
            if not progress:
                continue
            for key, counts in totals.items():
                counts[task] += progress.get(key, 0)
            if job.status is JobStatus.RUNNING:
                throughput[task] += progress.get("trajectories_per_s", 0.0)
            for reason, count in progress.get("finish_reasons", {}).items():
                finish_reasons[task, reason] += count
            if "response_tokens_count" in progress:
                tokens = response_tokens.setdefault(task, [0, 0])
                tokens[0] += progress["response_tokens_count"]
                tokens[1] += progress["response_tokens_sum"]
            buckets = progress.get("latency_s_buckets")
            if buckets:
                latency.setdefault(task, Counter()).update(buckets)
                latency_sum[task] += progress.get("latency_s_sum", 0.0)

        jobs = _gauge("jobs", "Generator jobs the service keeps, by state", ["state"])
        for state in JOB_STATES:
            jobs.add_metric([state], by_state[state])
        task_jobs = _gauge(
            "task_jobs", "Generator jobs the service keeps, by task and state", ["task", "state"]
        )
        for task in sorted({task for task, _ in by_task}):
            for state in JOB_STATES:
                task_jobs.add_metric([task, state], by_task[task, state])
        yield from (jobs, task_jobs)

        for key, (name, documentation) in JOB_COUNTERS.items():
            family = _counter(name, documentation)
            for task, count in sorted(totals[key].items()):
                family.add_metric([task], count)
            yield family
        rate = _gauge("generator_trajectories_per_second", "Trajectories per second of the running jobs")
        for task, value in sorted(throughput.items()):
            rate.add_metric([task], value)
        yield rate
        histogram = HistogramMetricFamily(
            PREFIX + "llm_request_latency_seconds",
            "Latency of each LLM answer, retries and continuations included",
            labels=["task"],
        )
        for task, counts in sorted(latency.items()):
            ordered = sorted(counts.items(), key=lambda bucket: float(bucket[0]))
            histogram.add_metric([task], ordered, latency_sum[task])
        yield histogram
        answers = _counter(
            "llm_finish_reasons", "LLM answers by finish_reason (length: truncated)", ["task", "reason"]
        )
        for (task, reason), count in sorted(finish_reasons.items()):
            answers.add_metric([task, reason], count)
        yield answers
        lengths = SummaryMetricFamily(
            PREFIX + "llm_response_tokens",
            "Tokens of each LLM answer (where the engine reports them)",
            labels=["task"],
        )
        for task, (count, total) in sorted(response_tokens.items()):
            lengths.add_metric([task], count, total)
        yield lengths


def _replay_metrics(pool: dict[str, Any]) -> Iterator[Metric]:
    """The replay pool's (``buffer.core.replay_pool``): none while it is off and empty."""
    if not pool["capacity"] and not pool["groups"]:
        return
    size = _gauge("replay_pool_groups", "Groups the replay pool keeps now")
    for task, count in sorted(pool["groups"].items()):
        size.add_metric([task], count)
    replayed = _counter("groups_replayed", "Groups reads served again from the replay pool")
    for task, count in sorted(pool["replayed"].items()):
        replayed.add_metric([task], count)
    dropped = _counter(
        "replay_pool_dropped",
        "Groups that left the replay pool, by reason: lag (past --replay-max-lag), uses "
        "(--replay-max-uses), capacity (a better group took its place)",
        ["task", "reason"],
    )
    for task, reasons in sorted(pool["dropped"].items()):
        for reason, count in sorted(reasons.items()):
            dropped.add_metric([task, reason], count)
    yield from (size, replayed, dropped)


def build_registry(buffer: RolloutBuffer, jobs: JobManager) -> CollectorRegistry:
    """A registry of its own for one service (never the process-wide default one)."""
    registry = CollectorRegistry()
    registry.register(BufferCollector(buffer, jobs))
    return registry


def _counter(name: str, documentation: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, labels=labels or ["task"])


def _gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, labels=labels or ["task"])
