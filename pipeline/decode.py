"""Turning Kafka records into typed Arrow batches: markers, dead letters, raw records.

Both ways of reading Kafka end here, so a marker decodes the same whatever read it:

* the Python data source (:mod:`pipeline.source`) calls :func:`markers_batch`,
  :func:`dlq_batch` or :func:`raw_batch` on the records its executor-side Kafka client fetched;
* with Spark's own ``kafka`` connector, :func:`decode_markers_frame` and
  :func:`decode_dlq_frame` run the same functions in ``mapInArrow`` over its DataFrame.

Markers are decoded by the project's own :func:`tracker.protocol.decode_batch` (the C decoder
where it is built), never re-implemented here. A value the protocol refuses is *kept* as a row
with its position, its timestamp and the :class:`~tracker.errors.MarkerError` text in
``error``: the ledger skips such rows, but an operator can still find every bad record.

This is the per-record hot path of every job, so markers become columns without a Python
object per row: the C decoder's ``marker_columns`` writes Arrow buffers for a whole batch
(range markers expanded there, one row per covered offset), and Arrow's own kernels lay the
record positions and timestamps alongside. Without the C decoder the same columns are built
from Python lists (``zip(*markers)`` transposes the decoded named tuples).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tracker import headers as h
from tracker.errors import InvalidHeader
from tracker.ids import MessageId
from tracker.protocol import (
    DecodedBatch,
    MarkerKind,
    RangeMarker,
    c_marker_columns,
    decode_batch,
    expand_range,
)

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

#: The kinds as the ``kind`` column spells them.
KIND_NAMES: dict[Any, str] = {kind: kind.name for kind in MarkerKind}

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
#: raw output feeds :func:`decode_markers_frame` / :func:`decode_dlq_frame` unchanged.
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


def _timestamps(millis: Sequence[int | None]) -> pa.Array:
    import pyarrow as pa  # noqa: PLC0415

    return pa.array(millis, pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC"))


def _batch(columns: dict[str, Any], schema: pa.Schema) -> pa.RecordBatch:
    import pyarrow as pa  # noqa: PLC0415

    arrays = []
    for field in schema:
        value = columns[field.name]
        if isinstance(value, pa.Array):
            arrays.append(value.cast(field.type) if value.type != field.type else value)
        else:
            arrays.append(pa.array(value, type=field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_NO_MARKER = (None,) * 15  # the width of tracker.protocol.Marker


def _expand_ranges(
    markers: list[Any],
    partitions: Sequence[int],
    offsets: Sequence[int],
    timestamps_ms: Sequence[int],
    errors: list[str | None],
) -> tuple[list[Any], list[int], list[int], list[int], list[str | None]]:
    """The decoded markers with each range marker replaced by its per-offset v1 markers."""
    out: tuple[list[Any], list[int], list[int], list[int], list[str | None]] = (
        [],
        [],
        [],
        [],
        [],
    )
    rows, parts, offs, stamps, errs = out
    for i, marker in enumerate(markers):
        if type(marker) is RangeMarker:
            singles = expand_range(marker)
            n = len(singles)
            rows += singles
            parts += [partitions[i]] * n
            offs += [offsets[i]] * n
            stamps += [timestamps_ms[i]] * n
            errs += [None] * n
        else:
            rows.append(marker)
            parts.append(partitions[i])
            offs.append(offsets[i])
            stamps.append(timestamps_ms[i])
            errs.append(errors[i])
    return out


def markers_batch(
    partitions: int | Sequence[int],
    offsets: Sequence[int],
    timestamps_ms: Sequence[int],
    values: Sequence[bytes | None],
    schema: pa.Schema,
) -> pa.RecordBatch:
    """Decode marker values with their positions into a batch of ``schema`` (MARKERS_DDL).

    A range marker is one row per covered offset, as the v1 markers it stands for (same
    record position and timestamp): the ledger cannot tell the versions apart.
    """
    decoded = decode_batch(values)
    if c_marker_columns is not None:
        columns = c_marker_columns(decoded.markers)
        return _c_markers_batch(columns, decoded, partitions, offsets, timestamps_ms, schema=schema)
    return _py_markers_batch(decoded, partitions, offsets, timestamps_ms, schema=schema)


@functools.cache
def _kind_names() -> pa.Array:
    """The ``kind`` column's values indexed by kind code (built once, taken per batch)."""
    import pyarrow as pa  # noqa: PLC0415

    names: list[str | None] = [None] * (max(MarkerKind) + 1)
    for kind in MarkerKind:
        names[kind] = kind.name
    return pa.array(names, pa.string())


