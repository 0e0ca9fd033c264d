"""Decoding the DataFrame of Spark's own ``kafka`` connector (or of raw records kept anywhere).

The built-in reader (:mod:`pipeline.source`) builds its batches on the executors directly;
with the connector the records arrive as a DataFrame instead. :func:`decode_markers_frame`
decodes them in the JVM where the session has the decoder's jar (:mod:`pipeline.jvm_jar`,
the same rules and error texts as the C decoder), else with the same batch builders as the
built-in reader in ``mapInArrow``; :func:`decode_dlq_frame` always does the latter. A marker
decodes the same whatever read it. Apart because only this path needs the Spark DataFrame API
and the conversion back from Arrow columns to Python lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pipeline.arrow_columns import epoch_millis
from pipeline.jvm_jar import FUNCTION, register_decoder
from pipeline.marker_batches import markers_batch
from pipeline.record_batches import dlq_batch
from pipeline.record_schemas import arrow_schema, spark_schema

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import DataFrame


def _header_tuples(column: pa.Array) -> list[list[tuple[str, bytes | None]]]:
    return [[(e["key"], e["value"]) for e in row or ()] for row in column.to_pylist()]


def _markers_mapper(
    schema: pa.Schema,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def decode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            if batch.num_rows:
                yield markers_batch(
                    batch.column("partition").to_pylist(),
                    batch.column("offset").to_pylist(),
                    epoch_millis(batch.column("timestamp")),
                    batch.column("value").to_pylist(),
                    schema,
                )

    return decode


def _dlq_mapper(
    schema: pa.Schema,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def decode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            if batch.num_rows:
                has_headers = "headers" in batch.schema.names
                yield dlq_batch(
                    topics=batch.column("topic").to_pylist(),
                    partitions=batch.column("partition").to_pylist(),
                    offsets=batch.column("offset").to_pylist(),
                    timestamps_ms=epoch_millis(batch.column("timestamp")),
                    keys=batch.column("key").to_pylist(),
                    values=batch.column("value").to_pylist(),
                    headers=_header_tuples(batch.column("headers"))
                    if has_headers
                    else [[] for _ in range(batch.num_rows)],
                    schema=schema,
                )

    return decode


def decode_markers_frame(raw: DataFrame, *, decoder: str = "auto") -> DataFrame:
    """Decode a DataFrame shaped like Spark's ``kafka`` source into the markers schema.

    ``raw`` needs ``partition``, ``offset``, ``timestamp`` and ``value`` (extra columns are
    ignored). ``decoder``: ``"jvm"`` decodes in the JVM (:mod:`pipeline.jvm_jar`: the
    records never leave it), ``"python"`` on the executors' Python workers, in Arrow batches,
    with ``decode_batch``; ``"auto"`` (default) the JVM where the session has its jar. Both
    give the same rows.
    """
    if decoder not in {"auto", "jvm", "python"}:
        raise ValueError(f"unknown decoder {decoder!r}: expected 'auto', 'jvm' or 'python'")
    if decoder != "python":
        from pyspark.sql import functions as F  # noqa: PLC0415 - pyspark is optional

        if register_decoder(raw.sparkSession):
            return raw.select(
                F.col("partition").alias("markers_partition"),
                F.col("offset").alias("markers_offset"),
                "timestamp",
                F.inline(F.call_function(FUNCTION, F.col("value"))),
            )
        if decoder == "jvm":
            raise RuntimeError(
                "the JVM marker decoder is not on this session's classpath "
                "(see python -m pipeline.jvm_jar)"
            )
    schema = spark_schema("markers")
    mapper = _markers_mapper(arrow_schema(schema))
    return raw.select("partition", "offset", "timestamp", "value").mapInArrow(mapper, schema)


def decode_dlq_frame(raw: DataFrame) -> DataFrame:
    """Decode a DataFrame shaped like Spark's ``kafka`` source (``includeHeaders=true``) into
    the dead-letter schema."""
    schema = spark_schema("dlq")
    mapper = _dlq_mapper(arrow_schema(schema))
    columns = ["topic", "partition", "offset", "timestamp", "key", "value"]
    if "headers" in raw.columns:
        columns.append("headers")
    return raw.select(*columns).mapInArrow(mapper, schema)
