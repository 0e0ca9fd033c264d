"""The delivery ledger job: incremental runs that read markers and dead letters from Kafka,
fold them (:mod:`pipeline.ledger_fold`) and keep the result in a ledger directory.

Incremental runs. A ledger directory holds::

    ledger/topic=<t>/date=<d>/      ledger rows (Parquet), each with the run that wrote it
    history/markers/date=<d>/       every marker read (valid or not), with its run
    history/dlq/date=<d>/           every dead-letter record read (without payload)
    _runs/                          one JSON record per committed run: as-of, parameters,
                                    the next offset of every partition read, counts

A run reads only the offsets after the previous run's, appends them to the history, rebuilds
the rows of the messages they touch (plus open rows, whose state moves with time) from their
full history, and appends only rows that changed. The run is committed by its ``_runs`` record,
written last: rows of a run that died before that are ignored by every reader, and the next
run reads the same offsets again. The current ledger is the latest committed row per message.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, Observation, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    DateType,
    IntegerType,
    StringType,
    StructField,
    StructType,
)

from pipeline.ledger_fold import (
    FINAL_STATES,
    KEY,
    LEDGER_KEY,
    LedgerParams,
    build_ledger,
    fingerprint,
    orphan_dead_letters,
    stored_schema,
)
from pipeline.offsets import (
    Bound,
    OffsetRange,
    existing_topics,
    resolve_ranges,
)
from pipeline.record_schemas import spark_schema
from pipeline.source import DEFAULT_CHUNK, read_kafka

LEDGER_DIR = "ledger"
MARKERS_HISTORY_DIR = "history/markers"
DLQ_HISTORY_DIR = "history/dlq"
RUNS_DIR = "_runs"

_RUNS_SCHEMA = StructType(
    [
        StructField("run_seq", IntegerType()),
        StructField("run_id", StringType()),
        StructField("record", StringType()),  # the run's JSON (see LedgerRun.to_json)
    ]
)


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


@dataclass(slots=True)
class LedgerRun:
    """What a run did; its JSON is the run's commit record in ``_runs``."""

    run_seq: int
    run_id: str
    params: LedgerParams
    offsets: dict[str, dict[str, int]]  #: topic -> partition -> next offset to read
    topics: list[str]  #: origin topics seen so far
    dlq_topics: list[str]
    markers_read: int = 0
    invalid_markers: int = 0
    dlq_records_read: int = 0
    orphan_dlq_records: int = 0
    rows_written: int = 0
    states_written: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    committed_at: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["params"] = self.params.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LedgerRun:
        values = dict(data)
        values["params"] = LedgerParams.from_json(values["params"])
        return cls(**values)


def _path(root: str, sub: str) -> str:
    return f"{root.rstrip('/')}/{sub}"


