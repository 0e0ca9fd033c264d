"""The ledger's run log with checkpoints (pipeline.run_log), on a local file system.

Runs are committed as ``run_ledger`` commits them (``commit_run``, then ``checkpoint_if_due``
with the log the run started from), without Kafka: what is under test is which records a
reader finds, and what a checkpoint lets it skip.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from pipeline import run_log
from pipeline.ledger_fold import LedgerError, LedgerParams
from pipeline.run_log import (
    ARCHIVE_DIR,
    CHECKPOINT_DIR,
    RUNS_DIR,
    LedgerRun,
    RunLog,
    checkpoint_if_due,
    commit_run,
    read_run_log,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AS_OF = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _run(seq: int) -> LedgerRun:
    return LedgerRun(
        run_seq=seq,
        run_id=f"{seq:06d}-{uuid.uuid4().hex[:8]}",
        params=LedgerParams(as_of=AS_OF),
        offsets={"markers": {"0": 10 * seq}},
        topics=["orders"],
        dlq_topics=["orders.dlq"],
        invalid_markers=seq,  # distinct counts, so a sum that misses or repeats a run shows
        orphan_dlq_records=1,
    )


def _commit_next(spark: SparkSession, root: str, every: int) -> tuple[LedgerRun, RunLog, bool]:
    """One run as ``run_ledger`` does it: read the log, commit, checkpoint if due."""
    log = read_run_log(spark, root)
    run = _run(log.latest.run_seq + 1 if log.latest else 1)
    commit_run(spark, root, run)
    return run, log, checkpoint_if_due(spark, root, log, every)


def _records(root: Path, sub: str) -> int:
    where = root / sub
    return len(list(where.glob("part-*.json"))) if where.is_dir() else 0


def test_a_reader_finds_every_committed_run_through_checkpoints(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = tmp_path / "ledger"
    assert read_run_log(spark, str(root)) == RunLog()
    committed: list[LedgerRun] = []
    written: list[int] = []
    for _ in range(9):
        run, started_from, checkpointed = _commit_next(spark, str(root), every=3)
        committed.append(run)
        if checkpointed:
            written.append(started_from.entries[-1].run_seq)
        log = read_run_log(spark, str(root))
        assert log.run_ids == [r.run_id for r in committed]
        assert log.latest == run, "the newest record, whole"
        assert log.invalid_markers == sum(r.invalid_markers for r in committed)
        assert log.orphan_dlq_records == len(committed)
        assert _records(root, RUNS_DIR) <= 2 * 3, "never more than two checkpoints' worth"

    # Runs 4, 7 found 3 records not covered (1-3, then 4-6 besides checkpoint 3): each
    # checkpointed the runs before it.
    assert written == [3, 6]
    log = read_run_log(spark, str(root))
    assert (log.checkpoint, log.uncovered) == (6, 3)
    # Checkpoint 6 made checkpoint 3's files redundant: they were archived, kept for people.
    assert (_records(root, RUNS_DIR), _records(root, ARCHIVE_DIR)) == (6, 3)
    assert sorted(p.name for p in (root / CHECKPOINT_DIR).iterdir()) == [
        "seq=000000003",
        "seq=000000006",
    ]

    # A tenth run checkpoints 1-9 and deletes checkpoint 3 (a reader holds 6 at the oldest).
    _commit_next(spark, str(root), every=3)
    assert sorted(p.name for p in (root / CHECKPOINT_DIR).iterdir()) == [
        "seq=000000006",
        "seq=000000009",
    ]
    assert (_records(root, RUNS_DIR), _records(root, ARCHIVE_DIR)) == (4, 6)
    log = read_run_log(spark, str(root))
    assert (log.checkpoint, log.uncovered, len(log.entries)) == (9, 1, 10)


def test_a_checkpoint_whose_writer_died_is_ignored(spark: SparkSession, tmp_path: Path) -> None:
    root = tmp_path / "ledger"
    for _ in range(3):
        _commit_next(spark, str(root), every=100)
    whole = read_run_log(spark, str(root))
    # What a writer that died while writing leaves: its file, no completion marker.
    broken = root / CHECKPOINT_DIR / "seq=000000003"
    broken.mkdir(parents=True)
    (broken / "part-00000-dead.json").write_text('{"run_seq": 1, "run_id": "x"')
    log = read_run_log(spark, str(root))
    assert (log.checkpoint, log.run_ids, log.latest) == (None, whole.run_ids, whole.latest)


def test_a_failed_checkpoint_leaves_the_run_committed(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ledger"
    for _ in range(2):
        _commit_next(spark, str(root), every=100)
    log = read_run_log(spark, str(root))
    # The checkpoint directory's place is taken by a file: writing under it fails.
    (root / CHECKPOINT_DIR).write_text("not a directory")
    assert not checkpoint_if_due(spark, str(root), log, every=1)
    assert "checkpoint was not written" in caplog.text
    assert read_run_log(spark, str(root)).run_ids == log.run_ids


def test_a_reader_misses_nothing_the_writer_archives_while_it_reads(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ledger"
    for _ in range(6):  # run 4 checkpointed runs 1-3; runs 4-6 are not covered yet
        _commit_next(spark, str(root), every=3)
    choose = run_log._newest_complete_checkpoint
    interleaved: list[RunLog] = []

    def choose_then_let_a_writer_run(spark: SparkSession, root: str) -> int | None:
        chosen = choose(spark, root)
        if not interleaved:  # the reader under test (the writer's own read passes through)
            interleaved.append(RunLog())
            _, started_from, checkpointed = _commit_next(spark, root, every=3)
            interleaved[0] = started_from
            assert checkpointed, "run 7 checkpointed 1-6 and archived 1-3"
        return chosen

    monkeypatch.setattr(run_log, "_newest_complete_checkpoint", choose_then_let_a_writer_run)
    log = read_run_log(spark, str(root))
    assert log.checkpoint == 3, "the reader holds the checkpoint it chose before the writer ran"
    assert _records(root, ARCHIVE_DIR) == 3, "and the writer moved the files it covers"
    assert [e.run_seq for e in log.entries] == list(range(1, 8))
    assert log.run_ids == [*interleaved[0].run_ids, log.entries[-1].run_id]


def test_a_record_gone_from_the_run_log_is_an_error_not_a_shorter_log(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = tmp_path / "ledger"
    for _ in range(3):
        _commit_next(spark, str(root), every=100)
    for record in (root / RUNS_DIR).glob("part-*.json"):
        if json.loads(record.read_text())["run_seq"] == 2:
            record.unlink()
    with pytest.raises(LedgerError, match=r"damaged: run numbers 1, 3 \(expected 1 to 2"):
        read_run_log(spark, str(root))
