"""The chart's PrometheusRule: valid, parsed by a real PromQL parser, on metrics a tracker exports.

The rule is rendered by Helm's Go SDK (``charts.render``) and checked the way Prometheus and the
operator would take it: the manifest against the fields of prometheus-operator's CRD, every
``expr`` by ``promql_parser`` (a Rust port of Prometheus' own parser, which also type-checks
function arguments), and every metric an expression reads against the ``/metrics`` of a live
tracker. Each alert's ``runbook_url`` must land on a runbook section of docs/operations.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import helm_python as helm
import httpx
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import promql_parser as promql
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from tracker.runtime import create_tracker, engine_api_context
from tracker.settings import TrackerSettings

from .charts import CHART, KUBE_VERSION, NAMESPACE, RELEASE, ROOT, Rendered, render, validate
from .test_metrics_run import TopicFactory, eventually

FULLNAME = f"{RELEASE}-kmq-tracker"
OPERATIONS_MD = ROOT / "docs" / "operations.md"
PG_URL = "postgresql+asyncpg://kmq:pg-secret@postgres.db:5432/kmq"

#: Every alert of the rule, in the order the rule lists them.
ALERTS = [
    "KmqTrackerDown",
    "KmqMarkersPartitionsUnowned",
    "KmqMarkersPartitionsOverclaimed",
    "KmqFencingLost",
    "KmqIngestBrokerUnreachable",
    "KmqIngestLagGrowing",
    "KmqOldestInFlightTooOld",
    "KmqDeadLetterRateHigh",
    "KmqDeadLettersWaiting",
    "KmqRedeliveryLate",
    "KmqRedeliveryFailing",
    "KmqDelayedMessagesOverdue",
    "KmqMessagesLost",
    "KmqInvalidMarkers",
]
#: The alerts whose condition compares with a `threshold` value.
WITH_THRESHOLD = [
    "KmqIngestLagGrowing",
    "KmqOldestInFlightTooOld",
    "KmqDeadLetterRateHigh",
    "KmqDeadLettersWaiting",
    "KmqRedeliveryLate",
    "KmqRedeliveryFailing",
    "KmqDelayedMessagesOverdue",
    "KmqInvalidMarkers",
]
#: The alerts that look at a range (`window`) of their metric.
WITH_WINDOW = [
    "KmqFencingLost",
    "KmqIngestLagGrowing",
    "KmqDeadLetterRateHigh",
    "KmqRedeliveryLate",
    "KmqRedeliveryFailing",
    "KmqMessagesLost",
    "KmqInvalidMarkers",
]
#: The alerts that compare the owned markers partitions with the partition count.
OWNERSHIP = ["KmqMarkersPartitionsUnowned", "KmqMarkersPartitionsOverclaimed"]
#: Labels Prometheus attaches to every scraped series.
TARGET_LABELS = {"instance", "job"}
#: Functions that take a counter's range; a gauge has no business in them.
COUNTER_FUNCTIONS = {"rate", "irate", "increase"}
LITERALS = (promql.NumberLiteral, promql.StringLiteral)

#: prometheus-operator's PrometheusRule is a CRD, so kubernetes-validate has no schema for it.
#: This one follows the CRD's fields (monitoring.coreos.com/v1) and refuses others.
PROMETHEUS_RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"$ref": "#/definitions/duration"},
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "required": ["alert", "expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": {"type": "string", "minLength": 1},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": {"$ref": "#/definitions/duration"},
                                        "labels": {
                                            "type": "object",
                                            "propertyNames": {
                                                "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"
                                            },
                                            "additionalProperties": {"type": "string"},
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
    "definitions": {
        "duration": {
            "type": "string",
            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
            "(([0-9]+)s)?(([0-9]+)ms)?)$",
        }
    },
}


def enabled(**rule: Any) -> dict[str, Any]:
    """Values with the PrometheusRule on and ``rule`` merged into metrics.prometheusRule."""
    return {"metrics": {"prometheusRule": {"enabled": True, **rule}}}


def validate_rendered(rendered: Rendered) -> None:
    """Every manifest against Kubernetes' schemas; the PrometheusRule against its CRD's fields."""
    for obj in rendered.objects:
        try:
            if obj["kind"] == "PrometheusRule":
                jsonschema.validate(obj, PROMETHEUS_RULE_SCHEMA)
            else:
                validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            where = ".".join(str(p) for p in exc.path)
            raise AssertionError(
                f"{obj['kind']}/{obj['metadata']['name']} is not valid: {where}: {exc.message}"
            ) from None


def rules_of(rendered: Rendered) -> dict[str, dict[str, Any]]:
    """Alert name -> its rule, from the release's one PrometheusRule."""
    [group] = rendered.one("PrometheusRule")["spec"]["groups"]
    rules: dict[str, dict[str, Any]] = {r["alert"]: r for r in group["rules"]}
    assert len(rules) == len(group["rules"]), "an alert name appears twice"
    return rules


