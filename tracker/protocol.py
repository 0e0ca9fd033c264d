"""The marker protocol: the one entry point that encodes and decodes markers of both versions.

Version 1 (one record per message and event: ``tracker.protocol_v1``, decoded in Python by
``tracker.protocol_v1_decode``) and version 2 (offset ranges: ``tracker.protocol_v2``) share
one markers topic; the version byte says which a record is. Decoding goes through the C
decoder (``tracker/_speedups.c``) when it is built, the Python reference otherwise; both refuse
exactly the same records with the same reasons (``tests/unit/test_protocol*.py``).
``docs/protocol.md`` is the normative, byte-for-byte specification.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from tracker.c_extension import load_c_extension
from tracker.errors import MarkerError
from tracker.protocol_limits import (
    MAX_ATTEMPT,
    MAX_CONSUMER_LENGTH,
    MAX_DELAY_MS,
    MAX_GROUP_LENGTH,
    MAX_OFFSET,
    MAX_PARTITION,
    MAX_REASON_LENGTH,
    MAX_TIMEOUT_MS,
)
from tracker.protocol_v1 import KINDS_BY_BYTE, Marker, MarkerKind, encode_marker
from tracker.protocol_v1_decode import py_decode_marker
from tracker.protocol_v2 import RangeKind, RangeMarker, encode_range_marker, py_decode_range_marker

__all__ = [
    "MAX_ATTEMPT",
    "MAX_CONSUMER_LENGTH",
    "MAX_DELAY_MS",
    "MAX_GROUP_LENGTH",
    "MAX_OFFSET",
    "MAX_PARTITION",
    "MAX_REASON_LENGTH",
    "MAX_TIMEOUT_MS",
    "AnyMarker",
    "DecodedBatch",
    "Marker",
    "MarkerKind",
    "RangeMarker",
    "decode_batch",
    "decode_marker",
    "encode_any",
    "encode_marker",
    "expand_range",
    "py_decode_marker",
]


def encode_any(marker: Marker | RangeMarker) -> bytes:
    """Serialize a marker of either version (v1 :class:`Marker`, v2 :class:`RangeMarker`)."""
    if isinstance(marker, RangeMarker):
        return encode_range_marker(marker)
    return encode_marker(marker)


#: A decoded marker of either version.
AnyMarker = Marker | RangeMarker


_new_marker = tuple.__new__
_RANGE_AS_KIND = {1: MarkerKind.START, 2: MarkerKind.ACK, 4: MarkerKind.EXTEND}


def expand_range(marker: RangeMarker) -> list[Marker]:
    """The v1 markers a range marker stands for, one per covered offset, in offset order.

    docs/protocol.md ("Version 2", semantics): a RANGE_START is a START of attempt 1 with its
    lease and consumer for each covered offset, a RANGE_SETTLE an ACK, a RANGE_EXTEND an
    EXTEND. Readers that work per message (the Spark ledger) see range traffic this way.
    """
    kind = _RANGE_AS_KIND[marker.kind]
    group, topic, partition = marker.group, marker.topic, marker.partition
    timeout, consumer = marker.timeout_ms, marker.consumer
    return [
        _new_marker(
            Marker,
            (
                kind,
                group,
                topic,
                partition,
                offset,
                1,
                topic,
                partition,
                offset,
                timeout,
                0,
                False,
                consumer,
                "",
                False,
            ),
        )
        for offset in marker.offsets()
    ]


def py_decode_any(value: bytes | bytearray | memoryview | None) -> AnyMarker:
    """Parse one marker record value of either version (the version byte says which)."""
    if type(value) is bytes and value[:1] == b"\x02":
        return py_decode_range_marker(value)
    if isinstance(value, bytearray | memoryview) and bytes(value[:1]) == b"\x02":
        return py_decode_range_marker(bytes(value))
    return py_decode_marker(value)


#: RangeKind members indexed by the v2 kind byte (None: not a kind), for the C decoder.
_RANGE_KINDS = (None, RangeKind.RANGE_START, RangeKind.RANGE_SETTLE, None, RangeKind.RANGE_EXTEND)


def _c_decoder() -> Any:
    """The C decoder module, unless it was not built or ``KMQ_PURE_PYTHON`` is set."""
    speedups = load_c_extension()
    if speedups is not None:
        speedups.configure(Marker, KINDS_BY_BYTE, MarkerError, RangeMarker, _RANGE_KINDS)
    return speedups


_speedups_module = _c_decoder()
_c_decode: Callable[[bytes], AnyMarker] | None = (
    None if _speedups_module is None else _speedups_module.decode
)
_c_decode_many: Callable[[list[bytes | None]], tuple[list[AnyMarker | None], list[tuple[int, str]]]]
_c_decode_many = None if _speedups_module is None else _speedups_module.decode_many  # type: ignore[assignment]
#: Whether the C decoder is in use.
SPEEDUPS = _c_decode is not None
#: The C column builder (``pipeline.marker_batches`` turns decoded markers into Arrow buffers
#: with it), or None without the C decoder.
c_marker_columns: Callable[[list[AnyMarker | None]], tuple[Any, ...]] | None = (
    None if _speedups_module is None else getattr(_speedups_module, "marker_columns", None)
)  # getattr: a module built before marker_columns existed still decodes
#: The C pass over a partition's fetched records (``tracker.engine.record_decoding`` wraps it),
#: or None without the C decoder.
c_sort_records: Callable[..., tuple[Any, ...]] | None = (
    None if _speedups_module is None else _speedups_module.sort_records
)


def decode_marker(value: bytes | bytearray | memoryview | None) -> AnyMarker:
    """Parse one marker record value of either version. Raises :class:`MarkerError` only."""
    if _c_decode is not None:
        if type(value) is not bytes and isinstance(value, bytearray | memoryview):
            value = bytes(value)
        return _c_decode(value)  # type: ignore[arg-type]
    return py_decode_any(value)


class DecodedBatch(NamedTuple):
    """The result of decoding many marker values, aligned with the input.

    ``markers[i]`` is the marker decoded from the i-th value (a v1 :class:`Marker` or a v2
    :class:`RangeMarker`), or ``None`` when that value was refused; ``errors`` lists
    ``(i, why)`` for each refused value, in input order (``why`` is the message
    :func:`decode_marker` would raise with).
    """

    markers: list[AnyMarker | None]
    errors: list[tuple[int, str]]


def decode_batch(values: Iterable[bytes | None]) -> DecodedBatch:
    """Decode many marker values; a malformed one is reported, never raised, never fatal."""
    if _c_decode_many is not None:
        markers, errors = _c_decode_many(values if isinstance(values, list) else list(values))
        return DecodedBatch(markers, errors)
    out: list[AnyMarker | None] = []
    refused: list[tuple[int, str]] = []
    for value in values:
        try:
            out.append(py_decode_any(value))
        except MarkerError as exc:
            refused.append((len(out), str(exc)))
            out.append(None)
    return DecodedBatch(out, refused)
