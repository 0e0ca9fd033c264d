"""Reading Kafka into Spark: a Python data source with a Kafka client on the executors.

Spark's own Kafka connector is a Maven artifact, which machines without Maven access cannot
fetch; so the default reader is built on Spark's Python Data Source API (``pyspark >= 4``):

* the driver fixes the offset ranges first (:mod:`pipeline.offsets`), and the reader's
  :meth:`KafkaReader.partitions` cuts them into slices of at most ``chunk`` offsets: one
  Spark partition per slice, so a topic with many partitions, or one huge partition, is read
  in parallel and no offset is in two slices;
* :meth:`KafkaReader.read` runs on an executor: a group-less aiokafka consumer is assigned the
  slice's partition, seeks to its start and reads to its end, and the records become Arrow
  batches (:mod:`pipeline.marker_batches`, :mod:`pipeline.record_batches`) that Spark takes
  without per-row conversion.

Where a cluster does have the connector (``spark-sql-kafka``), :func:`read_kafka` with
``source="spark"`` uses it for the same ranges and only the decoding runs in Python.

Formats: ``markers`` (decoded markers), ``dlq`` (dead-letter records with parsed headers) and
``raw`` (the connector's own columns).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.connector_frames import decode_dlq_frame, decode_markers_frame
from pipeline.marker_batches import markers_batch
from pipeline.offsets import (
    Bound,
    OffsetRange,
    OffsetsError,
    client_options,
    ranges_from_json,
    ranges_to_json,
    resolve_ranges,
    split_ranges,
)
from pipeline.record_batches import dlq_batch, raw_batch
from pipeline.record_schemas import arrow_schema, spark_schema

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import DataFrame, SparkSession

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

SOURCE_NAME = "kmq-kafka"
DEFAULT_CHUNK = 250_000  #: offsets per Spark partition (a slice of one Kafka partition)
DEFAULT_TIMEOUT = 60.0  #: seconds a slice may make no progress before the task fails
_FETCH_RECORDS = 10_000  #: records per fetch call, and so roughly per Arrow batch
_POLL_MS = 200
KAFKA_OPTION_PREFIX = "kafka."


class KafkaSlice(InputPartition):
    """One Spark partition: ``[start, end)`` of one Kafka partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end


def option_value(text: str) -> Any:
    """Options arrive as strings; aiokafka wants ints and bools where they are ints and bools."""
    lowered = text.strip().lower()
    if lowered in {"true", "false"}:
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        return text


def kafka_config_from_options(options: Mapping[str, str]) -> dict[str, Any]:
    """``kafka.<aiokafka keyword>`` options (e.g. ``kafka.security_protocol``) as kwargs."""
    config = {
        key[len(KAFKA_OPTION_PREFIX) :]: option_value(value)
        for key, value in options.items()
        if key.startswith(KAFKA_OPTION_PREFIX)
    }
    return client_options(config)


class KmqKafkaSource(DataSource):
    """``spark.read.format("kmq-kafka")``: Kafka ranges as markers, dead letters or raw records.

    Options: ``bootstrap`` (required); ``format`` (``markers``, ``dlq``, ``raw``); either
    ``ranges`` (JSON ``[[topic, partition, start, end], ...]``, as the driver resolved them)
    or ``topics`` (comma-separated) with ``startingOffsets`` / ``endingOffsets`` (see
    :meth:`pipeline.offsets.Bound.parse`), resolved when the query is planned; ``chunk``
    (offsets per Spark partition); ``timeout`` (seconds without progress); ``kafka.*``
    (aiokafka client settings such as ``kafka.security_protocol``).
    """

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return spark_schema(self.options.get("format", "markers"))

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafkaReader(dict(self.options), schema)


class KafkaReader(DataSourceReader):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.options = options
        self.format = options.get("format", "markers")
        self.schema = schema
        bootstrap = options.get("bootstrap")
        if not bootstrap:
            raise OffsetsError("the kmq-kafka source needs the 'bootstrap' option")
        self.bootstrap = bootstrap
        self.chunk = int(options.get("chunk", DEFAULT_CHUNK))
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
        self.config = kafka_config_from_options(options)

    def _ranges(self) -> list[OffsetRange]:
        if "ranges" in self.options:
            return ranges_from_json(self.options["ranges"])
        topics = [t.strip() for t in self.options.get("topics", "").split(",") if t.strip()]
        if not topics:
            raise OffsetsError("the kmq-kafka source needs 'ranges' or 'topics'")
        return resolve_ranges(
            self.bootstrap,
            topics,
            start=Bound.parse(self.options.get("startingOffsets", "earliest")),
            end=Bound.parse(self.options.get("endingOffsets", "latest")),
            client_config=self.config,
            within=self.timeout,
        )

    def partitions(self) -> Sequence[InputPartition]:
        return [
            KafkaSlice(r.topic, r.partition, r.start, r.end)
            for r in split_ranges(self._ranges(), self.chunk)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, KafkaSlice):
            return  # Spark plans one empty partition when there is nothing to read
        yield from read_slice(
            OffsetRange(partition.topic, partition.partition, partition.start, partition.end),
            fmt=self.format,
            bootstrap=self.bootstrap,
            schema=arrow_schema(self.schema),
            config=self.config,
            timeout=self.timeout,
        )


class SliceStalled(RuntimeError):
    """A slice made no progress for the timeout (broker gone, or records deleted under us)."""