def _c_markers_batch(
    columns: tuple[Any, ...],
    decoded: DecodedBatch,
    partitions: int | Sequence[int],
    offsets: Sequence[int],
    timestamps_ms: Sequence[int],
    *,
    schema: pa.Schema,
) -> pa.RecordBatch:
    """The batch from the buffers of ``marker_columns`` (see tracker/_speedups.c)."""
    import pyarrow as pa  # noqa: PLC0415

    (rows, index, valid, kind, *fixed_and_text) = columns
    fixed, text = fixed_and_text[:9], fixed_and_text[9:]
    validity = pa.py_buffer(valid)
    fixed_types = (
        pa.int32(),  # partition
        pa.int64(),  # offset
        pa.int32(),  # attempt
        pa.int32(),  # origin_partition
        pa.int64(),  # origin_offset
        pa.int64(),  # timeout_ms
        pa.int64(),  # delay_ms
        pa.uint8(),  # policy_delay
        pa.uint8(),  # deferred
    )
    ints = [
        pa.Array.from_buffers(t, rows, [validity, pa.py_buffer(b)])
        for t, b in zip(fixed_types, fixed, strict=True)
    ]
    texts = [
        pa.Array.from_buffers(
            pa.string(), rows, [validity, pa.py_buffer(text[i]), pa.py_buffer(text[i + 1])]
        )
        for i in range(0, len(text), 2)
    ]
    kinds = _kind_names().take(
        pa.Array.from_buffers(pa.int8(), rows, [validity, pa.py_buffer(kind)])
    )
    size = len(decoded.markers)
    positions = (
        pa.repeat(pa.scalar(partitions, pa.int32()), size)
        if isinstance(partitions, int)
        else pa.array(partitions, pa.int32())
    )
    record_offsets = pa.array(offsets, pa.int64())
    stamps = _timestamps(timestamps_ms)
    errors = None
    if decoded.errors:
        why: list[str | None] = [None] * size
        for i, text_ in decoded.errors:
            why[i] = text_
        errors = pa.array(why, pa.string())
    if rows != size:  # some range markers stood for several rows each
        taken = pa.Array.from_buffers(pa.int32(), rows, [None, pa.py_buffer(index)])
        positions, record_offsets, stamps = (
            positions.take(taken),
            record_offsets.take(taken),
            stamps.take(taken),
        )
        if errors is not None:
            errors = errors.take(taken)
    (
        partition,
        offset,
        attempt,
        origin_partition,
        origin_offset,
        timeout,
        delay,
        policy,
        deferred,
    ) = ints
    group, topic, origin_topic, consumer, reason = texts
    return _batch(
        {
            "markers_partition": positions,
            "markers_offset": record_offsets,
            "timestamp": stamps,
            "kind": kinds,
            "group": group,
            "topic": topic,
            "partition": partition,
            "offset": offset,
            "attempt": attempt,
            "origin_topic": origin_topic,
            "origin_partition": origin_partition,
            "origin_offset": origin_offset,
            "timeout_ms": timeout,
            "delay_ms": delay,
            "policy_delay": policy.cast(pa.bool_()),
            "deferred": deferred.cast(pa.bool_()),
            "consumer": consumer,
            "reason": reason,
            "error": errors if errors is not None else pa.nulls(rows, pa.string()),
        },
        schema,
    )


