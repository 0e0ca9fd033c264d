"""The Grafana dashboard shipped with the chart queries only metrics the tracker exposes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tracker.metrics import Metrics

from .charts import CHART

pytestmark = pytest.mark.unit

DASHBOARD = CHART / "dashboards" / "kmq-tracker.json"
METRIC = re.compile(r"\b(kmq_[a-z0-9_]+)\b")


def exposed_series() -> dict[str, str]:
    """Every series name the registry can expose -> its family's type."""
    names: dict[str, str] = {}
    for family in Metrics().registry.collect():
        suffixes = {
            "counter": ("_total",),
            "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count"),
        }[family.type]
        for suffix in suffixes:
            names[family.name + suffix] = family.type
    return names


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            exprs.append(variable["definition"])
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_every_queried_metric_exists(dashboard: dict[str, Any]) -> None:
    exposed = exposed_series()
    queried = {name for expr in expressions(dashboard) for name in METRIC.findall(expr)}
    assert queried, "the dashboard queries nothing"
    assert sorted(queried - set(exposed)) == []
    # Histograms are only queried through their buckets, counters only through rate().
    for expr in expressions(dashboard):
        for name in METRIC.findall(expr):
            if exposed[name] == "counter":
                assert re.search(rf"(rate|increase)\({name}\b", expr), expr


def test_it_shows_what_the_issue_asks_for(dashboard: dict[str, Any]) -> None:
    text = "\n".join(expressions(dashboard))
    for needle in [
        "rate(kmq_markers_ingested_total",  # throughput
        "rate(kmq_redeliveries_total",
        'kmq_tracked_messages{state="in_flight"',  # per topic
        'kmq_tracked_messages{state="delayed"',
        "kmq_dead_letters{",  # DLQ size
        "kmq_oldest_in_flight_age_seconds",  # oldest age
        "kmq_redelivery_lateness_seconds_bucket",  # redelivery latency
    ]:
        assert needle in text, needle
    # Store-wide gauges are reported by every replica: aggregate with max, never sum.
    for expr in expressions(dashboard):
        if "kmq_tracked_messages{" in expr or "kmq_dead_letters{" in expr:
            assert "max by (topic)" in expr, expr


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "kmq-tracker"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "topic"}
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["description"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
