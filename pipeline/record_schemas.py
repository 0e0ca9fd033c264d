"""The columns of the Kafka reader's formats (``markers``, ``dlq``, ``raw``), for Spark and Arrow.

Apart from the code that fills them because the driver needs only the shapes: the readers
build empty frames from :func:`spark_schema`, the bulk redrive turns its manifest
schema into Arrow with :func:`arrow_schema`, and neither should load the marker decoder to
do so. The DDL strings are also the one place that documents each format's columns.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql.types import StructType

#: Columns of a decoded markers DataFrame (Spark DDL). ``error`` is null for valid markers;
#: for a refused value every marker field is null and ``error`` says why.
MARKERS_DDL = (
    "markers_partition INT, markers_offset BIGINT, timestamp TIMESTAMP, kind STRING, "
    "`group` STRING, topic STRING, `partition` INT, `offset` BIGINT, attempt INT, "
    "origin_topic STRING, origin_partition INT, origin_offset BIGINT, timeout_ms BIGINT, "
    "delay_ms BIGINT, policy_delay BOOLEAN, deferred BOOLEAN, consumer STRING, reason STRING, "
    "error STRING"
)

_HEADERS_DDL = "ARRAY<STRUCT<key: STRING, value: BINARY>>"

#: Columns of a dead-letter DataFrame: the record, its headers, and the kmq-dlq headers parsed.
#: ``error`` is set when the identity headers (``kmq-origin``, ``kmq-group``) are missing or bad.
DLQ_DDL = (
    "dlq_topic STRING, dlq_partition INT, dlq_offset BIGINT, timestamp TIMESTAMP, "
    f"key BINARY, value BINARY, headers {_HEADERS_DDL}, `group` STRING, origin_topic STRING, "
    "origin_partition INT, origin_offset BIGINT, reason STRING, attempts INT, "
    "first_seen TIMESTAMP, dead_lettered_at TIMESTAMP, last_error STRING, source STRING, "
    "error STRING"
)

#: The shape of Spark's own ``kafka`` source (with ``includeHeaders``), so either reader's
#: raw output feeds :func:`pipeline.connector_frames.decode_markers_frame` /
#: :func:`pipeline.connector_frames.decode_dlq_frame` unchanged.
RAW_DDL = (
    "key BINARY, value BINARY, topic STRING, `partition` INT, `offset` BIGINT, "
    f"timestamp TIMESTAMP, timestampType INT, headers {_HEADERS_DDL}"
)

FORMATS = {"markers": MARKERS_DDL, "dlq": DLQ_DDL, "raw": RAW_DDL}


_TYPES = {
    "INT": "IntegerType",
    "BIGINT": "LongType",
    "STRING": "StringType",
    "BOOLEAN": "BooleanType",
    "TIMESTAMP": "TimestampType",
    "BINARY": "BinaryType",
}


def spark_schema(fmt: str) -> StructType:
    """The Spark schema of a reader format (``markers``, ``dlq`` or ``raw``).

    Built in Python from the DDL strings above (``StructType.fromDDL`` needs a JVM, which the
    data source's worker processes do not have).
    """
    from pyspark.sql import types as t  # noqa: PLC0415 - pyspark is optional

    try:
        ddl = FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(FORMATS)}") from None
    headers = t.ArrayType(
        t.StructType([t.StructField("key", t.StringType()), t.StructField("value", t.BinaryType())])
    )
    fields = []
    for item in ddl.replace(_HEADERS_DDL, "HEADERS").split(", "):
        name, kind = item.rsplit(" ", 1)
        data_type = headers if kind == "HEADERS" else getattr(t, _TYPES[kind])()
        fields.append(t.StructField(name.strip("`"), data_type))
    return t.StructType(fields)


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects for ``schema`` from a data source or ``mapInArrow``.

    Spark compares batches with :func:`pyspark.sql.pandas.types.to_arrow_schema` exactly
    (field types, nullability, UTC timestamps), so the same function builds ours; its keyword
    for the time zone appeared in Spark 4, hence the signature check.
    """
    from pyspark.sql.pandas.types import to_arrow_schema  # noqa: PLC0415

    if "timezone" in inspect.signature(to_arrow_schema).parameters:
        return to_arrow_schema(schema, timezone="UTC")
    return to_arrow_schema(schema)  # pragma: no cover - older signature
