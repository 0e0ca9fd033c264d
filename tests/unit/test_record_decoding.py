"""The one-pass decoding of a partition's fetched records: C and Python agree, and what ingest
relies on (record order, clamped reference times, each where once) holds."""

from __future__ import annotations

import os
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord
from hypothesis import given, settings
from hypothesis import strategies as st
from support.marker_strategies import markers, range_markers

from tracker.engine.record_decoding import (
    DecodedRecords,
    marker_where,
    py_sort_records,
    sort_records,
)
from tracker.ids import MessageId
from tracker.protocol import Marker, RangeMarker, encode_any
from tracker.store.port import PendingMarker

pytestmark = pytest.mark.unit

NOW_MS = 1_700_000_000_000


def record(value: Any, *, offset: int, timestamp: int) -> ConsumerRecord[Any, Any]:
    return ConsumerRecord(
        topic="kmq-markers",
        partition=3,
        offset=offset,
        timestamp=timestamp,
        timestamp_type=0,
        key=None,
        value=value,
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=0 if value is None else len(value),
        headers=(),
    )


def as_lists(decoded: DecodedRecords) -> tuple[Any, ...]:
    return (
        decoded.accepted,
        decoded.errors,
        decoded.wheres,
        decoded.samples,
        list(decoded.where_of),
    )


values = st.one_of(
    markers().map(encode_any),
    range_markers().map(encode_any),
    st.binary(max_size=40),
    st.binary(max_size=40).map(lambda b: b"\x01" + b),
    st.none(),
)
timestamps = st.one_of(st.integers(NOW_MS - 10_000, NOW_MS + 10_000), st.just(-1), st.just(NOW_MS))


def test_the_c_pass_is_in_use_where_required() -> None:
    """CI sets KMQ_REQUIRE_SPEEDUPS: there ingest must run the C pass, not the reference."""
    if os.environ.get("KMQ_REQUIRE_SPEEDUPS") and not os.environ.get("KMQ_PURE_PYTHON"):
        assert sort_records is not py_sort_records


@given(st.lists(st.tuples(values, timestamps), max_size=30), st.integers(0, 5))
@settings(max_examples=400, deadline=None)  # big range exceptions: slow to encode
def test_the_c_pass_agrees_with_the_reference(
    items: list[tuple[bytes | None, int]], repeat: int
) -> None:
    # Repeating a prefix gives batches where most markers share a where, as real ones do.
    items = items + items[:repeat]
    records = [record(v, offset=100 + i, timestamp=ts) for i, (v, ts) in enumerate(items)]
    assert as_lists(sort_records(records, 3, NOW_MS)) == as_lists(
        py_sort_records(records, 3, NOW_MS)
    )


def test_each_where_is_listed_once_with_its_first_marker() -> None:
    a = Marker.start("g", MessageId("orders", 0, 10), timeout_ms=30_000)
    b = Marker.ack("g", MessageId("orders", 0, 10))
    other = Marker.start("g", MessageId("orders", 1, 4), timeout_ms=30_000)
    ranged = RangeMarker.start("g", "orders", 0, 11, 20, timeout_ms=30_000)
    encoded = [encode_any(a), encode_any(b), encode_any(other), b"junk", encode_any(ranged)]
    records = [record(v, offset=i, timestamp=NOW_MS - 5) for i, v in enumerate(encoded)]
    for sort in (sort_records, py_sort_records):
        decoded = sort(records, 3, NOW_MS)
        assert decoded.wheres == [("orders", 0, "orders", 0), ("orders", 1, "orders", 1)]
        assert decoded.samples == [a, other]
        assert list(decoded.where_of) == [0, 0, 1, 0]
        assert [p.marker for p in decoded.accepted] == [a, b, other, ranged]
        assert decoded.record_indexes() == [0, 1, 2, 4]
        assert [i for i, _ in decoded.errors] == [3]
        assert marker_where(ranged) == decoded.wheres[0]


@pytest.mark.parametrize("timestamp", [-1, NOW_MS + 1, NOW_MS + 3_600_000])
def test_a_future_or_unknown_timestamp_counts_from_now(timestamp: int) -> None:
    """A writer whose clock runs ahead must not make the tracker redeliver early."""
    value = encode_any(Marker.start("g", MessageId("orders", 0, 1), timeout_ms=30_000))
    for sort in (sort_records, py_sort_records):
        (pending,) = sort([record(value, offset=7, timestamp=timestamp)], 2, NOW_MS).accepted
        assert pending == PendingMarker(pending.marker, NOW_MS, 2, 7)


def test_a_record_without_a_value_is_a_clear_error_not_a_crash() -> None:
    for sort in (sort_records, py_sort_records):
        with pytest.raises(AttributeError):
            sort([object()], 0, NOW_MS)