async def fetch_slice(
    part: OffsetRange,
    *,
    bootstrap: str,
    config: Mapping[str, Any],
    stall_after: float,
    max_records: int = _FETCH_RECORDS,
) -> AsyncGenerator[list[Any], None]:
    """Yield the records of ``part`` in offset order, in lists of at most ``max_records``.

    Stops when the consumer's position reaches the end of the slice (positions also move over
    gaps: compacted records, transaction markers, retention), so every offset of the slice
    that exists is read exactly once.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition  # noqa: PLC0415

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **{"fetch_max_wait_ms": _POLL_MS, **config},
    )
    tp = TopicPartition(part.topic, part.partition)
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, part.start)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + stall_after
        position = part.start
        while position < part.end:
            batch = await consumer.getmany(tp, timeout_ms=_POLL_MS, max_records=max_records)
            records = [r for r in batch.get(tp, ()) if part.start <= r.offset < part.end]
            if records:
                yield records
            new_position = await consumer.position(tp)
            if new_position > position:
                position = new_position
                deadline = loop.time() + stall_after
            elif loop.time() > deadline:
                raise SliceStalled(
                    f"no progress reading {part.topic}/{part.partition} at offset {position} "
                    f"(slice {part.start}..{part.end}) for {stall_after:.0f} s"
                )
    finally:
        await consumer.stop()


def _to_batch(fmt: str, part: OffsetRange, records: list[Any], schema: pa.Schema) -> pa.RecordBatch:
    offsets = [r.offset for r in records]
    timestamps = [r.timestamp for r in records]
    if fmt == "markers":
        values = [r.value for r in records]
        return markers_batch(part.partition, offsets, timestamps, values, schema)
    size = len(records)
    common: dict[str, Any] = {
        "topics": [part.topic] * size,
        "partitions": [part.partition] * size,
        "offsets": offsets,
        "timestamps_ms": timestamps,
        "keys": [r.key for r in records],
        "values": [r.value for r in records],
        "headers": [list(r.headers) for r in records],
        "schema": schema,
    }
    if fmt == "dlq":
        return dlq_batch(**common)
    return raw_batch(timestamp_types=[r.timestamp_type for r in records], **common)


def read_slice(
    part: OffsetRange,
    *,
    fmt: str,
    bootstrap: str,
    schema: pa.Schema,
    config: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Iterator[pa.RecordBatch]:
    """The records of one slice as Arrow batches (runs on an executor).

    Spark pulls batches from a plain generator, so the async Kafka client runs on a private
    event loop that is advanced one fetch at a time: memory stays bounded by one fetch, and
    the consumer is closed even when Spark stops reading early (``LIMIT``).
    """
    loop = asyncio.new_event_loop()
    records = fetch_slice(part, bootstrap=bootstrap, config=config or {}, stall_after=timeout)
    try:
        while True:
            try:
                chunk = loop.run_until_complete(anext(records))
            except StopAsyncIteration:
                break
            yield _to_batch(fmt, part, chunk, schema)
    finally:
        loop.run_until_complete(records.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("kmq-kafka")`` available in this session (once: Spark warns
    when a data source is registered again)."""
    if getattr(spark, "_kmq_source_registered", False):
        return
    spark.dataSource.register(KmqKafkaSource)
    spark._kmq_source_registered = True  # type: ignore[attr-defined]


def read_kafka(
    spark: SparkSession,
    *,
    bootstrap: str,
    ranges: Sequence[OffsetRange],
    fmt: str = "markers",
    chunk: int = DEFAULT_CHUNK,
    client_config: Mapping[str, Any] | None = None,
    source: str = "python",
    spark_kafka_options: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> DataFrame:
    """A DataFrame of exactly the records in ``ranges``, in format ``fmt``.

    ``source="python"`` (default) reads with the ``kmq-kafka`` data source; ``"spark"`` uses
    Spark's ``kafka`` connector (must be on the cluster's classpath; ``spark_kafka_options``
    go to it as they are, e.g. ``kafka.security.protocol``) and decodes its rows here.
    """
    ranges = [r for r in ranges if r.size > 0]
    if not ranges:
        return spark.createDataFrame([], spark_schema(fmt))
    if source == "spark":
        return _read_with_connector(spark, bootstrap, ranges, fmt, spark_kafka_options or {})
    if source != "python":
        raise ValueError(f"unknown source {source!r}: expected 'python' or 'spark'")
    register(spark)
    reader = (
        spark.read.format(SOURCE_NAME)
        .option("bootstrap", bootstrap)
        .option("format", fmt)
        .option("ranges", ranges_to_json(ranges))
        .option("chunk", str(chunk))
        .option("timeout", str(timeout))
    )
    for key, value in (client_config or {}).items():
        reader = reader.option(f"{KAFKA_OPTION_PREFIX}{key}", str(value))
    return reader.load()


def _read_with_connector(
    spark: SparkSession,
    bootstrap: str,
    ranges: Sequence[OffsetRange],
    fmt: str,
    options: Mapping[str, str],
) -> DataFrame:
    assign: dict[str, list[int]] = {}
    starting: dict[str, dict[str, int]] = {}
    ending: dict[str, dict[str, int]] = {}
    for r in ranges:
        assign.setdefault(r.topic, []).append(r.partition)
        starting.setdefault(r.topic, {})[str(r.partition)] = r.start
        ending.setdefault(r.topic, {})[str(r.partition)] = r.end
    raw = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("assign", json.dumps(assign))
        .option("startingOffsets", json.dumps(starting))
        .option("endingOffsets", json.dumps(ending))
        .option("includeHeaders", "true")
        .options(**options)
        .load()
    )
    if fmt == "markers":
        return decode_markers_frame(raw)
    if fmt == "dlq":
        return decode_dlq_frame(raw)
    return raw