def path_exists(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` exists, asked of the file system Spark itself reads it with (any
    Hadoop URI: a local path, ``s3a://``, ``hdfs://``, ...).

    Asked before reading a directory that a first run has not written yet: Spark's reader
    looks for a streaming sink's metadata there first and logs the ``FileNotFoundException``
    it gets, with its whole Java stack trace, as a warning, though nothing is wrong.
    """
    jvm = spark.sparkContext._jvm
    if jvm is None:  # pragma: no cover - a classic session always has its gateway
        return True
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    conf = spark._jsparkSession.sessionState().newHadoopConf()
    return bool(hadoop_path.getFileSystem(conf).exists(hadoop_path))


def _read_parquet(
    spark: SparkSession, path: str, schema: StructType | None = None
) -> DataFrame | None:
    """Parquet at ``path``, or None if nothing was written there yet.

    With ``schema``, partition columns get their types from it rather than being guessed from
    directory names (a topic called ``2024`` would otherwise come back as a number).
    """
    if not path_exists(spark, path):
        return None
    reader = spark.read.schema(schema) if schema is not None else spark.read
    try:
        return reader.parquet(path)
    except AnalysisException as exc:
        if "PATH_NOT_FOUND" in str(exc) or "UNABLE_TO_INFER_SCHEMA" in str(exc):
            return None
        raise


def committed_runs(spark: SparkSession, root: str) -> list[LedgerRun]:
    """The committed runs of the ledger at ``root``, oldest first."""
    if not path_exists(spark, _path(root, RUNS_DIR)):
        return []
    try:
        rows = spark.read.schema(_RUNS_SCHEMA).json(_path(root, RUNS_DIR)).collect()
    except AnalysisException as exc:
        if "PATH_NOT_FOUND" in str(exc):
            return []
        raise
    runs = [LedgerRun.from_json(json.loads(row["record"])) for row in rows]
    return sorted(runs, key=lambda r: r.run_seq)


def _committed(df: DataFrame, runs: Sequence[LedgerRun], current: str | None = None) -> DataFrame:
    """Rows written by a committed run (and by the ``current`` run, by its id).

    By run id, not sequence number: a run that died before its commit record leaves rows
    under the sequence number its rerun takes again, and those rows must stay invisible.
    """
    ids = [r.run_id for r in runs] + ([current] if current is not None else [])
    return df.where(F.col("run_id").isin(ids))


def load_ledger(
    spark: SparkSession, root: str, runs: Sequence[LedgerRun] | None = None
) -> DataFrame | None:
    """The current ledger: the latest committed row of every message (None: no ledger yet)."""
    runs = committed_runs(spark, root) if runs is None else runs
    if not runs:
        return None
    rows = _read_parquet(spark, _path(root, LEDGER_DIR), stored_schema(spark))
    if rows is None:
        return None
    newest = Window.partitionBy(*LEDGER_KEY).orderBy(F.col("run_seq").desc())
    return (
        _committed(rows, runs)
        .withColumn("_rank", F.row_number().over(newest))
        .where(F.col("_rank") == 1)
        .drop("_rank")
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


def run_ledger(spark: SparkSession, job: LedgerJob) -> LedgerRun:
    """Run the ledger job once (see the module docstring); returns the committed run."""
    started = time.monotonic()
    runs = committed_runs(spark, job.output)
    last = runs[-1] if runs else None
    seq = (last.run_seq + 1) if last else 1
    run_id = f"{seq:06d}-{uuid.uuid4().hex[:8]}"
    previous_offsets = last.offsets if last else {}
    resume = _resume(previous_offsets)

    def read(ranges: Sequence[OffsetRange], fmt: str) -> DataFrame:
        return read_kafka(
            spark,
            bootstrap=job.bootstrap,
            ranges=ranges,
            fmt=fmt,
            chunk=job.chunk,
            client_config=job.client_config,
            source=job.source,
            spark_kafka_options=job.spark_kafka_options,
        )

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
            _path(job.output, MARKERS_HISTORY_DIR),
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
            read(dlq_ranges, "dlq").drop(*_PAYLOAD),
            run,
            _path(job.output, DLQ_HISTORY_DIR),
            F.count(F.lit(1)).alias("n"),
        )["n"]
    _write_rows(spark, job, runs, run)
    run.offsets = _offsets([*marker_ranges, *dlq_ranges], previous_offsets)
    run.seconds = round(time.monotonic() - started, 3)
    run.committed_at = datetime.now(UTC).isoformat()
    record = spark.createDataFrame(
        [(run.run_seq, run.run_id, json.dumps(run.to_json()))], _RUNS_SCHEMA
    )
    record.coalesce(1).write.mode("append").json(_path(job.output, RUNS_DIR))
    return run


def _history_schema(fmt: str, *, payload: bool = True) -> StructType:
    fields = [f for f in spark_schema(fmt).fields if payload or f.name not in _PAYLOAD]
    schema = StructType(fields)
    for name, data_type in (
        ("run_seq", IntegerType()),
        ("run_id", StringType()),
        ("date", DateType()),
    ):
        schema = schema.add(name, data_type)
    return schema


_PAYLOAD = {"key", "value", "headers"}


def _run_tag(run: LedgerRun) -> list[Column]:
    """The columns that say which run wrote a row."""
    return [F.lit(run.run_seq).alias("run_seq"), F.lit(run.run_id).alias("run_id")]


def _append_history(
    records: DataFrame, run: LedgerRun, path: str, *metrics: Column
) -> dict[str, Any]:
    """Append ``records`` to the history at ``path`` (by date, tagged with ``run``) and
    return ``metrics`` over them, taken while they are written."""
    observed = Observation(f"kmq-ledger-{run.run_id}-{path.rsplit('/', 1)[-1]}")
    records.observe(observed, *metrics).select(
        "*", *_run_tag(run), F.to_date("timestamp").alias("date")
    ).write.mode("append").partitionBy("date").parquet(path)
    return observed.get


def _write_rows(spark: SparkSession, job: LedgerJob, runs: list[LedgerRun], run: LedgerRun) -> None:
    """Append the rows that this run changes (its history is written); fills in its counts."""
    params = job.params
    history = _read_parquet(
        spark, _path(job.output, MARKERS_HISTORY_DIR), _history_schema("markers")
    )
    dlq_history = _read_parquet(
        spark, _path(job.output, DLQ_HISTORY_DIR), _history_schema("dlq", payload=False)
    )
    if history is None:
        return
    this_run = F.col("run_id") == run.run_id
    new_markers = history.where(this_run)
    history = _committed(history, runs, run.run_id).drop("run_seq", "run_id", "date")
    new_dlq = None
    if dlq_history is not None:
        new_dlq = dlq_history.where(this_run)
        dlq_history = _committed(dlq_history, runs, run.run_id).drop("run_seq", "run_id", "date")
        if run.dlq_records_read:
            run.orphan_dlq_records = orphan_dead_letters(new_dlq, history).count()

    previous = load_ledger(spark, job.output, runs)
    if previous is not None:
        # Only messages with new markers or DLQ records, and open ones (time moves their
        # state), can change: rebuild those from their full history.
        touched = new_markers.where(F.col("error").isNull()).select(*KEY)
        if new_dlq is not None:
            touched = touched.unionByName(new_dlq.where(F.col("error").isNull()).select(*KEY))
        touched = touched.unionByName(
            previous.where(F.col("final_state").isin("in_flight", "stuck")).select(
                F.col("group"),
                F.col("topic").alias("origin_topic"),
                F.col("partition").alias("origin_partition"),
                F.col("offset").alias("origin_offset"),
            )
        ).distinct()
        history = history.join(touched, KEY, "left_semi")
        if dlq_history is not None:
            dlq_history = dlq_history.join(touched, KEY, "left_semi")
    dlq_input = dlq_history if params.dlq_checked else None
    rows = build_ledger(history, dlq_input, params)
    content = rows.columns
    rows = rows.withColumn("_fp", fingerprint(rows, content))
    if previous is not None:
        known = previous.select(*LEDGER_KEY, fingerprint(previous, content).alias("_fp"))
        rows = rows.join(known, [*LEDGER_KEY, "_fp"], "left_anti")
    written = Observation("kmq-ledger-rows")
    rows.drop("_fp").select(
        "*", *_run_tag(run), F.lit(params.as_of).cast("timestamp").alias("as_of")
    ).observe(
        written, *[F.count_if(F.col("final_state") == s).alias(s) for s in FINAL_STATES]
    ).write.mode("append").partitionBy("topic", "date").parquet(_path(job.output, LEDGER_DIR))
    run.states_written = {state: n for state, n in written.get.items() if n}
    run.rows_written = sum(run.states_written.values())
