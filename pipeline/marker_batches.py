"""Decoded markers as Arrow batches of the ``markers`` format: the per-record hot path of every job.

Markers are decoded by the project's own :func:`tracker.protocol.decode_batch` (the C decoder
where it is built), never re-implemented here. A value the protocol refuses is *kept* as a row
with its position, its timestamp and the :class:`~tracker.errors.MarkerError` text in
``error``: the ledger skips such rows, but an operator can still find every bad record.

Markers become columns without a Python object per row: the C decoder's ``marker_columns``
writes Arrow buffers for a whole batch (range markers expanded there, one row per covered
offset), and Arrow's own kernels lay the record positions and timestamps alongside. Without
the C decoder the same columns are built from Python lists (``zip(*markers)`` transposes the
decoded named tuples). Both paths live here, apart from the dead-letter and raw batches,
because they must agree column for column and are tested against each other.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.arrow_columns import record_batch, timestamp_column
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

#: The kinds as the ``kind`` column spells them.
KIND_NAMES: dict[Any, str] = {kind: kind.name for kind in MarkerKind}

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
    stamps = timestamp_column(timestamps_ms)
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
    return record_batch(
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
    return record_batch(
        {
            "markers_partition": partitions,
            "markers_offset": offsets,
            "timestamp": timestamp_column(timestamps_ms),
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
