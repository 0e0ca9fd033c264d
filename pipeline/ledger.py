"""The delivery ledger job: incremental runs that read markers and dead letters from Kafka,
fold them (:mod:`pipeline.ledger_fold`) and keep the result in a ledger directory (its layout,
and which stored rows count: :mod:`pipeline.ledger_store`).

A run reads only the offsets after the previous run's, appends them to the history, rebuilds
the rows of the messages they touch (plus open rows, whose state moves with time) from their
full history, and appends only rows that changed. The run is committed by its ``_runs`` record,
written last: rows of a run that died before that are ignored by every reader, and the next
run reads the same offsets again. The current ledger is the latest committed row per message.
Every ``compact_every`` runs, a run then compacts the directory's files
(:mod:`pipeline.ledger_compaction`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from pipeline.hadoop_fs import join_path
from pipeline.ledger_compaction import (
    COMPACT_EVERY,
    REPLACED_FILES_KEPT,
    CompactionFailed,
    compact_if_due,
)
from pipeline.ledger_fold import (
    FINAL_STATES,
    KEY,
    LEDGER_KEY,
    STATES_TIME_MOVES,
    LedgerParams,
    build_ledger,
    count_orphan_dead_letters,
    fingerprint,
    materialized,
)
from pipeline.ledger_schemas import CONTENT_HASH
from pipeline.ledger_store import (
    DLQ_HISTORY_DIR,
    LEDGER_DIR,
    MARKERS_HISTORY_DIR,
    PAYLOAD_COLUMNS,
    committed,
    committed_rows,
    read_history,
    run_tag,
)
from pipeline.offsets import (
    Bound,
    OffsetRange,
    existing_topics,
    resolve_ranges,
)
from pipeline.run_log import (
    CHECKPOINT_EVERY,
    LedgerRun,
    RunLog,
    checkpoint_if_due,
    commit_run,
    read_run_log,
)
from pipeline.source import DEFAULT_CHUNK, read_kafka

# --------------------------------------------------------------------------------------------
# The incremental job


@dataclass(slots=True)
class LedgerJob:
    """One ledger run: where to read, where to write, how to judge open messages."""

    bootstrap: str
    markers_topic: str
    output: str
    params: LedgerParams
    dlq_topics: Sequence[str] | None = None  #: None: ``<topic>.dlq`` of every topic seen
    start: Bound | None = None  #: where a partition without a checkpoint starts
    end: Bound | None = None  #: where this run stops (default: the end at its start)
    chunk: int = DEFAULT_CHUNK
    client_config: Mapping[str, Any] = field(default_factory=dict)
    source: str = "python"
    spark_kafka_options: Mapping[str, str] = field(default_factory=dict)
    #: run records read from their own files that make a run checkpoint the run log
    checkpoint_every: int = CHECKPOINT_EVERY
    #: runs after which a run compacts the ledger (see pipeline.ledger_compaction; 0: never)
    compact_every: int = COMPACT_EVERY
    #: how long the files a compaction replaced stay, for readers that started before it
    replaced_files_kept: timedelta = REPLACED_FILES_KEPT


_TIME_MOVES = "time_moves"


def _current_state(spark: SparkSession, root: str, runs: RunLog) -> DataFrame | None:
    """What a run needs of the current ledger: per message, its latest committed row's
    content hash and whether time still moves its state (``in_flight`` or ``stuck``: such a
    message is rebuilt by every run); None: no ledger yet.

    Not :func:`pipeline.ledger_store.load_ledger`: that window sorts every stored version of
    every row, whole (attempt histories included), to hand readers the latest rows. This
    reads four narrow columns besides the key and keeps the latest per message with a hash
    aggregation (``max_by`` of fixed-width values by ``run_seq``, which is unique per
    message: a run writes a message's row at most once, and a compaction keeps one).
    """
    rows = committed_rows(spark, root, runs)
    if rows is None:
        return None
    seq = F.col("run_seq")
    return rows.groupBy(*LEDGER_KEY).agg(
        F.max_by(CONTENT_HASH, seq).alias(CONTENT_HASH),
        F.max_by(F.col("final_state").isin(*STATES_TIME_MOVES), seq).alias(_TIME_MOVES),
    )


def _offsets(
    ranges: Sequence[OffsetRange], previous: Mapping[str, Mapping[str, int]]
) -> dict[str, dict[str, int]]:
    out = {topic: dict(parts) for topic, parts in previous.items()}
    for r in ranges:
        out.setdefault(r.topic, {})[str(r.partition)] = r.end
    return out


def _resume(offsets: Mapping[str, Mapping[str, int]]) -> dict[tuple[str, int], int]:
    return {(t, int(p)): o for t, parts in offsets.items() for p, o in parts.items()}


def run_ledger(
    spark: SparkSession,
    job: LedgerJob,
    *,
    on_compaction: Callable[[LedgerRun | CompactionFailed], None] | None = None,
) -> LedgerRun:
    """Run the ledger job once (see the module docstring); returns the committed run.

    A compaction that follows it (when due, see :mod:`pipeline.ledger_compaction`) is a run of
    its own in the log; ``on_compaction`` is called with it, or with what failed if it (or the
    tidy after the run) failed, so a caller that reports runs can report that too (the
    command line adds it to the run's JSON and summary).
    """
    started = time.monotonic()
    runs = read_run_log(spark, job.output)
    last = runs.latest
    seq = (last.run_seq + 1) if last else 1
    run_id = f"{seq:06d}-{uuid.uuid4().hex[:8]}"
    previous_offsets = last.offsets if last else {}
    resume = _resume(previous_offsets)

    def read(ranges: Sequence[OffsetRange], fmt: str) -> DataFrame:
        records = read_kafka(
            spark,
            bootstrap=job.bootstrap,
            ranges=ranges,
            fmt=fmt,
            chunk=job.chunk,
            client_config=job.client_config,
            source=job.source,
            spark_kafka_options=job.spark_kafka_options,
        )
        # A task per `chunk` offsets in all, not per partition with new records: each task
        # writes a history file, and every later run pays for each file it scans (~0.8 ms),
        # so a small run of a 32-partition markers topic would add 32 files.
        return records.coalesce(max(1, -(-sum(r.size for r in ranges) // job.chunk)))

    marker_ranges = resolve_ranges(
        job.bootstrap,
        [job.markers_topic],
        start=job.start,
        end=job.end,
        resume=resume,
        client_config=job.client_config,
    )
    run = LedgerRun(seq, run_id, job.params, {}, [], [])
    # The new records go straight to the history; the counts and the topics seen are
    # observed while they are written (no cached copy, no extra pass over Kafka or Spark).
    if sum(r.size for r in marker_ranges):
        stats = _append_history(
            read(marker_ranges, "markers"),
            run,
            join_path(job.output, MARKERS_HISTORY_DIR),
            F.count(F.lit(1)).alias("n"),
            F.count("error").alias("invalid"),
            F.collect_set("origin_topic").alias("topics"),
        )
        run.markers_read, run.invalid_markers = stats["n"], stats["invalid"]
        seen = set(stats["topics"])
    else:
        seen = set()
    run.topics = sorted(seen.union(last.topics if last else ()))
    if job.dlq_topics is not None:
        run.dlq_topics = list(job.dlq_topics)
    else:
        run.dlq_topics = existing_topics(
            job.bootstrap, [f"{t}.dlq" for t in run.topics], job.client_config
        )
    dlq_ranges = resolve_ranges(
        job.bootstrap,
        run.dlq_topics,
        start=job.start,
        end=job.end,
        resume=resume,
        client_config=job.client_config,
        missing_ok=True,
    )
    if sum(r.size for r in dlq_ranges):
        run.dlq_records_read = _append_history(
            read(dlq_ranges, "dlq").drop(*PAYLOAD_COLUMNS),
            run,
            join_path(job.output, DLQ_HISTORY_DIR),
            F.count(F.lit(1)).alias("n"),
        )["n"]
    _write_rows(spark, job, runs, run)
    run.offsets = _offsets([*marker_ranges, *dlq_ranges], previous_offsets)
    run.seconds = round(time.monotonic() - started, 3)
    run.committed_at = datetime.now(UTC).isoformat()
    commit_run(spark, job.output, run)
    checkpoint_if_due(spark, job.output, runs, job.checkpoint_every)
    compaction = compact_if_due(
        spark, job.output, runs, run.run_seq, job.compact_every, keep=job.replaced_files_kept
    )
    if compaction is not None and on_compaction is not None:
        on_compaction(compaction)
    return run


def _append_history(
    records: DataFrame, run: LedgerRun, path: str, *metrics: Column
) -> dict[str, Any]:
    """Append ``records`` to the history at ``path`` (by date, tagged with ``run``) and
    return ``metrics`` over them, taken while they are written."""
    observed = Observation(f"kmq-ledger-{run.run_id}-{path.rsplit('/', 1)[-1]}")
    records.observe(observed, *metrics).withColumns(run_tag(run)).withColumn(
        "date", F.to_date("timestamp")
    ).write.mode("append").partitionBy("date").parquet(path)
    return observed.get


def _write_rows(spark: SparkSession, job: LedgerJob, runs: RunLog, run: LedgerRun) -> None:
    """Append the rows that this run changes (its history is written); fills in its counts."""
    params = job.params
    history = read_history(spark, job.output, "markers")
    dlq_history = read_history(spark, job.output, "dlq")
    if history is None:
        return
    this_run = F.col("run_id") == run.run_id
    new_markers = history.where(this_run)
    history = committed(history, runs, run.run_id).drop("run_seq", "run_id", "date")
    new_dlq = None
    if dlq_history is not None:
        new_dlq = dlq_history.where(this_run)
        dlq_history = committed(dlq_history, runs, run.run_id).drop("run_seq", "run_id", "date")
        if run.dlq_records_read:
            run.orphan_dlq_records = count_orphan_dead_letters(new_dlq, history)

    previous = _current_state(spark, job.output, runs)
    with ExitStack() as kept:
        touched = None
        if previous is not None:
            # Only messages with new markers or DLQ records, and open ones (time moves their
            # state), can change: rebuild those from their full history.
            new_records = [new_markers] if new_dlq is None else [new_markers, new_dlq]
            touched = kept.enter_context(materialized(_touched(previous, new_records)))
            keys = touched.select(*KEY)
            history = history.join(keys, KEY, "left_semi")
            if dlq_history is not None:
                dlq_history = dlq_history.join(keys, KEY, "left_semi")
        dlq_input = dlq_history if params.dlq_checked else None
        rows = build_ledger(history, dlq_input, params)
        rows = rows.withColumn(CONTENT_HASH, fingerprint(rows, rows.columns))
        if touched is not None:
            # A row saying what the message's current row says is not written again.
            known = touched.where(F.col(CONTENT_HASH).isNotNull()).select(
                *(F.col(k).alias(name) for k, name in zip(KEY, LEDGER_KEY, strict=True)),
                CONTENT_HASH,
            )
            rows = rows.join(known, [*LEDGER_KEY, CONTENT_HASH], "left_anti")
        _append_rows(rows, job, run)


def _touched(previous: DataFrame, new_records: Sequence[DataFrame]) -> DataFrame:
    """The messages a run rebuilds, with their current rows' content hashes (null: no row
    yet, or one stored before the column existed): those named by a new valid record
    (``new_records``, in marker or DLQ columns), and those whose state time still moves
    (``in_flight``, ``stuck``: :func:`_current_state`). The caller keeps it
    (:func:`~pipeline.ledger_fold.materialized`).

    Kept, the stored state is scanned once for both uses (finding the open messages, and
    the hashes that keep unchanged rows from being written again); Spark would prune each
    use's columns differently and scan it twice. And the set's size is known when the run's
    main job is planned, so where it is small (as in a run every few minutes) Spark
    broadcasts it and filters the history as it reads it. Planned without that size, it
    shuffled the whole history by message key before the filter (1,060,004 markers to
    rebuild 24,500 messages, 2.5 s of the tasks' time per run; 2026-12-02).
    """
    c = F.col
    new_keys = new_records[0].where(c("error").isNull()).select(*KEY)
    for records in new_records[1:]:
        new_keys = new_keys.unionByName(records.where(c("error").isNull()).select(*KEY))
    state = previous.select(
        *(c(name).alias(k) for k, name in zip(KEY, LEDGER_KEY, strict=True)),
        CONTENT_HASH,
        _TIME_MOVES,
    )
    flagged = state.join(new_keys.distinct().withColumn("_new", F.lit(True)), KEY, "full_outer")
    return flagged.where(c("_new") | c(_TIME_MOVES)).select(*KEY, CONTENT_HASH)


def _append_rows(rows: DataFrame, job: LedgerJob, run: LedgerRun) -> None:
    """Append the run's ``rows`` to the ledger (tagged with the run); fills in its counts."""
    params = job.params
    written = Observation("kmq-ledger-rows")
    rows.withColumns(run_tag(run)).withColumn(
        "as_of", F.lit(params.as_of).cast("timestamp")
    ).observe(
        written, *[F.count_if(F.col("final_state") == s).alias(s) for s in FINAL_STATES]
    ).write.mode("append").partitionBy("topic", "date").parquet(join_path(job.output, LEDGER_DIR))
    run.states_written = {state: n for state, n in written.get.items() if n}
    run.rows_written = sum(run.states_written.values())