# -- walking a parsed expression -----------------------------------------------------------------


def selectors(
    node: promql.Expr, function: str | None = None
) -> Iterator[tuple[promql.VectorSelector, str | None]]:
    """Every vector selector of ``node``, with the function whose argument it is (if any)."""
    if isinstance(node, promql.VectorSelector):
        yield node, function
    elif isinstance(node, promql.MatrixSelector):
        yield node.vector_selector, function
    elif isinstance(node, promql.Call):
        for arg in node.args:
            yield from selectors(arg, node.func.name)
    elif isinstance(node, promql.BinaryExpr):
        yield from selectors(node.lhs)
        yield from selectors(node.rhs)
    elif isinstance(node, (promql.AggregateExpr, promql.ParenExpr, promql.UnaryExpr)):
        yield from selectors(node.expr)
    elif isinstance(node, promql.SubqueryExpr):
        yield from selectors(node.expr, function)
    else:
        assert isinstance(node, LITERALS), repr(node)


def metric_name(selector: promql.VectorSelector) -> str:
    if selector.name:
        return selector.name
    [name] = [m.value for m in selector.matchers.matchers if m.name == "__name__"]
    return name


def equality_matchers(selector: promql.VectorSelector) -> dict[str, str]:
    return {m.name: m.value for m in selector.matchers.matchers if m.op == promql.MatchOp.Equal}


def kept_labels(node: promql.Expr) -> set[str] | None:
    """The labels every series of ``node``'s result carries; None: those of the input series."""
    if isinstance(node, (promql.ParenExpr, promql.UnaryExpr)):
        return kept_labels(node.expr)
    if isinstance(node, promql.AggregateExpr):
        modifier = node.modifier
        if modifier is None:
            return set()
        return set(modifier.labels) if modifier.type == promql.AggModifierType.By else None
    if isinstance(node, promql.Call):
        if node.func.name == "histogram_quantile":
            inner = kept_labels(node.args[1])
            return None if inner is None else inner - {"le"}
        if node.func.name == "absent":
            [selector] = node.args
            assert isinstance(selector, promql.VectorSelector)
            return set(equality_matchers(selector))
        # deriv(), rate(), increase(), ...: the series of their one vector argument.
        vectors = [a for a in node.args if not isinstance(a, LITERALS)]
        return kept_labels(vectors[0]) if len(vectors) == 1 else None
    if isinstance(node, promql.SubqueryExpr):
        return kept_labels(node.expr)
    if isinstance(node, promql.BinaryExpr):
        if isinstance(node.rhs, promql.NumberLiteral):
            return kept_labels(node.lhs)
        if isinstance(node.lhs, promql.NumberLiteral):
            return kept_labels(node.rhs)
        if str(node.op) == "or":  # either side's series: only what both keep is sure
            lhs, rhs = kept_labels(node.lhs), kept_labels(node.rhs)
            if lhs is None or rhs is None:
                return rhs if lhs is None else lhs
            return lhs & rhs
        return kept_labels(node.lhs)  # and, unless, one-to-one comparisons: the left side's
    if isinstance(node, promql.NumberLiteral):
        return set()
    return None


