"""The ledger, the audit and the report on a synthetic workload with known outcomes.

The markers and dead letters are written with the project's encoders and chosen timestamps
(see ``workload.synthetic``), so every row, state, duration and percentile is known exactly.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import StructType
from support.broker import create_topics

from pipeline import ledger_store
from pipeline.audit import audit_ledger
from pipeline.ledger import LedgerJob, run_ledger
from pipeline.ledger_fold import LedgerParams, as_utc
from pipeline.ledger_schemas import CONTENT_HASH, STORED_SCHEMA
from pipeline.ledger_store import load_ledger
from pipeline.report import build_report, render_html, write_report
from pipeline.run_log import ARCHIVE_DIR, read_run_log
from tracker.clock import to_millis

from .workload import (
    BROKEN,
    DEFAULT_TIMEOUT_MS,
    GRACE_MS,
    GROUP,
    OTHER_GROUP,
    STUCK_AFTER_MS,
    Expected,
    Script,
    synthetic,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TopicFactory = Callable[..., Awaitable[str]]


def _params(as_of: datetime) -> LedgerParams:
    return LedgerParams(
        as_of=as_of,
        default_timeout_ms=DEFAULT_TIMEOUT_MS,
        grace_ms=GRACE_MS,
        stuck_after_ms=STUCK_AFTER_MS,
    )


def _rows(spark: SparkSession, root: str) -> dict[tuple[str, int], dict[str, Any]]:
    ledger = load_ledger(spark, root)
    assert ledger is not None
    return {(r["group"], r["offset"]): r.asDict(recursive=True) for r in ledger.collect()}


def _check(row: dict[str, Any], want: Expected) -> None:
    what = f"{want.group}/{want.offset}"
    history = row["history"]
    assert row["final_state"] == want.final_state, what
    assert row["attempts"] == want.attempts, what
    assert tuple(a["outcome"] for a in history) == want.outcomes, what
    assert tuple(a["processing_ms"] for a in history) == want.processing, what
    assert [a["attempt"] for a in history] == list(range(1, want.attempts + 1)), what
    assert row["pending"] == want.pending, what
    assert row["total_delay_ms"] == want.total_delay_ms, what
    assert row["end_to_end_ms"] == want.end_to_end_ms, what
    assert row["last_reason"] == want.last_reason, what
    assert row["dlq_reason"] == want.dlq_reason, what
    assert (row["expected_by"] is None) == (want.pending is None), what


def _types(schema: StructType) -> dict[str, str]:
    """Column types by name: Spark writes every column as nullable, and reads the partition
    columns last."""
    return {f.name: f.dataType.simpleString() for f in schema}


async def _topics(bootstrap: str, topic_factory: TopicFactory) -> tuple[str, str]:
    topic = await topic_factory(partitions=2, prefix="orders")
    markers = await topic_factory(partitions=3, prefix="markers")
    await create_topics(bootstrap, {f"{topic}.dlq": 1})
    return topic, markers


async def test_ledger_rows_audit_and_report_match_the_known_outcomes(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    topic, markers = await _topics(kafka_bootstrap, topic_factory)
    as_of = datetime.now(UTC).replace(microsecond=0)
    script = Script(markers, 3)
    expected = synthetic(script, topic, to_millis(as_of))
    await script.produce(kafka_bootstrap)

    root = str(tmp_path / "ledger")
    run = run_ledger(spark, LedgerJob(kafka_bootstrap, markers, root, _params(as_of)))
    assert run.dlq_topics == [f"{topic}.dlq"], "the DLQ topic is found from the topics seen"
    assert (run.invalid_markers, run.orphan_dlq_records, run.dlq_records_read) == (1, 1, 4)
    assert run.rows_written == len(expected)

    # Readers read the stored rows with the declared schema: it names what a run writes.
    stored = spark.read.parquet(f"{root}/ledger").schema
    assert _types(stored) == _types(STORED_SCHEMA)
    rows = _rows(spark, root)
    assert set(rows) == {(e.group, e.offset) for e in expected}
    for want in expected:
        _check(rows[(want.group, want.offset)], want)
    rejected = rows[(GROUP, 3)]
    assert (rejected["dlq_topic"], rejected["dlq_partition"], rejected["dlq_records"]) == (
        f"{topic}.dlq",
        0,
        1,
    )
    retried = rows[(GROUP, 1)]["history"]
    assert (retried[1]["topic"], retried[1]["partition"], retried[1]["offset"]) == (topic, 1, 102)
    assert rows[(GROUP, 4)]["history"][0]["policy_delay"] is True
    renewed = rows[(GROUP, 9)]
    assert renewed["history"][0]["extends"] == 1
    assert as_utc(renewed["expected_by"]) == as_of + timedelta(seconds=481)
    assert as_utc(rows[(GROUP, 8)]["expected_by"]) == as_of + timedelta(seconds=40), "default"
    deferred = rows[(GROUP, 10)]["history"][0]
    assert deferred["deferred_until"] is not None
    assert rows[(GROUP, 0)]["history"][0]["consumer"] == "w1"

    # The audit finds exactly the broken chains (at the ledger's as-of) ...
    audit = audit_ledger(spark, root, output=str(tmp_path / "audit"))
    assert not audit.ok
    assert {(b["offset"], b["state"]) for b in audit.broken} == set(BROKEN.items())
    assert (audit.invalid_markers, audit.orphan_dlq_records) == (1, 1)
    assert (tmp_path / "audit" / "audit.json").is_file()
    # ... two hours later every open message is overdue by more than the horizon: lost.
    later = audit_ledger(spark, root, as_of=as_of + timedelta(hours=2))
    assert {b["offset"]: b["state"] for b in later.broken} == dict.fromkeys(
        [5, 6, 7, 8, 9, 11, 12, 13], "lost"
    )
    clean = audit_ledger(spark, root, as_of=as_of - timedelta(hours=3))
    assert clean.ok

    # The report: exact counts, rates and percentiles per topic and group.
    report = build_report(spark, root, bucket_seconds=60)
    groups = {(g["topic"], g["group"]): g for g in report["groups"]}
    billing = groups[(topic, GROUP)]
    assert billing["messages"] == 14
    assert billing["states"] == {
        "acked": 4,
        "dead_lettered": 2,
        "in_flight": 5,
        "stuck": 2,
        "lost": 1,
    }
    assert billing["attempts_histogram"] == {"1": 11, "2": 3}
    assert billing["retry_rate"] == round(3 / 14, 6)
    assert billing["dlq_rate"] == round(2 / 14, 6)
    processing = billing["latency_ms"]["processing"]
    assert (processing["p50"], processing["max"], processing["count"]) == (110.0, 300, 4)
    end_to_end = billing["latency_ms"]["end_to_end"]
    assert (end_to_end["p50"], end_to_end["max"], end_to_end["count"]) == (1050.0, 2400, 6)
    assert {r["reason"]: r["count"] for r in billing["dlq_reasons"]} == {
        "rejected by the consumer: bad json": 1,
        "max attempts reached (2 of 2; last: retried)": 1,
    }
    assert billing["slowest"][0]["message"] == f"{topic}/0/1"
    assert sum(p["started"] for p in billing["throughput"]) == 14
    assert sum(p["acked"] for p in billing["throughput"]) == 4
    assert groups[(topic, OTHER_GROUP)]["latency_ms"]["processing"]["p50"] == 30.0
    assert report["totals"]["messages"] == 15
    json_path, html_path = write_report(report, tmp_path / "report")
    html = html_path.read_text()
    assert json_path.is_file()
    assert html.count("<svg") >= 4 * len(report["groups"])
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", ""), "self-contained"
    assert html == render_html(report)


async def test_incremental_runs_append_only_what_changed(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    topic, markers = await _topics(kafka_bootstrap, topic_factory)
    as_of = datetime.now(UTC).replace(microsecond=0)
    as_of_ms = to_millis(as_of)
    script = Script(markers, 3)
    first = synthetic(script, topic, as_of_ms, only=[0, 2, 5, 6])
    await script.produce(kafka_bootstrap)
    root = str(tmp_path / "ledger")

    def job(as_of: datetime) -> LedgerJob:
        return LedgerJob(kafka_bootstrap, markers, root, _params(as_of), checkpoint_every=1)

    one = run_ledger(spark, job(as_of))
    assert one.rows_written == len(first)

    # Nothing new, same as-of: nothing is written.
    same = run_ledger(spark, job(as_of))
    assert (same.markers_read, same.rows_written) == (0, 0)

    # New markers for new messages, one DLQ record; and 55 minutes later the stuck message
    # (6) is lost and the in-flight one (5) is stuck: exactly those rows are appended.
    rest = synthetic(script, topic, as_of_ms, only=[3, 7])
    await script.produce(kafka_bootstrap)
    later = as_of + timedelta(minutes=55)
    two = run_ledger(spark, job(later))
    assert two.markers_read == 3
    assert two.dlq_records_read == 1
    assert two.states_written == {"dead_lettered": 1, "lost": 2, "stuck": 1}
    runs = read_run_log(spark, root)
    assert [r.run_seq for r in runs.entries] == [1, 2, 3]
    assert runs.latest is not None
    assert sum(runs.latest.offsets[markers].values()) == 12, "every marker read, once"
    assert runs.latest.offsets[f"{topic}.dlq"] == {"0": 1}
    # A checkpoint after every run (checkpoint_every=1): runs 2 and 3 wrote checkpoints of
    # the runs before them; a reader takes checkpoint 2 and run 3's record, and run 1's
    # record file went to the archive once checkpoint 2 covered it twice over.
    assert (runs.checkpoint, runs.uncovered) == (2, 1)
    assert len(list((tmp_path / "ledger" / ARCHIVE_DIR).glob("part-*.json"))) == 1

    # The current ledger equals a fresh full run over the same history.
    full_root = str(tmp_path / "full")
    run_ledger(spark, LedgerJob(kafka_bootstrap, markers, full_root, _params(later)))
    drop = ["run_seq", "run_id", "as_of"]
    incremental = load_ledger(spark, root)
    full = load_ledger(spark, full_root)
    assert incremental is not None
    assert full is not None
    assert incremental.count() == len(first) + len(rest)
    assert incremental.drop(*drop).exceptAll(full.drop(*drop)).count() == 0
    assert full.drop(*drop).exceptAll(incremental.drop(*drop)).count() == 0
    states = {r["offset"]: r["final_state"] for r in incremental.collect() if r["group"] == GROUP}
    assert states == {0: "acked", 2: "acked", 3: "dead_lettered", 5: "stuck", 6: "lost", 7: "lost"}


async def test_a_ledger_written_before_content_hashes_were_stored_goes_on_exactly(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    """Rows without a stored content hash (written by an older version) compare as changed:
    a run writes such a row again when it rebuilds it, and the ledger stays exact."""
    topic, markers = await _topics(kafka_bootstrap, topic_factory)
    as_of = datetime.now(UTC).replace(microsecond=0)
    script = Script(markers, 3)
    synthetic(script, topic, to_millis(as_of), only=[0, 2, 5, 6])
    await script.produce(kafka_bootstrap)
    root = tmp_path / "ledger"
    run_ledger(spark, LedgerJob(kafka_bootstrap, markers, str(root), _params(as_of)))
    # What the older version left: the same rows without the column.
    older = tmp_path / "older-rows"
    spark.read.parquet(str(root / "ledger")).drop(CONTENT_HASH).write.partitionBy(
        "topic", "date"
    ).parquet(str(older))
    shutil.rmtree(root / "ledger")
    shutil.move(older, root / "ledger")
    # Nothing new, the same as-of: the open rows (5, 6) are rebuilt as every run does, and
    # written once more because nothing says they did not change; then never again.
    again = [
        run_ledger(spark, LedgerJob(kafka_bootstrap, markers, str(root), _params(as_of)))
        for _ in range(2)
    ]
    assert [r.rows_written for r in again] == [2, 0]

    synthetic(script, topic, to_millis(as_of), only=[3, 7])
    await script.produce(kafka_bootstrap)
    later = as_of + timedelta(minutes=55)
    run = run_ledger(spark, LedgerJob(kafka_bootstrap, markers, str(root), _params(later)))
    # New messages 3 and 7, open 5 and 6 rebuilt (their state moved, as with hashes).
    assert run.states_written == {"dead_lettered": 1, "lost": 2, "stuck": 1}
    full_root = str(tmp_path / "full")
    run_ledger(spark, LedgerJob(kafka_bootstrap, markers, full_root, _params(later)))
    drop = ["run_seq", "run_id", "as_of", CONTENT_HASH]
    incremental = load_ledger(spark, str(root))
    full = load_ledger(spark, full_root)
    assert incremental is not None
    assert full is not None
    assert incremental.drop(*drop).exceptAll(full.drop(*drop)).count() == 0
    assert full.drop(*drop).exceptAll(incremental.drop(*drop)).count() == 0


@pytest.fixture(params=["inline", "joined"])
def committed_ids(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Committed run ids as an IN list, or joined, as with more runs than a list holds."""
    if request.param == "joined":
        monkeypatch.setattr(ledger_store, "COMMITTED_IDS_INLINE", 0)
    return str(request.param)


