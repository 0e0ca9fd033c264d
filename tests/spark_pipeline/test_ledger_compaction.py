"""Compaction (pipeline.ledger_compaction): the ledger's files rewritten as a few, as a run of
its own, with nothing lost, nothing counted twice, and a crash at any step harmless."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from pipeline import ledger_compaction
from pipeline.audit import audit_ledger
from pipeline.ledger import LedgerJob, run_ledger
from pipeline.ledger_compaction import (
    COMPACTION_DIR,
    compact_ledger,
    compaction_due,
    describe_error,
    tidy_compactions,
)
from pipeline.ledger_store import LEDGER_DIR, TABLE_DIRS, load_ledger
from pipeline.run_log import LedgerRun, RunEntry, RunLog, read_run_log
from tracker.clock import to_millis

from .test_pipeline_ledger import _params, _topics
from .workload import Script, synthetic

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TopicFactory = Callable[..., Awaitable[str]]
RUN_COLUMNS = ["run_seq", "run_id"]


def _files(root: Path, table: str) -> list[Path]:
    return sorted((root / table).rglob("*.parquet"))


def _runs_in(spark: SparkSession, root: Path, table: str) -> set[int]:
    """The run numbers of every row stored in a table, counted or not."""
    rows = spark.read.parquet(str(root / table)).select("run_seq").distinct().collect()
    return {r["run_seq"] for r in rows}


def _same_rows(left: DataFrame, right: DataFrame) -> bool:
    a, b = left.drop(*RUN_COLUMNS), right.drop(*RUN_COLUMNS)
    return a.exceptAll(b).count() == 0 and b.exceptAll(a).count() == 0


def _kept(ledger: DataFrame | None) -> DataFrame:
    """``ledger``'s rows held by Spark, not read again from files a compaction deletes."""
    assert ledger is not None
    return ledger.drop(*RUN_COLUMNS).localCheckpoint()


def _audit(spark: SparkSession, root: Path) -> tuple[Any, ...]:
    result = audit_ledger(spark, str(root))
    broken = sorted((b["group"], b["offset"], b["state"]) for b in result.broken)
    return result.messages, result.states, broken, result.invalid_markers


async def _two_runs(
    spark: SparkSession, bootstrap: str, topic_factory: TopicFactory, root: Path, every: int
) -> tuple[str, str, Script, datetime, LedgerRun]:
    """Two runs with markers of their own (and a dead letter in the second)."""
    topic, markers = await _topics(bootstrap, topic_factory)
    as_of = datetime.now(UTC).replace(microsecond=0)
    script = Script(markers, 3)
    synthetic(script, topic, to_millis(as_of), only=[0, 2, 5, 6])
    await script.produce(bootstrap)
    job = LedgerJob(
        bootstrap,
        markers,
        str(root),
        _params(as_of),
        compact_every=every,
        replaced_files_kept=timedelta(0),
    )
    run_ledger(spark, job)
    synthetic(script, topic, to_millis(as_of), only=[3, 7])
    await script.produce(bootstrap)
    later = as_of + timedelta(minutes=55)
    second = run_ledger(spark, dataclasses.replace(job, params=_params(later)))
    return topic, markers, script, later, second


