"""The Grafana dashboard shipped in docs/grafana: every query names a metric /metrics exposes."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.support.calls import write_all
from tests.support.factories import group
from tests.support.paths import REPO

DASHBOARD = REPO / "docs" / "grafana" / "rollout-buffer.json"
SUFFIXES = {"counter": ("_total",), "summary": ("_sum", "_count"), "histogram": ("_bucket", "_sum", "_count")}


def exposed(client: TestClient) -> set[str]:
    """The sample names /metrics can carry, from each family's name and type."""
    names: set[str] = set()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def test_every_panel_queries_metrics_the_service_exposes(client: TestClient) -> None:
    write_all(client, group("q1", [0, 1, 0, 1]))
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(expressions) >= 10
    used = {name for expr in expressions for name in re.findall(r"\brollout_buffer_[a-z_]+", expr)}
    assert used <= exposed(client), used - exposed(client)
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {
        "Reward mean over the interval",
        "LLM request error rate",
        "Truncated answers (finish_reason length)",
    } <= titles
