"""Reading a ledger directory: its tables, and which of their rows count.

A ledger directory holds::

    ledger/topic=<t>/date=<d>/      ledger rows (Parquet), each with the run that wrote it
    history/markers/date=<d>/       every marker read (valid or not), with its run
    history/dlq/date=<d>/           every dead-letter record read (without payload)
    _runs/, _runs_checkpoint/, _runs_archive/   the run log (see pipeline.run_log)
    _compaction/                    what a compaction replaces (see pipeline.ledger_compaction)

A row counts when the run that wrote it is committed (by id: a run that died before its commit
record leaves rows under the number its rerun takes again) and is not older than the newest
committed compaction, which rewrote every row that counted as its own.
"""

from __future__ import annotations

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DateType, IntegerType, StringType, StructType

from pipeline.hadoop_fs import join_path, path_exists
from pipeline.ledger_fold import LEDGER_KEY
from pipeline.ledger_schemas import STORED_SCHEMA
from pipeline.record_schemas import spark_schema
from pipeline.run_log import LedgerRun, RunLog, read_run_log

LEDGER_DIR = "ledger"
MARKERS_HISTORY_DIR = "history/markers"
DLQ_HISTORY_DIR = "history/dlq"
#: The tables of a ledger directory (each holds rows tagged with the run that wrote them).
TABLE_DIRS = (LEDGER_DIR, MARKERS_HISTORY_DIR, DLQ_HISTORY_DIR)
#: Columns of a dead letter the history leaves out.
PAYLOAD_COLUMNS = frozenset({"key", "value", "headers"})


def run_tag(run: LedgerRun) -> dict[str, Column]:
    """The columns that say which run wrote a row, for ``DataFrame.withColumns`` (which adds
    them, or replaces them in rows that carry an earlier run's)."""
    return {"run_seq": F.lit(run.run_seq), "run_id": F.lit(run.run_id)}


def read_parquet(
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


def history_schema(fmt: str) -> StructType:
    """A history table's schema: the records of ``fmt`` (dead letters without payload), the
    run that wrote them and their date."""
    fields = [f for f in spark_schema(fmt).fields if fmt != "dlq" or f.name not in PAYLOAD_COLUMNS]
    schema = StructType(fields)
    for name, data_type in (
        ("run_seq", IntegerType()),
        ("run_id", StringType()),
        ("date", DateType()),
    ):
        schema = schema.add(name, data_type)
    return schema


def read_history(spark: SparkSession, root: str, fmt: str) -> DataFrame | None:
    """Every stored record of a history table (``markers`` or ``dlq``), counted or not."""
    path = join_path(root, MARKERS_HISTORY_DIR if fmt == "markers" else DLQ_HISTORY_DIR)
    return read_parquet(spark, path, history_schema(fmt))


#: Up to this many run ids, :func:`committed` filters with an ``IN`` list; beyond, with a
#: broadcast semi-join. PySpark builds an ``IN`` list with a JVM call per value (~0.45 ms
#: each: 0.9 s for a week of five-minute runs, 47 s for a year) and every task carries the
#: list; the join costs ~0.1 s more than a short list, and ~1.4 s at a year of runs.
COMMITTED_IDS_INLINE = 64


def committed(df: DataFrame, runs: RunLog, current: str | None = None) -> DataFrame:
    """Rows that count (see the module docstring), and rows of the ``current`` run.

    By run id, not sequence number: a run that died before its commit record leaves rows
    under the sequence number its rerun takes again, and those rows must stay invisible.
    """
    if runs.floor:
        # Implied by the ids below (runs before the floor are not among them), but Parquet
        # can skip the row groups of files a compaction replaced by their statistics.
        df = df.where(F.col("run_seq") >= runs.floor)
    ids = runs.live_run_ids + ([current] if current is not None else [])
    if not ids or len(ids) <= COMMITTED_IDS_INLINE:
        return df.where(F.col("run_id").isin(ids))
    # One literal split in the JVM, not a literal per id (run ids are "<seq>-<hex>").
    committed_ids = df.sparkSession.range(1).select(
        F.explode(F.split(F.lit("\n".join(ids)), "\n")).alias("committed_id")
    )
    on = df["run_id"] == committed_ids["committed_id"]
    return df.join(F.broadcast(committed_ids), on, "left_semi")  # keeps df's columns and order


def committed_rows(spark: SparkSession, root: str, runs: RunLog) -> DataFrame | None:
    """Every stored version of every ledger row that counts (None: none yet)."""
    if runs.latest is None:
        return None
    rows = read_parquet(spark, join_path(root, LEDGER_DIR), STORED_SCHEMA)
    return None if rows is None else committed(rows, runs)


def load_ledger(spark: SparkSession, root: str, runs: RunLog | None = None) -> DataFrame | None:
    """The current ledger: the latest committed row of every message (None: no ledger yet)."""
    rows = committed_rows(spark, root, read_run_log(spark, root) if runs is None else runs)
    if rows is None:
        return None
    newest = Window.partitionBy(*LEDGER_KEY).orderBy(F.col("run_seq").desc())
    return (
        rows.withColumn("_rank", F.row_number().over(newest))
        .where(F.col("_rank") == 1)
        .drop("_rank")
    )
