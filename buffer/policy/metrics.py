"""The policy's Prometheus metrics: version, pauses, lag of served groups, stale groups, shares,
admission (its capacity, what is outstanding, groups cancelled as stale in flight).

Read from ``Policy.snapshot`` at scrape time, like the rest of ``buffer.service.metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from buffer.policy.state import LAG_BUCKETS


def policy_metrics(prefix: str, snapshot: dict[str, Any]) -> Iterator[Metric]:
    version = GaugeMetricFamily(prefix + "policy_version", "The policy version the trainer last reported")
    version.add_metric([], -1 if snapshot["version"] is None else snapshot["version"])
    paused = GaugeMetricFamily(prefix + "policy_paused", "1 while generation is paused for a weight update")
    paused.add_metric([], 1 if snapshot["paused"] else 0)
    gate = snapshot["gate"]
    paused_s = CounterMetricFamily(prefix + "policy_paused_seconds", "Time generation was paused")
    paused_s.add_metric([], gate["paused_s"])
    pauses = CounterMetricFamily(prefix + "policy_pauses", "Pauses around weight updates")
    pauses.add_metric([], gate["pauses"])
    yield from (version, paused, paused_s, pauses)

    lag = HistogramMetricFamily(
        prefix + "served_version_lag",
        "Served groups by version lag: the trainer's version minus the group's lowest",
    )
    counts = {int(key): count for key, count in snapshot["lag"].items()}
    buckets = []
    for bound in LAG_BUCKETS:
        buckets.append((str(bound), sum(count for value, count in counts.items() if value <= bound)))
    buckets.append(("+Inf", sum(counts.values())))
    lag.add_metric([], buckets, sum(value * count for value, count in counts.items()))
    yield lag

    stale = CounterMetricFamily(
        prefix + "groups_stale", "Groups set aside at read: past max_staleness", labels=["task"]
    )
    for task, count in sorted(snapshot["stale_groups"].items()):
        stale.add_metric([task], count)
    served = CounterMetricFamily(prefix + "policy_groups_served", "Groups served, by task", labels=["task"])
    for task, count in sorted(snapshot["served_groups"].items()):
        served.add_metric([task], count)
    share = GaugeMetricFamily(
        prefix + "task_share", "Each task's share of the groups served", labels=["task"]
    )
    for task, value in sorted(snapshot["shares"].items()):
        share.add_metric([task], value)
    yield from (stale, served, share)

    cancelled = CounterMetricFamily(
        prefix + "groups_cancelled_stale",
        "Groups cancelled in flight, nothing of them written: past max_staleness before they were made",
        labels=["task"],
    )
    capacity = GaugeMetricFamily(
        prefix + "admission_capacity",
        "Groups pending and served at this version at most: (max_staleness + 1) x the trainer's batch",
        labels=["task"],
    )
    outstanding = GaugeMetricFamily(
        prefix + "admission_outstanding", "Groups admitted and not yet served or dropped", labels=["task"]
    )
    for task, admission in sorted(snapshot.get("admission", {}).items()):
        cancelled.add_metric([task], admission.get("cancelled_stale", 0))
        if admission.get("capacity") is not None:
            capacity.add_metric([task], admission["capacity"])
        outstanding.add_metric([task], admission["outstanding"])
    yield from (cancelled, capacity, outstanding)
