"""The analytics report: what happened to the messages, per topic and consumer group.

Computed from the current ledger with Spark (the aggregation is the expensive part; the result
is small), then written as ``report.json`` for machines and ``report.html`` for people: one
self-contained page with inline SVG charts (:mod:`pipeline.charts`) that works offline.

Per topic and group: messages by final state; retry rate (messages that needed more than one
attempt) and DLQ rate; processing-latency percentiles (the acknowledged attempt's START to
ACK, every attempt's START to outcome, and first START to settlement end to end); the
attempts histogram; throughput over time (started, acknowledged, dead-lettered per bucket);
the top DLQ reasons; the slowest messages. Percentiles are exact (``percentile``), so the
numbers are reproducible and testable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from html import escape
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from pipeline.charts import PALETTE, bar_chart, hbar_chart, line_chart
from pipeline.ledger_fold import FINAL_STATES, LedgerError, as_utc
from pipeline.ledger_store import load_ledger
from pipeline.run_log import read_run_log

PERCENTILES = (0.5, 0.9, 0.95, 0.99)
_NICE_BUCKETS = (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 6 * 3600, 86400, 7 * 86400)
GROUP = ["topic", "group"]


def choose_bucket(span_seconds: float, points: int = 60) -> int:
    """A round bucket size (seconds) that cuts ``span_seconds`` into about ``points``."""
    wanted = span_seconds / points
    for size in _NICE_BUCKETS:
        if size >= wanted:
            return size
    return _NICE_BUCKETS[-1]


def _latency(column: Column, prefix: str) -> list[Column]:
    return [
        F.percentile(column, list(PERCENTILES)).alias(f"{prefix}_pct"),
        F.max(column).alias(f"{prefix}_max"),
        F.avg(column).alias(f"{prefix}_mean"),
        F.count(column).alias(f"{prefix}_n"),
    ]


def _latency_json(row: dict[str, Any], prefix: str) -> dict[str, float | None]:
    pct = row.get(f"{prefix}_pct") or [None] * len(PERCENTILES)
    out: dict[str, float | None] = {
        f"p{round(p * 100)}": (round(v, 3) if v is not None else None)
        for p, v in zip(PERCENTILES, pct, strict=True)
    }
    out["max"] = row.get(f"{prefix}_max")
    mean = row.get(f"{prefix}_mean")
    out["mean"] = round(mean, 3) if mean is not None else None
    out["count"] = row.get(f"{prefix}_n")
    return out


def _top(df: DataFrame, order: Column, n: int) -> DataFrame:
    rank = Window.partitionBy(*GROUP).orderBy(order)
    return df.withColumn("_rank", F.row_number().over(rank)).where(F.col("_rank") <= n)


def _iso(value: Any) -> Any:
    return as_utc(value).isoformat() if isinstance(value, datetime) else value


_MAX_POINTS = 5000


def _timeline(times: Sequence[datetime], bucket: int) -> list[datetime]:
    """Every bucket from the first to the last event, so that quiet periods show as zeros
    (a chart joining only the non-empty buckets would draw activity that did not happen)."""
    if not times:
        return []
    first, last = min(times), max(times)
    count = int((last - first).total_seconds() // bucket) + 1
    if count > _MAX_POINTS:
        return sorted(set(times))
    return [first + timedelta(seconds=bucket * i) for i in range(count)]


def build_report(
    spark: SparkSession, root: str, *, bucket_seconds: int | None = None, top: int = 10
) -> dict[str, Any]:
    """The report's data (JSON-ready) for the ledger at ``root``."""
    runs = read_run_log(spark, root)
    ledger = load_ledger(spark, root, runs)
    if ledger is None or runs.latest is None:
        raise LedgerError(f"no committed ledger at {root}")
    ledger = ledger.cache()
    try:
        return _build(ledger, root, runs.latest.params.as_of, bucket_seconds, top)
    finally:
        ledger.unpersist()


