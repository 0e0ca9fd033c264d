"""Pure pieces of the pipeline: ranges, bounds, durations, decoding to Arrow, headers, charts.

No broker and no SparkSession (PySpark is imported only for its schema helpers).
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.marker_strategies import markers, range_markers

from pipeline.bulk_redrive import BURST_SECONDS
from pipeline.charts import bar_chart, hbar_chart, line_chart, nice_max
from pipeline.commands import build_parser, duration_ms, timestamp
from pipeline.marker_batches import _c_markers_batch, _py_markers_batch, markers_batch
from pipeline.offsets import Bound, OffsetRange, OffsetsError, split_ranges
from pipeline.record_batches import parse_dlq_headers
from pipeline.record_schemas import arrow_schema, spark_schema
from pipeline.report import choose_bucket
from tracker.headers import REDRIVE_RUN, REDRIVE_SOURCE, redrive_headers
from tracker.ids import MessageId
from tracker.protocol import (
    SPEEDUPS,
    Marker,
    c_marker_columns,
    decode_batch,
    encode_any,
    encode_marker,
)
from tracker.protocol_v2 import RangeMarker
from tracker.ratelimit import TokenBucket

from .workload import dlq_headers

pytestmark = [pytest.mark.unit]


@given(
    st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), max_size=6),
    st.integers(1, 60),
)
def test_slices_tile_each_range_exactly(bounds: list[tuple[int, int]], chunk: int) -> None:
    ranges = [OffsetRange("t", p, min(a, b), max(a, b)) for p, (a, b) in enumerate(bounds)]
    slices = split_ranges(ranges, chunk)
    for r in ranges:
        mine = [s for s in slices if s.partition == r.partition]
        covered = [o for s in mine for o in range(s.start, s.end)]
        assert covered == list(range(r.start, r.end)), "each offset exactly once, in order"
        assert all(0 < s.size <= chunk for s in mine)


def test_bounds_parse_every_documented_form() -> None:
    assert Bound.parse("earliest") == Bound.earliest()
    assert Bound.parse("latest") == Bound.latest()
    assert Bound.parse("42") == Bound.at_offsets(default=42)
    assert Bound.parse("0:5,3:17") == Bound.at_offsets({0: 5, 3: 17})
    assert Bound.parse("2026-01-31T12:00:00Z").time == datetime(2026, 1, 31, 12, tzinfo=UTC)
    with pytest.raises(OffsetsError, match="no time zone"):
        Bound.parse("2026-01-31T12:00:00")
    with pytest.raises(OffsetsError, match="not earliest"):
        Bound.parse("yesterday")


def test_durations_and_times_on_the_command_line() -> None:
    assert [duration_ms(t) for t in ("250ms", "30s", "5m", "2h", "1d", "90", "PT1M30S")] == [
        250,
        30_000,
        300_000,
        7_200_000,
        86_400_000,
        90_000,
        90_000,
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        duration_ms("soon")
    assert timestamp("2026-01-31T12:00:00+01:00") == datetime(2026, 1, 31, 11, tzinfo=UTC)
    assert abs(timestamp("now") - datetime.now(UTC)) < timedelta(seconds=5)
    with pytest.raises(argparse.ArgumentTypeError, match="no time zone"):
        timestamp("2026-01-31T12:00:00")
    args = build_parser().parse_args(["audit", "--ledger", "/x", "--grace", "2m"])
    assert (args.command, args.grace, args.as_of) == ("audit", 120_000, None)


def test_markers_batch_keeps_refused_values_as_rows_with_the_error() -> None:
    schema = arrow_schema(spark_schema("markers"))
    good = encode_marker(Marker.start("g", MessageId("orders", 1, 7), timeout_ms=500))
    batch = markers_batch(4, [10, 11, 12], [1000, 2000, 3000], [good, b"\x09", None], schema)
    rows = batch.to_pylist()
    assert [r["markers_offset"] for r in rows] == [10, 11, 12]
    assert [r["markers_partition"] for r in rows] == [4, 4, 4]
    assert (rows[0]["kind"], rows[0]["offset"], rows[0]["timeout_ms"]) == ("START", 7, 500)
    assert rows[0]["error"] is None
    assert rows[1]["kind"] is None
    assert rows[1]["error"] == "unsupported marker version 9"
    assert "tombstone" in rows[2]["error"]
    assert rows[2]["timestamp"] == datetime(1970, 1, 1, 0, 0, 3, tzinfo=UTC)
    assert markers_batch(0, [], [], [], schema).num_rows == 0


def test_a_range_marker_decodes_to_the_rows_of_its_v1_markers() -> None:
    """A ledger built from v2 traffic equals the one built from the same traffic in v1: a
    RANGE_START/SETTLE/EXTEND is one row per covered offset, as the v1 START/ACK/EXTEND."""
    schema = arrow_schema(spark_schema("markers"))
    ranges = [
        RangeMarker.start(
            "g", "orders", 1, 100, 104, exceptions=0b00100, timeout_ms=500, consumer="c"
        ),
        RangeMarker.extend("g", "orders", 1, 100, 101, timeout_ms=9_000),
        RangeMarker.settle("g", "orders", 1, 100, 104, exceptions=0b10100),
    ]
    singles = [
        Marker.start("g", MessageId("orders", 1, o), timeout_ms=500, consumer="c")
        for o in (100, 101, 103, 104)
    ]
    singles += [Marker.extend("g", MessageId("orders", 1, o), timeout_ms=9_000) for o in (100, 101)]
    singles += [Marker.ack("g", MessageId("orders", 1, o)) for o in (100, 101, 103)]
    v2 = markers_batch(4, [10, 11, 12], [1000, 2000, 3000], [encode_any(m) for m in ranges], schema)
    positions = [10] * 4 + [11] * 2 + [12] * 3
    stamps = [1000] * 4 + [2000] * 2 + [3000] * 3
    v1 = markers_batch(4, positions, stamps, [encode_marker(m) for m in singles], schema)
    assert v2.to_pylist() == v1.to_pylist()
    mixed = markers_batch(
        2,
        [0, 1, 2],
        [5, 6, 7],
        [encode_any(ranges[2]), b"\x02\x00", encode_marker(singles[0])],
        schema,
    ).to_pylist()
    assert [r["markers_offset"] for r in mixed] == [0, 0, 0, 1, 2]
    assert mixed[3]["kind"] is None
    assert "too short" in mixed[3]["error"]


@pytest.mark.skipif(not SPEEDUPS, reason="the C decoder is not built (KMQ_PURE_PYTHON)")
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            markers(),
            range_markers(),
            st.binary(max_size=30),  # mostly refused
            st.none(),  # a tombstone
        ),
        max_size=12,
    ),
    st.one_of(st.integers(0, 2**31 - 1), st.just(None)),
)
def test_the_c_column_builder_makes_the_python_batch(
    items: list[Marker | RangeMarker | bytes | None], partition: int | None
) -> None:
    """The C path (``marker_columns``) and the Python lists give the same rows: v1 markers of
    every kind, range markers expanded with their exceptions, refused values and tombstones."""
    schema = arrow_schema(spark_schema("markers"))
    values = [encode_any(i) if isinstance(i, Marker | RangeMarker) else i for i in items]
    decoded = decode_batch(values)
    partitions: int | list[int] = (
        partition if partition is not None else [n % 7 for n in range(len(values))]
    )
    positions = list(range(100, 100 + len(values)))
    stamps = [1_780_000_000_000 + n for n in range(len(values))]
    assert c_marker_columns is not None
    built = _c_markers_batch(
        c_marker_columns(decoded.markers), decoded, partitions, positions, stamps, schema=schema
    )
    reference = _py_markers_batch(decoded, partitions, positions, stamps, schema=schema)
    assert built.schema == reference.schema
    assert built.to_pylist() == reference.to_pylist()


def test_dead_letter_headers_are_parsed_leniently() -> None:
    origin = MessageId("orders", 2, 9)
    parsed = parse_dlq_headers(
        dlq_headers(
            group="g",
            origin=origin,
            reason="max attempts reached",
            attempts=3,
            first_seen_ms=5,
            at_ms=7,
        )
    )
    assert parsed["error"] is None
    assert (parsed["origin_topic"], parsed["origin_partition"], parsed["origin_offset"]) == origin
    assert (parsed["attempts"], parsed["first_seen"], parsed["dead_lettered_at"]) == (3, 5, 7)
    broken = parse_dlq_headers([("kmq-dlq-attempts", b"many"), ("kmq-group", b"g")])
    assert broken["attempts"] is None
    assert broken["error"] == "no kmq-origin header"


def test_redriven_records_lose_the_dead_letter_headers_and_say_where_they_came_from() -> None:
    headers = [("trace", b"1"), ("kmq-dlq-reason", b"x"), ("kmq-redrive-run", b"old")]
    marks = [(REDRIVE_RUN, b"r1"), (REDRIVE_SOURCE, b"orders.dlq/0/5")]
    assert redrive_headers(headers, marks) == [
        ("trace", b"1"),
        (REDRIVE_RUN, b"r1"),
        (REDRIVE_SOURCE, b"orders.dlq/0/5"),
    ]


def test_charts_are_self_contained_svg() -> None:
    assert nice_max(0) == 1.0
    assert nice_max(7) == 10
    assert nice_max(180) == 200
    line = line_chart("t", ["a", "b", "c"], {"x": [1, 5, 2], "y": [0, 0, 3]})
    assert line.startswith("<svg")
    assert line.count("<polyline") == 2
    assert line_chart("t", ["a"], {"x": [4]}).count("<circle") == 1
    bars = bar_chart("b", ["1", "2"], [3.0, 1.0])
    assert bars.count("<rect") == 2
    long_reason = "r" * 80
    hbars = hbar_chart("h", [long_reason, "<b>"], [2.0, 1.0])
    assert "&lt;b&gt;" in hbars
    assert "…" in hbars
    assert choose_bucket(0) == 1
    assert choose_bucket(3600) == 60
    assert choose_bucket(10**9) == 7 * 86400


def test_redrive_token_bucket_paces_each_task() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    def task_bucket(rate: float) -> TokenBucket:  # as each redrive task builds its own
        burst = max(1.0, rate * BURST_SECONDS)
        return TokenBucket(rate, burst, clock=lambda: now[0], blocking_sleep=sleep)

    bucket = task_bucket(10.0)  # 10 records/s, bursts of at most 1
    granted = [bucket.take_blocking(5) for _ in range(21)]
    assert granted == [1] * 21
    assert now[0] == pytest.approx(2.0), "21 records at 10/s: the first at once, then 0.1 s each"
    fast = task_bucket(1000.0)
    assert fast.take_blocking(500) == 1, "a task starts with one token"
    now[0] += 1
    assert fast.take_blocking(500) == 100, "bursts are capped at a tenth of a second of the rate"