async def test_a_compaction_keeps_every_row_and_later_runs_go_on_exactly(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    root = tmp_path / "a ledger"  # a space: Spark lists such paths percent-encoded
    # compact_every=2: the second run compacts after its commit, on its own.
    topic, markers, script, later, second = await _two_runs(
        spark, kafka_bootstrap, topic_factory, root, every=2
    )
    runs = read_run_log(spark, str(root))
    assert [(e.run_seq, e.compaction) for e in runs.entries] == [(1, False), (2, False), (3, True)]
    assert runs.floor == 3
    assert runs.latest is not None
    assert runs.latest.compaction
    assert runs.latest.offsets == second.offsets, "the next run resumes where run 2 stopped"

    # Every table holds only the compaction's rows now, in one file per partition.
    for table in TABLE_DIRS:
        assert _runs_in(spark, root, table) == {3}, table
        files = _files(root, table)
        assert len(files) == len({f.parent for f in files}), table
    assert not list((root / COMPACTION_DIR).glob("*")), "the list of replaced files is gone"

    # The same ledger and audit as a ledger never compacted (one run over the same markers).
    uncompacted = tmp_path / "uncompacted"
    run_ledger(
        spark,
        LedgerJob(kafka_bootstrap, markers, str(uncompacted), _params(later), compact_every=0),
    )
    compacted_rows, plain_rows = load_ledger(spark, str(root)), load_ledger(spark, str(uncompacted))
    assert compacted_rows is not None
    assert plain_rows is not None
    assert _same_rows(compacted_rows.drop("as_of"), plain_rows.drop("as_of"))
    assert _audit(spark, root) == _audit(spark, uncompacted)

    # A run after the compaction resumes where run 2 stopped and appends only what changed.
    synthetic(script, topic, to_millis(later), only=[1])
    await script.produce(kafka_bootstrap)
    after = run_ledger(
        spark, LedgerJob(kafka_bootstrap, markers, str(root), _params(later), compact_every=2)
    )
    assert (after.run_seq, after.markers_read) == (4, 4)
    full = tmp_path / "full"
    run_ledger(spark, LedgerJob(kafka_bootstrap, markers, str(full), _params(later)))
    now_rows, full_rows = load_ledger(spark, str(root)), load_ledger(spark, str(full))
    assert now_rows is not None
    assert full_rows is not None
    assert _same_rows(now_rows.drop("as_of"), full_rows.drop("as_of"))


async def test_a_compaction_that_died_before_its_commit_changes_nothing(
    spark: SparkSession,
    kafka_bootstrap: str,
    topic_factory: TopicFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "a ledger"  # a space: Spark lists such paths percent-encoded
    await _two_runs(spark, kafka_bootstrap, topic_factory, root, every=0)
    before = _kept(load_ledger(spark, str(root)))
    audit_before = _audit(spark, root)

    def die(*_: object) -> None:
        raise RuntimeError("killed before the commit")

    monkeypatch.setattr(ledger_compaction, "commit_run", die)
    with pytest.raises(RuntimeError, match="killed"):
        compact_ledger(spark, str(root))
    monkeypatch.undo()

    # Its rows are on disk, but no reader counts them.
    assert _runs_in(spark, root, LEDGER_DIR) == {1, 2, 3}
    runs = read_run_log(spark, str(root))
    assert (runs.floor, len(runs.entries)) == (0, 2)
    after = load_ledger(spark, str(root))
    assert after is not None
    assert _same_rows(after, before)
    assert _audit(spark, root) == audit_before

    # A tidy (each run ends with one) deletes its files and its list: failed compactions do
    # not pile up copies of the ledger.
    tidy_compactions(spark, str(root), runs)
    for table in TABLE_DIRS:
        assert 3 not in _runs_in(spark, root, table), table
    assert not list((root / COMPACTION_DIR).glob("*"))

    # The next compaction takes number 3 again and leaves only its own rows.
    again = compact_ledger(spark, str(root), keep=timedelta(0))
    assert again is not None
    assert again.run_seq == 3
    for table in TABLE_DIRS:
        stored = spark.read.parquet(str(root / table)).select("run_id").distinct()
        assert {r[0] for r in stored.collect()} == {again.run_id}, table
    assert not list((root / COMPACTION_DIR).glob("*"))
    compacted = load_ledger(spark, str(root))
    assert compacted is not None
    assert _same_rows(compacted, before)
    assert _audit(spark, root) == audit_before


async def test_replaced_files_stay_for_readers_an_hour_counted_once_then_go(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    root = tmp_path / "a ledger"  # a space: Spark lists such paths percent-encoded
    _, markers, _, later, _ = await _two_runs(spark, kafka_bootstrap, topic_factory, root, every=0)
    before = _kept(load_ledger(spark, str(root)))
    audit_before = _audit(spark, root)
    old_files = {table: _files(root, table) for table in TABLE_DIRS}

    run = compact_ledger(spark, str(root))  # keeps the replaced files an hour by default
    assert run is not None
    assert all(f.exists() for files in old_files.values() for f in files)
    assert _runs_in(spark, root, LEDGER_DIR) == {1, 2, 3}
    # The old rows are still there, and counted once: through the compaction's copies.
    after = load_ledger(spark, str(root))
    assert after is not None
    assert after.count() == before.count()
    assert _same_rows(after, before)
    assert _audit(spark, root) == audit_before

    # As if it died between its commit and the mark that starts the hour: the next run
    # (nothing new to read) marks it now, and deletes nothing yet.
    marker = root / COMPACTION_DIR / run.run_id / "_COMMITTED"
    marker.unlink()
    nothing = run_ledger(spark, LedgerJob(kafka_bootstrap, markers, str(root), _params(later)))
    assert nothing.markers_read == 0
    assert marker.exists()
    assert all(f.exists() for files in old_files.values() for f in files)

    # An hour on, the tidy deletes them and the list.
    runs = read_run_log(spark, str(root))
    tidy_compactions(spark, str(root), runs, now=datetime.now(UTC) + timedelta(hours=1, seconds=5))
    assert not any(f.exists() for files in old_files.values() for f in files)
    assert not list((root / COMPACTION_DIR).glob("*"))
    for table in TABLE_DIRS:
        assert _runs_in(spark, root, table) <= {3, 4}, table
    final = load_ledger(spark, str(root))
    assert final is not None
    assert _same_rows(final, before)


def test_a_compaction_is_due_every_so_many_runs_and_retried_less_often() -> None:
    def log(*compactions: int, runs: int) -> RunLog:
        entries = tuple(
            RunEntry(seq, f"{seq:06d}-x", "f", 0, 0, compaction=seq in compactions)
            for seq in range(1, runs + 1)
        )
        return RunLog(entries)

    due = [seq for seq in range(1, 80) if compaction_due(log(runs=seq - 1), seq, 16)]
    assert due == list(range(16, 80, 2)), "at 16 runs, then every 16 // 8 runs until one commits"
    after = [seq for seq in range(31, 60) if compaction_due(log(30, runs=seq - 1), seq, 16)]
    assert after[0] == 46, "16 runs after the compaction (run 30)"
    assert not [seq for seq in range(1, 50) if compaction_due(log(runs=seq - 1), seq, 0)]


def test_a_failure_is_described_in_one_line_even_when_its_text_cannot_be_had() -> None:
    """What a failed compaction reports: type and message without the Java frames, cut to a
    bounded length, and the type alone when the message itself fails (a Py4J error asks the
    JVM for it) rather than an exception out of the report of a committed run."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ConnectionError("the JVM is gone")

    java = RuntimeError(
        "An error occurred while calling o57.save.\n: java.io.IOException: disk full\n"
        "\tat org.apache.hadoop.fs.Foo.bar(Foo.java:1)\n\tat more"
    )
    assert describe_error(java) == (
        "RuntimeError: An error occurred while calling o57.save. : java.io.IOException: disk full"
    )
    assert describe_error(Unprintable()) == "Unprintable"
    long = describe_error(OSError("x" * 2000))
    assert len(long) == ledger_compaction.ERROR_TEXT_MAX
    assert long.endswith("...")