def _py_markers_batch(
    decoded: DecodedBatch,
    partitions: int | Sequence[int],
    offsets: Sequence[int],
    timestamps_ms: Sequence[int],
    *,
    schema: pa.Schema,
) -> pa.RecordBatch:
    """The same batch from Python lists (no C decoder)."""
    size = len(decoded.markers)
    markers: Iterable[Any] = decoded.markers
    errors: list[str | None] = [None] * size
    if decoded.errors:
        for index, why in decoded.errors:
            errors[index] = why
        markers = [m if m is not None else _NO_MARKER for m in decoded.markers]
    if isinstance(partitions, int):
        partitions = [partitions] * size
    if any(type(m) is RangeMarker for m in decoded.markers):
        markers, partitions, offsets, timestamps_ms, errors = _expand_ranges(
            list(markers), partitions, offsets, timestamps_ms, errors
        )
        size = len(errors)
    columns = list(zip(*markers, strict=True)) if size else [()] * 15
    (
        kinds,
        groups,
        topics,
        parts,
        offs,
        attempts,
        origin_topics,
        origin_parts,
        origin_offs,
        timeouts,
        delays,
        policy,
        consumers,
        reasons,
        deferred,
    ) = columns
    return _batch(
        {
            "markers_partition": partitions,
            "markers_offset": offsets,
            "timestamp": _timestamps(timestamps_ms),
            "kind": list(map(KIND_NAMES.get, kinds)),
            "group": groups,
            "topic": topics,
            "partition": parts,
            "offset": offs,
            "attempt": attempts,
            "origin_topic": origin_topics,
            "origin_partition": origin_parts,
            "origin_offset": origin_offs,
            "timeout_ms": timeouts,
            "delay_ms": delays,
            "policy_delay": policy,
            "deferred": deferred,
            "consumer": consumers,
            "reason": reasons,
            "error": errors,
        },
        schema,
    )


Headers = Sequence[tuple[str, bytes | None]]


def _ms_header(raw: bytes | None) -> int | None:
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


def parse_dlq_headers(headers: Headers) -> dict[str, Any]:
    """The kmq identity and dead-letter headers of one DLQ record, parsed leniently.

    A dead-letter topic can hold records the tracker did not write (a producer of its own):
    instead of failing the job, a record without a readable ``kmq-origin`` / ``kmq-group`` gets
    ``error`` set and null identity, and bad numbers become nulls.
    """
    found: dict[str, bytes | None] = {}
    for name, value in headers:
        if name.startswith(h.RESERVED_PREFIX):
            found[name] = value  # the last one wins, as for KmqHeaders.parse
    out: dict[str, Any] = {
        "group": None,
        "origin_topic": None,
        "origin_partition": None,
        "origin_offset": None,
        "error": None,
    }
    problems: list[str] = []
    origin_raw = found.get(h.ORIGIN)
    if origin_raw is None:
        problems.append(f"no {h.ORIGIN} header")
    else:
        try:
            origin = MessageId.parse(origin_raw.decode("ascii"))
        except (UnicodeDecodeError, InvalidHeader) as exc:
            problems.append(f"bad {h.ORIGIN} header: {exc}")
        else:
            out["origin_topic"], out["origin_partition"], out["origin_offset"] = origin
    group_raw = found.get(h.GROUP)
    if group_raw is None:
        problems.append(f"no {h.GROUP} header")
    else:
        out["group"] = group_raw.decode("utf-8", "replace")
    attempts = _ms_header(found.get(h.DLQ_ATTEMPTS))
    out["attempts"] = attempts if attempts is not None and attempts <= 0x7FFFFFFF else None
    out["first_seen"] = _ms_header(found.get(h.DLQ_FIRST_SEEN))
    out["dead_lettered_at"] = _ms_header(found.get(h.DLQ_AT))
    for column, name in (
        ("reason", h.DLQ_REASON),
        ("last_error", h.DLQ_LAST_ERROR),
        ("source", h.DLQ_SOURCE),
    ):
        raw = found.get(name)
        out[column] = raw.decode("utf-8", "replace") if raw is not None else None
    if problems:
        out["error"] = "; ".join(problems)
    return out