def _build(
    ledger: DataFrame, root: str, as_of: datetime, bucket_seconds: int | None, top: int
) -> dict[str, Any]:
    c = F.col
    acked = c("final_state") == "acked"
    summary = {
        tuple(r[g] for g in GROUP): r.asDict()
        for r in ledger.groupBy(*GROUP)
        .agg(
            F.count("*").alias("messages"),
            *[F.count(F.when(c("final_state") == s, 1)).alias(s) for s in FINAL_STATES],
            F.count(F.when(c("attempts") > 1, 1)).alias("retried"),
            F.min("first_seen").alias("first_seen"),
            F.max("last_event").alias("last_event"),
            *_latency(F.when(acked, c("final_processing_ms")), "processing"),
            *_latency(F.when(c("settled_at").isNotNull(), c("end_to_end_ms")), "end_to_end"),
        )
        .collect()
    }
    attempt_latency = {
        tuple(r[g] for g in GROUP): r.asDict()
        for r in ledger.select(*GROUP, F.explode("history").alias("a"))
        .groupBy(*GROUP)
        .agg(*_latency(c("a.processing_ms"), "attempt"))
        .collect()
    }
    histogram: dict[tuple[str, str], dict[str, int]] = {}
    for r in ledger.groupBy(*GROUP, "attempts").count().collect():
        histogram.setdefault((r["topic"], r["group"]), {})[str(r["attempts"])] = r["count"]

    starts = [s["first_seen"] for s in summary.values() if s["first_seen"] is not None]
    ends = [s["last_event"] for s in summary.values() if s["last_event"] is not None]
    span = (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
    bucket = bucket_seconds or choose_bucket(span)
    bucket_ms = bucket * 1000

    def bucketed(ts: Column) -> Column:
        return F.timestamp_millis(F.floor(F.unix_millis(ts) / bucket_ms) * bucket_ms)

    events = (
        ledger.where(c("first_start").isNotNull())
        .select(*GROUP, bucketed(c("first_start")).alias("t"), F.lit("started").alias("what"))
        .unionByName(
            ledger.where(c("settled_at").isNotNull()).select(
                *GROUP, bucketed(c("settled_at")).alias("t"), c("final_state").alias("what")
            )
        )
        .groupBy(*GROUP, "t", "what")
        .count()
        .collect()
    )
    throughput: dict[tuple[str, str], dict[datetime, dict[str, int]]] = {}
    for r in events:
        slot = throughput.setdefault((r["topic"], r["group"]), {}).setdefault(r["t"], {})
        slot[r["what"]] = r["count"]
    timeline = _timeline([t for series in throughput.values() for t in series], bucket)

    reasons: dict[tuple[str, str], list[dict[str, Any]]] = {}
    dead = (
        ledger.where(c("final_state") == "dead_lettered")
        .withColumn("reason", F.coalesce(c("dlq_reason"), c("last_reason"), F.lit("(none)")))
        .groupBy(*GROUP, "reason")
        .count()
    )
    for r in _top(dead, c("count").desc(), top).orderBy(*GROUP, "_rank").collect():
        reasons.setdefault((r["topic"], r["group"]), []).append(
            {"reason": r["reason"], "count": r["count"]}
        )

    slowest: dict[tuple[str, str], list[dict[str, Any]]] = {}
    settled = ledger.where(c("end_to_end_ms").isNotNull())
    for r in (
        _top(settled, c("end_to_end_ms").desc(), top)
        .orderBy(*GROUP, "_rank")
        .select(
            *GROUP,
            "partition",
            "offset",
            "final_state",
            "attempts",
            "end_to_end_ms",
            "total_processing_ms",
            "first_start",
        )
        .collect()
    ):
        slowest.setdefault((r["topic"], r["group"]), []).append(
            {
                "message": f"{r['topic']}/{r['partition']}/{r['offset']}",
                "state": r["final_state"],
                "attempts": r["attempts"],
                "end_to_end_ms": r["end_to_end_ms"],
                "processing_ms": r["total_processing_ms"],
                "first_start": _iso(r["first_start"]),
            }
        )

    groups = []
    totals = dict.fromkeys(("messages", *FINAL_STATES, "retried"), 0)
    for key in sorted(summary):
        s = summary[key]
        for name in totals:
            totals[name] += s[name]
        messages = s["messages"]
        series = throughput.get(key, {})
        groups.append(
            {
                "topic": key[0],
                "group": key[1],
                "messages": messages,
                "states": {state: s[state] for state in FINAL_STATES},
                "retry_rate": round(s["retried"] / messages, 6) if messages else 0.0,
                "dlq_rate": round(s["dead_lettered"] / messages, 6) if messages else 0.0,
                "latency_ms": {
                    "processing": _latency_json(s, "processing"),
                    "attempt_processing": _latency_json(attempt_latency.get(key, {}), "attempt"),
                    "end_to_end": _latency_json(s, "end_to_end"),
                },
                "attempts_histogram": dict(
                    sorted(histogram.get(key, {}).items(), key=lambda kv: int(kv[0]))
                ),
                "throughput": [
                    {
                        "t": as_utc(t).isoformat(),
                        "started": v.get("started", 0),
                        "acked": v.get("acked", 0),
                        "dead_lettered": v.get("dead_lettered", 0),
                    }
                    for t, v in ((t, series.get(t, {})) for t in timeline or sorted(series))
                ],
                "dlq_reasons": reasons.get(key, []),
                "slowest": slowest.get(key, []),
            }
        )
    messages = totals["messages"]
    return {
        "generated_at": datetime.now(UTC).isoformat(),
        "ledger": root,
        "as_of": as_of.isoformat(),
        "bucket_seconds": bucket,
        "totals": {
            "messages": messages,
            "states": {state: totals[state] for state in FINAL_STATES},
            "retry_rate": round(totals["retried"] / messages, 6) if messages else 0.0,
            "dlq_rate": round(totals["dead_lettered"] / messages, 6) if messages else 0.0,
        },
        "groups": groups,
    }


# --------------------------------------------------------------------------------------------
# Rendering

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#111827;background:#f9fafb}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:32px 0 8px}
h3{font-size:14px;margin:16px 0 6px;color:#374151}
.meta{color:#6b7280;font-size:13px}.tiles{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.tile{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:10px 14px;min-width:110px}
.tile b{display:block;font-size:20px}.tile span{color:#6b7280;font-size:12px}
.bad b{color:#dc2626}.grid{display:flex;flex-wrap:wrap;gap:16px}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px}
table{border-collapse:collapse;font-size:12px;background:#fff}
td,th{border:1px solid #e5e7eb;padding:4px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}
"""


def _tile(label: str, value: str, *, bad: bool = False) -> str:
    cls = "tile bad" if bad else "tile"
    return f'<div class="{cls}"><b>{escape(value)}</b><span>{escape(label)}</span></div>'


def _pct(rate: float) -> str:
    return f"{rate * 100:.1f}%"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _group_html(g: dict[str, Any], bucket: int) -> str:
    states = g["states"]
    tiles = [
        _tile("messages", f"{g['messages']:,}"),
        _tile("acked", f"{states['acked']:,}"),
        _tile("dead-lettered", f"{states['dead_lettered']:,}"),
        _tile("in flight", f"{states['in_flight']:,}"),
        _tile("stuck", f"{states['stuck']:,}", bad=states["stuck"] > 0),
        _tile("lost", f"{states['lost']:,}", bad=states["lost"] > 0),
        _tile("retry rate", _pct(g["retry_rate"])),
        _tile("DLQ rate", _pct(g["dlq_rate"])),
        _tile("p95 processing", _ms(g["latency_ms"]["processing"]["p95"])),
    ]
    points = g["throughput"]
    throughput = line_chart(
        f"Throughput per {bucket} s",
        [p["t"][11:19] if bucket < 86400 else p["t"][:10] for p in points],
        {
            "started": [p["started"] for p in points],
            "acked": [p["acked"] for p in points],
            "dead-lettered": [p["dead_lettered"] for p in points],
        },
    )
    latency = g["latency_ms"]
    names = ["p50", "p90", "p95", "p99", "max"]
    latency_charts = "".join(
        '<div class="card"><h3>'
        + escape(title)
        + "</h3>"
        + bar_chart(
            title,
            names,
            [float(latency[kind].get(n) or 0) for n in names],
            color=PALETTE[i],
            unit=" ms",
        )
        + "</div>"
        for i, (kind, title) in enumerate(
            (
                ("processing", "Processing latency, acked attempt (ms)"),
                ("end_to_end", "End to end, first start to settled (ms)"),
            )
        )
    )
    hist = g["attempts_histogram"]
    attempts = bar_chart("Attempts per message", list(hist), [float(v) for v in hist.values()])
    reasons = g["dlq_reasons"]
    reasons_chart = (
        hbar_chart(
            "Top DLQ reasons",
            [r["reason"] for r in reasons],
            [float(r["count"]) for r in reasons],
        )
        if reasons
        else "<p class='meta'>No dead letters.</p>"
    )
    slowest = _table(
        ["message", "state", "attempts", "end to end", "processing", "first start"],
        [
            [
                s["message"],
                s["state"],
                s["attempts"],
                _ms(s["end_to_end_ms"]),
                _ms(s["processing_ms"]),
                s["first_start"] or "",
            ]
            for s in g["slowest"]
        ],
    )
    return (
        f"<h2>{escape(g['topic'])} · group {escape(g['group'])}</h2>"
        f'<div class="tiles">{"".join(tiles)}</div>'
        f'<div class="card"><h3>Throughput</h3>{throughput}</div>'
        f'<div class="grid">{latency_charts}'
        f'<div class="card"><h3>Attempts histogram</h3>{attempts}</div></div>'
        f'<div class="card"><h3>Top DLQ reasons</h3>{reasons_chart}</div>'
        f"<h3>Slowest messages</h3>{slowest}"
    )


def render_html(report: dict[str, Any]) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG only)."""
    totals = report["totals"]
    states = totals["states"]
    tiles = "".join(
        [
            _tile("messages", f"{totals['messages']:,}"),
            *[
                _tile(
                    s.replace("_", " "),
                    f"{states[s]:,}",
                    bad=s in {"stuck", "lost"} and states[s] > 0,
                )
                for s in FINAL_STATES
            ],
            _tile("retry rate", _pct(totals["retry_rate"])),
            _tile("DLQ rate", _pct(totals["dlq_rate"])),
        ]
    )
    sections = "".join(_group_html(g, report["bucket_seconds"]) for g in report["groups"])
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<title>kmq delivery report</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>kmq delivery report</h1>"
        f"<p class='meta'>Ledger {escape(report['ledger'])} as of {escape(report['as_of'])}"
        f" · generated {escape(report['generated_at'])}</p>"
        f'<div class="tiles">{tiles}</div>{sections or "<p>No messages.</p>"}'
        "</body></html>\n"
    )


def write_report(report: dict[str, Any], output: str | Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.html`` into ``output``; returns both paths."""
    target = Path(output)
    target.mkdir(parents=True, exist_ok=True)
    json_path = target / "report.json"
    html_path = target / "report.html"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    html_path.write_text(render_html(report))
    return json_path, html_path