def compared_with(expr: promql.Expr) -> float:
    """The number an alert's condition ``<vector> <op> <number>`` compares with (in
    ``<condition> and <more conditions>``: the first condition's)."""
    assert isinstance(expr, promql.BinaryExpr), expr.prettify()
    if str(expr.op) == "and":
        return compared_with(expr.lhs)
    assert isinstance(expr.rhs, promql.NumberLiteral), expr.prettify()
    return expr.rhs.val


def ranges(expr: promql.Expr) -> set[timedelta]:
    """The ranges ``expr`` looks back over: of its range selectors and subqueries."""
    found: set[timedelta] = set()

    def visit(node: promql.Expr) -> None:
        if isinstance(node, promql.MatrixSelector):
            found.add(node.range)
        elif isinstance(node, promql.SubqueryExpr):
            assert node.range is not None, node.prettify()  # the parser requires one
            found.add(node.range)

    promql.walk(expr, visit)
    return found


# -- rendering -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_rules() -> dict[str, dict[str, Any]]:
    return rules_of(render(enabled()))


@pytest.mark.unit
def test_no_prometheus_rule_unless_enabled() -> None:
    assert not render().of_kind("PrometheusRule")
    assert not render({"metrics": {"serviceMonitor": {"enabled": True}}}).of_kind("PrometheusRule")


