"""Bulk redrive: republish a SQL-selected set of dead letters, once, from the executors.

The tracker's own redrive (admin API) handles what one process can; this one is for "every
dead letter of last Tuesday whose reason mentions the payments API": millions of records.

1. The DLQ topics are read (:mod:`pipeline.source`, ``dlq`` format) into a view with helper
   columns: ``key_text``, ``value_text`` and ``header`` (a map of header name to text), next
   to the parsed ``kmq-dlq-*`` columns (``reason``, ``attempts``, ``dead_lettered_at``...).
2. ``--where`` (any Spark SQL boolean expression over that view) selects the records.
3. The *manifest* (Parquet files under one directory, keyed by the DLQ record's
   ``dlq_topic``/``dlq_partition``/``dlq_offset``, each with the produced partition and
   offset) removes what an earlier run already republished: a rerun never produces twice.
4. Executors republish to the original topic (``kmq-origin``) or a ``target_topic``: the
   payload, key and application headers, without ``kmq-dlq-*``, plus ``kmq-redrive-run`` and
   ``kmq-redrive-source`` so every copy says where it came from. Each task paces itself with
   a token bucket of ``rate / tasks`` records per second, waits for the broker's acks, and
   then writes that batch's manifest file itself. A task retried by Spark first reads the
   manifest files of its earlier attempts and skips what they recorded.

``dry_run`` only counts: selected, already redriven, unroutable, to produce per target.

The one remaining window: a task killed between the broker's ack and its manifest write
republishes that batch again when the job is rerun (at-least-once, like the tracker); the
``kmq-redrive-source`` header identifies the duplicate. The manifest directory is read and
written with ``pyarrow.fs`` (a local path, or ``s3://``, ``hdfs://``, ``gs://`` on a cluster).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pipeline.offsets import existing_topics, resolve_ranges
from pipeline.record_schemas import arrow_schema
from pipeline.source import DEFAULT_CHUNK, read_kafka
from tracker.headers import REDRIVE_RUN, REDRIVE_SOURCE, redrive_headers
from tracker.ratelimit import TokenBucket

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyarrow import fs as pafs

MAX_BATCH = 500  #: records produced per acknowledged batch (and per manifest file), at most
#: A task's token bucket holds at most this much of its rate: many tasks catching up at once
#: must not add up to a burst the target cluster notices.
BURST_SECONDS = 0.1

MANIFEST_SCHEMA = StructType(
    [
        StructField("dlq_topic", StringType()),
        StructField("dlq_partition", IntegerType()),
        StructField("dlq_offset", LongType()),
        StructField("target_topic", StringType()),
        StructField("target_partition", IntegerType()),
        StructField("target_offset", LongType()),
        StructField("run_id", StringType()),
        StructField("produced_at", TimestampType()),
    ]
)
POSITION = ["dlq_topic", "dlq_partition", "dlq_offset"]


class RedriveError(Exception):
    """The redrive cannot run as asked."""


@dataclass(slots=True)
class BulkRedriveJob:
    bootstrap: str
    dlq_topics: Sequence[str]
    manifest: str
    where: str | None = None
    target_topic: str | None = None
    rate: float | None = None  #: records per second for the whole job (None: unlimited)
    tasks: int = 2  #: Spark tasks that produce in parallel
    dry_run: bool = False
    client_config: Mapping[str, Any] = field(default_factory=dict)
    chunk: int = DEFAULT_CHUNK
    run_id: str | None = None


@dataclass(slots=True)
class RedriveResult:
    run_id: str
    dry_run: bool
    selected: int
    already_redriven: int
    unroutable: int
    to_produce: int
    produced: int
    per_target: dict[str, int]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


# --------------------------------------------------------------------------------------------
# The manifest (pyarrow.fs: readable and writable on the driver and on every executor)


def manifest_fs(location: str) -> tuple[pafs.FileSystem, str]:
    from pyarrow import fs  # noqa: PLC0415

    if "://" not in location:
        location = str(Path(location).resolve())
    filesystem, path = fs.FileSystem.from_uri(location)
    return filesystem, path


def _manifest_files(filesystem: pafs.FileSystem, base: str, prefix: str = "part-") -> list[str]:
    from pyarrow import fs  # noqa: PLC0415

    info = filesystem.get_file_info(base)
    if info.type == fs.FileType.NotFound:
        return []
    selector = fs.FileSelector(base, recursive=False)
    return sorted(
        i.path
        for i in filesystem.get_file_info(selector)
        if i.type == fs.FileType.File
        and i.base_name.startswith(prefix)
        and i.base_name.endswith(".parquet")
    )


def read_manifest(location: str, prefix: str = "part-") -> pa.Table:
    """Every manifest entry under ``location`` (an empty table when there is none)."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # noqa: PLC0415

    filesystem, base = manifest_fs(location)
    schema = arrow_schema(MANIFEST_SCHEMA)
    tables = [
        pq.read_table(path, filesystem=filesystem, schema=schema)
        for path in _manifest_files(filesystem, base, prefix)
    ]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _write_manifest(filesystem: pafs.FileSystem, base: str, name: str, batch: Any) -> None:
    """Write one manifest file atomically: a hidden temporary name, then a rename."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    filesystem.create_dir(base, recursive=True)
    temporary = f"{base}/.{name}.tmp"
    pq.write_table(pa.Table.from_batches([batch]), temporary, filesystem=filesystem)
    filesystem.move(temporary, f"{base}/{name}")


# --------------------------------------------------------------------------------------------
# Producing (executors)


async def _produce(producer: Any, rows: list[dict[str, Any]], run_id: str) -> list[Any]:
    futures = []
    for row in rows:
        source = f"{row['dlq_topic']}/{row['dlq_partition']}/{row['dlq_offset']}"
        headers = [(h["key"], h["value"]) for h in row["headers"] or ()]
        futures.append(
            await producer.send(
                row["target_topic"],
                value=row["value"],
                key=row["key"],
                headers=redrive_headers(
                    headers, [(REDRIVE_RUN, run_id.encode()), (REDRIVE_SOURCE, source.encode())]
                ),
            )
        )
    return list(await asyncio.gather(*futures))


async def _start_producer(bootstrap: str, config: Mapping[str, Any]) -> Any:
    """An aiokafka producer (it must be created on the loop that will run it)."""
    from aiokafka import AIOKafkaProducer  # noqa: PLC0415

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **{"acks": "all", **config})
    try:
        await producer.start()
    except BaseException:
        await producer.stop()
        raise
    return producer


def producer_task(
    *,
    bootstrap: str,
    config: Mapping[str, Any],
    rate_per_task: float | None,
    manifest: str,
    run_id: str,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function that republishes one Spark partition of dead letters."""
    schema = arrow_schema(MANIFEST_SCHEMA)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa  # noqa: PLC0415
        from pyspark import TaskContext  # noqa: PLC0415

        context = TaskContext.get()
        part = context.partitionId() if context else 0
        attempt = context.attemptNumber() if context else 0
        filesystem, base = manifest_fs(manifest)
        earlier = read_manifest(manifest, prefix=f"part-{run_id}-{part:05d}-")
        done = set(zip(*(earlier.column(c).to_pylist() for c in POSITION), strict=True))
        bucket = (
            TokenBucket(rate_per_task, max(1.0, rate_per_task * BURST_SECONDS))
            if rate_per_task
            else None
        )
        loop = asyncio.new_event_loop()
        producer = loop.run_until_complete(_start_producer(bootstrap, config))
        seq = 0
        try:
            for batch in batches:
                rows = [
                    r
                    for r in batch.to_pylist()
                    if (r["dlq_topic"], r["dlq_partition"], r["dlq_offset"]) not in done
                ]
                i = 0
                while i < len(rows):
                    wanted = min(MAX_BATCH, len(rows) - i)
                    n = bucket.take_blocking(wanted) if bucket is not None else wanted
                    chunk, i = rows[i : i + n], i + n
                    results = loop.run_until_complete(_produce(producer, chunk, run_id))
                    now = datetime.now(UTC)
                    out = pa.RecordBatch.from_pydict(
                        {
                            "dlq_topic": [r["dlq_topic"] for r in chunk],
                            "dlq_partition": [r["dlq_partition"] for r in chunk],
                            "dlq_offset": [r["dlq_offset"] for r in chunk],
                            "target_topic": [r["target_topic"] for r in chunk],
                            "target_partition": [m.partition for m in results],
                            "target_offset": [m.offset for m in results],
                            "run_id": [run_id] * len(chunk),
                            "produced_at": [now] * len(chunk),
                        },
                        schema=schema,
                    )
                    name = f"part-{run_id}-{part:05d}-{attempt}-{seq:06d}.parquet"
                    _write_manifest(filesystem, base, name, out)
                    seq += 1
                    yield out
        finally:
            loop.run_until_complete(producer.stop())
            loop.close()

    return run


