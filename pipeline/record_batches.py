"""Dead-letter and raw Kafka records as Arrow batches of the ``dlq`` and ``raw`` formats.

Unlike markers, these records are kept whole (key, value, headers); the only decoding is of
the kmq identity and dead-letter headers, done leniently because a dead-letter topic may hold
records the tracker did not write. Apart from :mod:`pipeline.marker_batches` because nothing
here touches the marker protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.arrow_columns import record_batch, timestamp_column
from tracker import headers as h
from tracker.errors import InvalidHeader
from tracker.headers import Headers
from tracker.ids import MessageId

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]


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

    return record_batch(
        {
            "dlq_topic": topics,
            "dlq_partition": partitions,
            "dlq_offset": offsets,
            "timestamp": timestamp_column(timestamps_ms),
            "key": keys,
            "value": values,
            "headers": [_header_rows(hs) for hs in headers],
            "group": column("group"),
            "origin_topic": column("origin_topic"),
            "origin_partition": column("origin_partition"),
            "origin_offset": column("origin_offset"),
            "reason": column("reason"),
            "attempts": column("attempts"),
            "first_seen": timestamp_column(column("first_seen")),
            "dead_lettered_at": timestamp_column(column("dead_lettered_at")),
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
    return record_batch(
        {
            "key": keys,
            "value": values,
            "topic": topics,
            "partition": partitions,
            "offset": offsets,
            "timestamp": timestamp_column(timestamps_ms),
            "timestampType": timestamp_types,
            "headers": [_header_rows(hs) for hs in headers],
        },
        schema,
    )