@pytest.mark.unit
@pytest.mark.parametrize(
    "values",
    [
        enabled(labels={"release": "prometheus"}),
        {
            "database": {"type": "postgres", "url": PG_URL},
            "replicaCount": 3,
            "metrics": {
                "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                "prometheusRule": {
                    "enabled": True,
                    "labels": {"release": "prometheus"},
                    "annotations": {"owner": "queues-team"},
                    "namespace": "monitoring",
                    "alertLabels": {"team": "queues"},
                    "interval": "30s",
                },
            },
        },
    ],
    ids=["sqlite", "postgres-monitoring-namespace"],
)
def test_rule_renders_valid_with_every_alert(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
    rendered = render(values)
    validate_rendered(rendered)
    rule = rendered.one("PrometheusRule")
    given = values["metrics"]["prometheusRule"]
    meta = rule["metadata"]
    assert meta["name"] == FULLNAME
    assert meta.get("namespace") == given.get("namespace")  # none: the release's namespace
    assert meta["labels"]["release"] == "prometheus"  # what the operator's ruleSelector picks
    assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert meta.get("annotations") == given.get("annotations")
    [group] = rule["spec"]["groups"]
    assert group.get("interval") == given.get("interval")
    rules = rules_of(rendered)
    assert list(rules) == ALERTS
    for name, r in rules.items():
        assert r["labels"]["severity"] in {"critical", "warning"}, name
        assert set(r["labels"]) == {"severity", *given.get("alertLabels", {})}, name
        assert r["labels"].get("team") == given.get("alertLabels", {}).get("team"), name
        assert set(r["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert all(v.strip() for v in r["annotations"].values()), name


@pytest.mark.unit
def test_every_expression_parses_and_reads_only_this_release(
    default_rules: dict[str, dict[str, Any]],
) -> None:
    for name, rule in default_rules.items():
        try:
            expr = promql.parse(rule["expr"])
        except ValueError as exc:
            raise AssertionError(f"{name}: {rule['expr']!r} is not PromQL: {exc}") from None
        found = list(selectors(expr))
        assert found, name
        for selector, _ in found:
            # A release's alerts never count another release's (or namespace's) trackers.
            assert equality_matchers(selector) == {"job": FULLNAME, "namespace": NAMESPACE}, (
                name,
                str(selector),
            )


@pytest.mark.unit
def test_a_custom_selector_is_used_by_every_expression() -> None:
    rules = rules_of(render(enabled(selector='service="kmq", namespace=~"queues|jobs"')))
    for name, rule in rules.items():
        for selector, _ in selectors(promql.parse(rule["expr"])):
            matchers = sorted(str(m) for m in selector.matchers.matchers)
            assert matchers == ['namespace=~"queues|jobs"', 'service="kmq"'], name


@pytest.mark.unit
def test_thresholds_windows_durations_and_severities_come_from_values() -> None:
    alerts: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(ALERTS):
        alerts[name] = {"for": f"{i + 2}m", "severity": f"page-{i}"}
        if name in WITH_THRESHOLD:
            alerts[name]["threshold"] = 1000 + i if i % 2 else 0.25 + i
        if name in WITH_WINDOW:
            alerts[name]["window"] = f"{i + 20}m"
    values = enabled(alerts=alerts)
    values["kafka"] = {"markersPartitions": 24}
    rules = rules_of(render(values))
    for name, rule in rules.items():
        wanted = alerts[name]
        expr = promql.parse(rule["expr"])
        assert rule["for"] == wanted["for"], name
        assert rule["labels"]["severity"] == wanted["severity"], name
        if name in WITH_THRESHOLD:
            assert compared_with(expr) == pytest.approx(wanted["threshold"]), name
        if name in WITH_WINDOW:
            assert ranges(expr) == {promql.parse_duration(wanted["window"])}, name
        if name in OWNERSHIP:
            assert compared_with(expr) == 24, name  # kafka.markersPartitions
    # Defaults, for contrast: the values above are not what an untouched chart renders.
    defaults = rules_of(render(enabled()))
    assert compared_with(promql.parse(defaults["KmqOldestInFlightTooOld"]["expr"])) == 3600
    assert compared_with(promql.parse(defaults["KmqMarkersPartitionsUnowned"]["expr"])) == 12


@pytest.mark.unit
def test_the_partition_count_the_tracker_runs_with_wins() -> None:
    """config.markers_partitions overrides kafka.markersPartitions in the tracker's settings."""
    rules = rules_of(render({**enabled(), "config": {"markers_partitions": 6}}))
    for name in OWNERSHIP:
        assert compared_with(promql.parse(rules[name]["expr"])) == 6, name


@pytest.mark.unit
def test_single_alerts_can_be_disabled() -> None:
    off = ["KmqDeadLettersWaiting", "KmqOldestInFlightTooOld"]
    rules = rules_of(render(enabled(alerts={name: {"enabled": False} for name in off})))
    assert list(rules) == [name for name in ALERTS if name not in off]


@pytest.mark.unit
def test_sidecar_mode_needs_the_selector_of_the_pods_it_runs_in() -> None:
    sidecar = {"mode": "sidecar", "database": {"type": "postgres", "url": PG_URL}}
    with pytest.raises(helm.HelmRenderError, match=r"metrics\.prometheusRule\.selector"):
        render({**sidecar, **enabled()})
    rules = rules_of(render({**sidecar, **enabled(selector='job="billing-worker"')}))
    assert list(rules) == ALERTS
    for rule in rules.values():
        for selector, _ in selectors(promql.parse(rule["expr"])):
            assert equality_matchers(selector) == {"job": "billing-worker"}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"alerts": {"KmqTrackerDown": {"for": "5 minutes"}}}, "/KmqTrackerDown/for"),
        ({"alerts": {"KmqRedeliveryLate": {"threshold": -1}}}, "/KmqRedeliveryLate/threshold"),
        ({"alerts": {"KmqMessagesLost": {"window": "0s"}}}, "/KmqMessagesLost/window"),
        ({"alerts": {"KmqTrackerDown": {"threshold": 3}}}, "'threshold'"),
        ({"alerts": {"KmqTrackerDwn": {"enabled": False}}}, "'KmqTrackerDwn'"),
        ({"alertLabels": {"severity": "page"}}, "propertyName 'severity'"),
        ({"selector": '{job="kmq"}'}, "/selector"),
        ({"runbookBaseUrl": "https://wiki.example.com/kmq#alerts"}, "/runbookBaseUrl"),
        ({"interval": "often"}, "/interval"),
    ],
)
def test_bad_rule_values_are_rejected_by_the_schema(rule: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(enabled(**rule))
    assert message in str(caught.value)


@pytest.mark.unit
def test_annotations_name_only_labels_the_alert_keeps(
    default_rules: dict[str, dict[str, Any]],
) -> None:
    """A `$labels.x` the expression aggregates away would print as nothing in the alert."""
    for name, rule in default_rules.items():
        shown = set(re.findall(r"\$labels\.(\w+)", " ".join(rule["annotations"].values())))
        kept = kept_labels(promql.parse(rule["expr"]))
        allowed = TARGET_LABELS if kept is None else kept
        assert shown <= allowed, (name, shown, kept)


@pytest.mark.unit
def test_and_joins_series_that_carry_the_same_labels(
    default_rules: dict[str, dict[str, Any]],
) -> None:
    """``a and b`` (no on()/ignoring()) keeps the series of ``a`` that ``b`` has with the very
    same labels: sides aggregated by different labels never match, and the alert never fires."""
    for name, rule in default_rules.items():
        joins: list[promql.BinaryExpr] = []

        def visit(node: promql.Expr, joins: list[promql.BinaryExpr] = joins) -> None:
            if isinstance(node, promql.BinaryExpr) and str(node.op) in {"and", "unless"}:
                joins.append(node)

        promql.walk(promql.parse(rule["expr"]), visit)
        for join in joins:
            assert join.modifier is None or join.modifier.matching is None, (name, str(join))
            assert kept_labels(join.lhs) == kept_labels(join.rhs), (name, join.prettify())


@pytest.mark.unit
def test_ingest_lag_alert_needs_a_backlog_that_does_not_shrink(
    default_rules: dict[str, dict[str, Any]],
) -> None:
    """Above the threshold *and* the slope of that same backlog over the window is not negative:
    a large backlog that ingest is working off (a replica catching up after a restart) is quiet."""
    expr = promql.parse(default_rules["KmqIngestLagGrowing"]["expr"])
    shown = expr.prettify()
    assert isinstance(expr, promql.BinaryExpr), shown
    assert str(expr.op) == "and", shown
    high, not_shrinking = expr.lhs, expr.rhs
    assert isinstance(high, promql.BinaryExpr), shown
    assert str(high.op) == ">", shown
    assert compared_with(high) == 10000  # the default threshold, in markers
    assert isinstance(not_shrinking, promql.BinaryExpr), shown
    assert str(not_shrinking.op) == ">=", shown
    assert compared_with(not_shrinking) == 0, shown
    slope = not_shrinking.lhs
    assert isinstance(slope, promql.Call), shown
    assert slope.func.name == "deriv", shown
    [backlog] = slope.args
    assert isinstance(backlog, promql.SubqueryExpr), shown
    assert backlog.range == timedelta(minutes=10)  # the default window
    assert backlog.expr.prettify() == high.lhs.prettify()  # the sum the threshold applies to


# -- runbooks ------------------------------------------------------------------------------------


def runbook_sections(markdown: str) -> dict[str, str]:
    """GitHub's anchor of every heading -> the text under it (up to the next heading)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6} (.+)$", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            current = sections.setdefault(anchor, [])
        elif current is not None:
            current.append(line)
    return {anchor: "\n".join(lines) for anchor, lines in sections.items()}


@pytest.mark.unit
def test_every_alert_links_its_runbook_section_in_operations_md() -> None:
    base = "https://wiki.example.com/kmq-tracker/operations.md"
    rules = rules_of(render(enabled(runbookBaseUrl=base)))
    sections = runbook_sections(OPERATIONS_MD.read_text(encoding="utf-8"))
    for name, rule in rules.items():
        url, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert url == base, name
        assert anchor in sections, f"{name}: no section #{anchor} in docs/operations.md"
        text = sections[anchor]
        for part in ("**Means.**", "**Confirm.**", "**Act.**"):
            assert part in text, f"{name}: its runbook has no {part}"


# -- against a live tracker ----------------------------------------------------------------------


def exposed_series(exposition: str) -> dict[str, str]:
    """Every series name a ``/metrics`` text can carry -> its family's type."""
    names: dict[str, str] = {}
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
    }
    for family in text_string_to_metric_families(exposition):
        for suffix in suffixes.get(family.type, ("",)):
            names[family.name + suffix] = family.type
    return names