def _header_rows(headers: Headers) -> list[dict[str, Any]]:
    return [{"key": k, "value": v} for k, v in headers]


def dlq_batch(
    *,
    topics: Sequence[str],
    partitions: Sequence[int],
    offsets: Sequence[int],
    timestamps_ms: Sequence[int],
    keys: Sequence[bytes | None],
    values: Sequence[bytes | None],
    headers: Sequence[Headers],
    schema: pa.Schema,
) -> pa.RecordBatch:
    """Dead-letter records with their headers parsed into a batch of ``schema`` (DLQ_DDL)."""
    parsed = [parse_dlq_headers(hs) for hs in headers]

    def column(name: str) -> list[Any]:
        return [p[name] for p in parsed]

    return _batch(
        {
            "dlq_topic": topics,
            "dlq_partition": partitions,
            "dlq_offset": offsets,
            "timestamp": _timestamps(timestamps_ms),
            "key": keys,
            "value": values,
            "headers": [_header_rows(hs) for hs in headers],
            "group": column("group"),
            "origin_topic": column("origin_topic"),
            "origin_partition": column("origin_partition"),
            "origin_offset": column("origin_offset"),
            "reason": column("reason"),
            "attempts": column("attempts"),
            "first_seen": _timestamps(column("first_seen")),
            "dead_lettered_at": _timestamps(column("dead_lettered_at")),
            "last_error": column("last_error"),
            "source": column("source"),
            "error": column("error"),
        },
        schema,
    )


def raw_batch(
    *,
    topics: Sequence[str],
    partitions: Sequence[int],
    offsets: Sequence[int],
    timestamps_ms: Sequence[int],
    timestamp_types: Sequence[int],
    keys: Sequence[bytes | None],
    values: Sequence[bytes | None],
    headers: Sequence[Headers],
    schema: pa.Schema,
) -> pa.RecordBatch:
    """Records as Spark's ``kafka`` source would return them (RAW_DDL)."""
    return _batch(
        {
            "key": keys,
            "value": values,
            "topic": topics,
            "partition": partitions,
            "offset": offsets,
            "timestamp": _timestamps(timestamps_ms),
            "timestampType": timestamp_types,
            "headers": [_header_rows(hs) for hs in headers],
        },
        schema,
    )


# --------------------------------------------------------------------------------------------
# Spark's own kafka connector: decode its DataFrame with the same functions (mapInArrow).


def _millis(column: pa.Array) -> list[int]:
    """Epoch milliseconds of an Arrow timestamp column (any unit)."""
    import pyarrow as pa  # noqa: PLC0415

    as_ms = column.cast(pa.timestamp("ms", tz="UTC")) if column.type.unit != "ms" else column
    millis: list[int] = as_ms.cast(pa.int64()).to_pylist()
    return millis


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
                    _millis(batch.column("timestamp")),
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
                    timestamps_ms=_millis(batch.column("timestamp")),
                    keys=batch.column("key").to_pylist(),
                    values=batch.column("value").to_pylist(),
                    headers=_header_tuples(batch.column("headers"))
                    if has_headers
                    else [[] for _ in range(batch.num_rows)],
                    schema=schema,
                )

    return decode


def decode_markers_frame(raw: DataFrame) -> DataFrame:
    """Decode a DataFrame shaped like Spark's ``kafka`` source into the markers schema.

    ``raw`` needs ``partition``, ``offset``, ``timestamp`` and ``value`` (extra columns are
    ignored); the decoding runs on the executors, in Arrow batches, with ``decode_batch``.
    """
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
