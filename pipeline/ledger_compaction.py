"""Compaction: a ledger directory's many small files rewritten as a few, as a run of its own.

Why. Every run adds files: one per date to each history table it adds to and one rows file
per (topic, date) it touches, two to four per run, so a ledger kept by ``ledger --every 5m``
holds ~6,000 files after a week and ~300,000 after a year. Spark pays for each file it lists
and opens (~0.8 ms here), and every run scans the history and the rows, so a run's time grew
with the ledger's age until it no longer fit between runs.

How. A compaction is a run in the run log like any other (it takes the next run number C and
an id), flagged ``compaction``. It reads nothing from Kafka; it rewrites every row that counts
(:func:`pipeline.ledger_store.committed`) as its own: the history tables whole, the ledger
table as the latest row of each message (older versions are of no use to any reader), each
by date through the ``rebalance`` hint (with adaptive query execution, about one file per
advisory partition size of shuffled data). Once its record is committed, readers keep only
rows of run C and later (:attr:`pipeline.run_log.RunLog.floor`): the rows it copied count
once, through the copies. The files it replaced stay :data:`REPLACED_FILES_KEPT` after the
commit, for readers that read the run log before it (they count the old runs' rows and need
their files), then a later run's tidy deletes them.

Crash safety, with one writer per ledger as everywhere in the pipeline:

1. Before writing, the compaction lists every data file of the three tables into
   ``_compaction/<run id>/``. No other run writes meanwhile, so these are exactly the files
   its rows replace (rows of dead runs included).
2. It writes its rows, commits its record, then marks its list committed (``_COMMITTED``: the
   mark's time starts the keep).
3. A tidy (at the end of every run) deletes the listed files once the keep has passed, then
   the list.

A crash before the commit leaves rows of a run that never committed, ignored by id like any
dead run's; the next tidy deletes that run's own files (found by run id) and its list, so
compactions that keep failing do not pile up copies. A crash between the commit and the mark
leaves a list the next tidy marks. Failed compactions are retried every ``every // 8`` runs
(:func:`compaction_due`), not after every run.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from pipeline.hadoop_fs import (
    delete_files,
    delete_tree,
    join_path,
    modified_at,
    path_exists,
    touch,
    visible_children,
)
from pipeline.ledger_store import (
    DLQ_HISTORY_DIR,
    LEDGER_DIR,
    MARKERS_HISTORY_DIR,
    TABLE_DIRS,
    committed,
    load_ledger,
    read_history,
    read_parquet,
    run_tag,
)
from pipeline.run_log import LedgerRun, RunLog, commit_run, read_run_log

COMPACTION_DIR = "_compaction"
#: Runs after which ``ledger`` compacts on its own (a day of runs every five minutes).
COMPACT_EVERY = 288
#: How long the files a compaction replaced stay after its commit: a reader (an audit, a
#: report) that read the run log before the commit still counts the old runs' rows, and needs
#: their files until it is done.
REPLACED_FILES_KEPT = timedelta(hours=1)
#: Written into a compaction's list once it committed: its time starts the files' keep.
_COMMITTED_MARKER = "_COMMITTED"

log = logging.getLogger(__name__)
#: The longest error text a failed compaction reports (a Py4J error carries a Java stack).
ERROR_TEXT_MAX = 500


@dataclass(frozen=True, slots=True)
class CompactionFailed:
    """A compaction, or the tidy that ends each run, that failed after run ``after_run``.

    Not an error of the run: that run is committed, and a later one tries again. Reported
    to the caller (the command line puts it in the run's JSON as ``compaction_failed``) so
    that a compaction that fails run after run, say for want of disk, shows where the runs
    are watched and not only in a log line.
    """

    after_run: int
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"after_run": self.after_run, "error": self.error}


def describe_error(exc: BaseException) -> str:
    """``exc`` as one line: its type and message, without a Java stack trace (Py4J puts the
    JVM's whole trace in the message), cut at :data:`ERROR_TEXT_MAX` characters."""
    try:
        message = str(exc)
    except Exception:  # a Py4J error asks the JVM for its text, and the JVM may be gone
        message = ""
    lines = []
    for line in message.splitlines():
        text = line.strip()
        if text.startswith(("at ", "...")):
            break  # a Java stack frame: what came before says what failed
        if text:
            lines.append(text)
    text = f"{type(exc).__name__}: {' '.join(lines)}" if lines else type(exc).__name__
    return text if len(text) <= ERROR_TEXT_MAX else text[: ERROR_TEXT_MAX - 3] + "..."


def compaction_due(runs: RunLog, committed_seq: int, every: int) -> bool:
    """Whether run ``committed_seq`` is one after which to compact: ``every`` runs after the
    newest compaction (or the first run; 0: never), then every ``every // 8`` runs until one
    commits (a compaction that fails, say for want of disk, is not tried after every run)."""
    since = committed_seq - runs.floor
    return bool(every) and since >= every and (since - every) % max(1, every // 8) == 0


def compact_if_due(
    spark: SparkSession,
    root: str,
    runs: RunLog,
    committed_seq: int,
    every: int,
    *,
    keep: timedelta = REPLACED_FILES_KEPT,
) -> LedgerRun | CompactionFailed | None:
    """After run ``committed_seq`` committed (``runs``: the log it started from): compact if
    :func:`compaction_due`, else finish what earlier compactions left. Returns the compaction
    run if one ran, what failed if that failed, else None.

    Failures are returned and logged as one line, not raised: the run is committed, and a
    later one tries again. Every exception is caught for that reason (Spark and Py4J raise
    many kinds); its traceback is logged at DEBUG.
    """
    try:
        if compaction_due(runs, committed_seq, every):
            return compact_ledger(spark, root, keep=keep)
        tidy_compactions(spark, root, runs, keep=keep)
    except Exception as exc:
        failed = CompactionFailed(committed_seq, describe_error(exc))
        log.warning(
            "ledger: compaction after run %d failed (a later run retries): %s",
            committed_seq,
            failed.error,
        )
        log.debug("ledger: the failed compaction's traceback", exc_info=True)
        return failed
    return None


def _data_files(spark: SparkSession, root: str) -> list[str]:
    """Every data file of the three tables, as Spark's readers list them."""
    files: list[str] = []
    for table in TABLE_DIRS:
        df = read_parquet(spark, join_path(root, table))
        if df is not None:
            files.extend(df.inputFiles())
    return sorted(files)


def _list_dir(root: str, run_id: str) -> str:
    return join_path(root, f"{COMPACTION_DIR}/{run_id}")


def _write_list(spark: SparkSession, root: str, run_id: str, files: list[str]) -> None:
    frame = spark.createDataFrame([(f,) for f in files], "path string")
    frame.coalesce(1).write.mode("overwrite").text(_list_dir(root, run_id))


def _rewrite(df: DataFrame, run: LedgerRun, path: str, by: list[str]) -> int:
    """Append ``df`` at ``path`` as ``run``'s rows, partitioned ``by``; returns the count."""
    observed = Observation(f"kmq-compaction-{run.run_id}-{path.rsplit('/', 1)[-1]}")
    df.withColumns(run_tag(run)).observe(observed, F.count(F.lit(1)).alias("n")).hint(
        "rebalance", *by
    ).write.mode("append").partitionBy(*by).parquet(path)
    return int(observed.get["n"])


def compact_ledger(
    spark: SparkSession,
    root: str,
    runs: RunLog | None = None,
    *,
    keep: timedelta = REPLACED_FILES_KEPT,
) -> LedgerRun | None:
    """Compact the ledger at ``root`` (see the module docstring); returns the committed
    compaction run, or None when there is no committed run to compact. The files it replaced
    are deleted ``keep`` after its commit (by a later run's tidy unless ``keep`` is 0)."""
    started = time.monotonic()
    runs = read_run_log(spark, root) if runs is None else runs
    last = runs.latest
    if last is None:
        return None
    tidy_compactions(spark, root, runs, keep=keep)
    seq = last.run_seq + 1
    run = LedgerRun(
        seq,
        f"{seq:06d}-{uuid.uuid4().hex[:8]}",
        last.params,
        last.offsets,
        list(last.topics),
        list(last.dlq_topics),
        compaction=True,
    )
    replaced = _data_files(spark, root)
    _write_list(spark, root, run.run_id, replaced)
    for fmt, table in (("markers", MARKERS_HISTORY_DIR), ("dlq", DLQ_HISTORY_DIR)):
        history = read_history(spark, root, fmt)
        if history is not None:
            _rewrite(committed(history, runs), run, join_path(root, table), ["date"])
    ledger = load_ledger(spark, root, runs)
    if ledger is not None:
        run.rows_written = _rewrite(ledger, run, join_path(root, LEDGER_DIR), ["topic", "date"])
    run.seconds = round(time.monotonic() - started, 3)
    run.committed_at = datetime.now(UTC).isoformat()
    commit_run(spark, root, run)
    touch(spark, join_path(_list_dir(root, run.run_id), _COMMITTED_MARKER))
    if not keep:
        _finish(spark, root, run.run_id)
    log.info(
        "ledger: compaction %s rewrote %d rows, replaced %d files in %.1f s",
        run.run_id,
        run.rows_written,
        len(replaced),
        run.seconds,
    )
    return run


def _finish(spark: SparkSession, root: str, run_id: str) -> None:
    """Delete the files a committed compaction replaced, then its list."""
    listed = [row[0] for row in spark.read.text(_list_dir(root, run_id)).collect()]
    left = delete_files(spark, listed)
    if left:
        log.warning(
            "ledger: compaction %s could not delete %d replaced files (next run retries): %s",
            run_id,
            len(left),
            ", ".join(left[:5]),
        )
        return
    delete_tree(spark, _list_dir(root, run_id))


def _files_of(spark: SparkSession, root: str, run_id: str) -> list[str]:
    """The data files holding rows of run ``run_id`` (a compaction's files hold only its own;
    Parquet skips the others by their ``run_id`` statistics)."""
    files: list[str] = []
    for table in TABLE_DIRS:
        df = read_parquet(spark, join_path(root, table))
        if df is not None:
            of_run = df.where(F.col("run_id") == run_id).select("_metadata.file_path").distinct()
            files.extend(row[0] for row in of_run.collect())
    return files


def tidy_compactions(
    spark: SparkSession,
    root: str,
    runs: RunLog,
    *,
    keep: timedelta = REPLACED_FILES_KEPT,
    now: datetime | None = None,
) -> None:
    """Finish what compactions left. A committed one's replaced files are deleted once
    ``keep`` has passed since its commit (then its list). One that never committed had its
    rows ignored by id: its own files are deleted, then its list. ``runs`` is a complete read
    of the run log."""
    if not path_exists(spark, join_path(root, COMPACTION_DIR)):
        return
    now = now or datetime.now(UTC)
    committed_ids = set(runs.run_ids)
    for run_id in visible_children(spark, join_path(root, COMPACTION_DIR)) or []:
        if run_id not in committed_ids:
            left = delete_files(spark, _files_of(spark, root, run_id))
            if not left:
                delete_tree(spark, _list_dir(root, run_id))
            continue
        marker = join_path(_list_dir(root, run_id), _COMMITTED_MARKER)
        committed_at = modified_at(spark, marker)
        if committed_at is None:  # it died between its commit and the marker: start now
            touch(spark, marker)
        elif now - committed_at >= keep:
            _finish(spark, root, run_id)