def samples(exposition: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The labels of every sample of series ``name`` -> its value."""
    return {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name
    }


def owned_partitions(exposition: str) -> list[float]:
    return list(samples(exposition, "kmq_owned_markers_partitions").values())


async def scrape_live_tracker(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str, partitions: int
) -> str:
    """``/metrics`` of a tracker running on the test broker, once it owns its partitions."""
    markers = await topic_factory(partitions=partitions, prefix="markers")
    settings = TrackerSettings(
        kafka_bootstrap_servers=kafka_bootstrap,
        database_url=sqlite_url,
        markers_topic=markers,
        tracker_group=f"tracker-{markers}",
        markers_partitions=partitions,
        migrate_on_start=True,
        api_token="alert-rules-test-token",  # noqa: S106 - a test value
        http_port=0,
    )
    async with create_tracker(settings) as tracker:
        registry = tracker.metrics.registry
        await eventually(
            lambda: registry.get_sample_value("kmq_owned_markers_partitions") == partitions,
            "the tracker to own every markers partition",
        )
        # kmq_markers_lag{partition} is set after a fetch for a partition the tracker owns.
        await eventually(
            lambda: all(
                registry.get_sample_value("kmq_markers_lag", {"partition": str(p)}) is not None
                for p in range(partitions)
            ),
            "the tracker to report the markers lag of every partition it owns",
        )
        context = engine_api_context(tracker)
        try:
            transport = httpx.ASGITransport(app=create_app(context))
            async with httpx.AsyncClient(transport=transport, base_url="http://kmq.test") as client:
                response = await client.get("/metrics")
        finally:
            await context.close()
    assert response.status_code == 200
    return response.text


@pytest.mark.integration
async def test_every_metric_the_alerts_read_is_exported_by_a_live_tracker(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    exposition = await scrape_live_tracker(kafka_bootstrap, topic_factory, sqlite_url, 2)
    exposed = exposed_series(exposition)
    rules = rules_of(render({**enabled(), "kafka": {"markersPartitions": 2}}))
    for name, rule in rules.items():
        used = {
            (metric_name(selector), function)
            for selector, function in selectors(promql.parse(rule["expr"]))
            if metric_name(selector) != "up"  # Prometheus' own, per target
        }
        assert used or name == "KmqTrackerDown", f"{name} reads no tracker metric"
        for metric, function in used:
            assert metric in exposed, f"{name} reads {metric}, which the tracker does not export"
            # Counters (and histogram buckets) only through rate()/increase(); gauges never.
            counting = exposed[metric] in {"counter", "histogram"}
            assert (function in COUNTER_FUNCTIONS) == counting, (name, metric, function)
    # A healthy tracker owns exactly the partitions the ownership alerts compare with, so
    # neither of them fires.
    for name in OWNERSHIP:
        assert owned_partitions(exposition) == [compared_with(promql.parse(rules[name]["expr"]))]
    # It reads every markers partition it owns, up to their end (the topic is empty); it was
    # never fenced; the redelivery error counters are there at 0 for every stage, so that
    # increase() sees their first error.
    lag = samples(exposition, "kmq_markers_lag")
    assert lag == {frozenset({("partition", str(p))}): 0.0 for p in range(2)}
    assert sum(lag.values()) <= compared_with(promql.parse(rules["KmqIngestLagGrowing"]["expr"]))
    assert samples(exposition, "kmq_fenced_total") == {frozenset(): 0.0}
    assert samples(exposition, "kmq_redelivery_errors_total") == {
        frozenset({("stage", stage)}): 0.0 for stage in ("claim", "read", "produce", "record")
    }