# --------------------------------------------------------------------------------------------
# The job (driver)


def dlq_view(spark: SparkSession, job: BulkRedriveJob) -> DataFrame:
    """The DLQ records of ``job.dlq_topics`` with the helper columns ``--where`` can use."""
    topics = existing_topics(job.bootstrap, list(job.dlq_topics), job.client_config)
    missing = sorted(set(job.dlq_topics) - set(topics))
    if missing:
        raise RedriveError(f"DLQ topics not found: {', '.join(missing)}")
    ranges = resolve_ranges(job.bootstrap, topics, client_config=job.client_config)
    dlq = read_kafka(
        spark,
        bootstrap=job.bootstrap,
        ranges=ranges,
        fmt="dlq",
        chunk=job.chunk,
        client_config=job.client_config,
    )
    header = F.map_from_entries(
        F.transform("headers", lambda h: F.struct(h["key"].alias("k"), h["value"].cast("string")))
    )
    return dlq.select(
        "*",
        F.col("key").cast("string").alias("key_text"),
        F.col("value").cast("string").alias("value_text"),
        header.alias("header"),
    )


def run_redrive(spark: SparkSession, job: BulkRedriveJob) -> RedriveResult:
    """Select, skip what the manifest has, then count (dry run) or republish."""
    started = time.monotonic()
    run_id = job.run_id or f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    if job.tasks <= 0:
        raise RedriveError("tasks must be positive")
    if job.rate is not None and job.rate <= 0:
        raise RedriveError("rate must be positive")
    view = dlq_view(spark, job)
    selected = view.where(job.where) if job.where else view
    target = F.lit(job.target_topic) if job.target_topic else F.col("origin_topic")
    selected = selected.withColumn("target_topic", target).cache()
    try:
        done_rows = read_manifest(job.manifest)
        positions = list(zip(*(done_rows.column(c).to_pylist() for c in POSITION), strict=True))
        done = spark.createDataFrame(positions, StructType(MANIFEST_SCHEMA.fields[:3]))
        counts = (
            selected.join(done.withColumn("_done", F.lit(True)), POSITION, "left")
            .select(
                F.count("*").alias("selected"),
                F.count("_done").alias("already"),
                F.count(F.when(F.col("_done").isNull() & F.col("target_topic").isNull(), 1)).alias(
                    "unroutable"
                ),
            )
            .first()
        )
        if counts is None:  # pragma: no cover - a global aggregate always has a row
            raise RedriveError("counting the selection returned nothing")
        todo = selected.where(F.col("target_topic").isNotNull()).join(done, POSITION, "left_anti")
        per_target = {
            r["target_topic"]: r["count"] for r in todo.groupBy("target_topic").count().collect()
        }
        to_produce = sum(per_target.values())
        result = RedriveResult(
            run_id=run_id,
            dry_run=job.dry_run,
            selected=counts["selected"],
            already_redriven=counts["already"],
            unroutable=counts["unroutable"],
            to_produce=to_produce,
            produced=0,
            per_target=per_target,
            seconds=0.0,
        )
        if job.dry_run or not to_produce:
            result.seconds = round(time.monotonic() - started, 3)
            return result
        sources = todo.select("dlq_topic", "dlq_partition").distinct().count()
        tasks = max(1, min(job.tasks, sources))
        produced = (
            todo.select(*POSITION, "key", "value", "headers", "target_topic")
            .repartition(tasks, "dlq_topic", "dlq_partition")
            .sortWithinPartitions(*POSITION)
            .mapInArrow(
                producer_task(
                    bootstrap=job.bootstrap,
                    config=job.client_config,
                    rate_per_task=job.rate / tasks if job.rate else None,
                    manifest=job.manifest,
                    run_id=run_id,
                ),
                MANIFEST_SCHEMA,
            )
        )
        result.per_target = {
            r["target_topic"]: r["count"]
            for r in produced.groupBy("target_topic").count().collect()
        }
        result.produced = sum(result.per_target.values())
        result.seconds = round(time.monotonic() - started, 3)
        return result
    finally:
        selected.unpersist()