@pytest.mark.usefixtures("committed_ids")
async def test_a_run_that_died_before_its_commit_leaves_nothing_behind(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    topic, markers = await _topics(kafka_bootstrap, topic_factory)
    as_of = datetime.now(UTC).replace(microsecond=0)
    script = Script(markers, 3)
    expected = synthetic(script, topic, to_millis(as_of), only=[0, 1, 2])
    await script.produce(kafka_bootstrap)
    root = tmp_path / "ledger"
    died = run_ledger(spark, LedgerJob(kafka_bootstrap, markers, str(root), _params(as_of)))
    # What a run that died after writing its history and rows leaves: no commit record.
    shutil.rmtree(root / "_runs")
    assert read_run_log(spark, str(root)).latest is None
    assert load_ledger(spark, str(root)) is None

    rerun = run_ledger(spark, LedgerJob(kafka_bootstrap, markers, str(root), _params(as_of)))
    assert rerun.run_seq == died.run_seq, "the rerun takes the same sequence number"
    assert rerun.run_id != died.run_id
    assert (rerun.markers_read, rerun.rows_written) == (died.markers_read, died.rows_written)
    rows = _rows(spark, str(root))
    assert len(rows) == len(expected)
    for want in expected:
        row = rows[(want.group, want.offset)]
        _check(row, want)
        assert row["run_id"] == rerun.run_id
        assert row["deliveries"] == sum(a["starts"] for a in row["history"])
        assert all(a["starts"] == 1 for a in row["history"]), "the dead run's markers ignored"
