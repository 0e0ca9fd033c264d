"""The range marker wire format (protocol v2): round trips, refusals, documented vectors.

Every check runs against both decoders: the Python reference (``py_decode_any``) and the one
the tracker uses (``decode_marker``: the C decoder when built).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.marker_strategies import range_markers
from support.protocol_vectors import documented_vectors, refusals, with_nul_for_x

from tracker.errors import MarkerError
from tracker.ids import MessageId
from tracker.protocol import (
    AnyMarker,
    Marker,
    decode_batch,
    decode_marker,
    encode_any,
    encode_marker,
    py_decode_any,
)
from tracker.protocol_v2 import (
    FLAG_EXCEPTIONS_BITMAP,
    FLAG_EXCEPTIONS_RUNS,
    MAX_RANGE_WIDTH,
    RangeMarker,
    bits_from_runs,
    encode_range_marker,
    runs_from_bits,
)

pytestmark = pytest.mark.unit

Decoder = Callable[[Any], AnyMarker]
DECODERS = pytest.mark.parametrize("decode", [decode_marker, py_decode_any], ids=["used", "python"])


def _outcome(decode: Decoder, value: bytes) -> AnyMarker | str:
    try:
        return decode(value)
    except MarkerError as exc:
        return f"refused: {exc}"


@given(range_markers())
@settings(max_examples=300)
def test_every_range_marker_round_trips_through_both_decoders(marker: RangeMarker) -> None:
    data = encode_range_marker(marker)
    assert decode_marker(data) == marker
    assert py_decode_any(data) == marker


@given(range_markers(), st.data())
@settings(max_examples=300)
def test_both_decoders_agree_on_corrupted_and_truncated_values(
    marker: RangeMarker, data: st.DataObject
) -> None:
    value = bytearray(encode_range_marker(marker))
    for _ in range(data.draw(st.integers(0, 3))):
        value[data.draw(st.integers(0, len(value) - 1))] = data.draw(st.integers(0, 255))
    value = value[: data.draw(st.integers(0, len(value)))]
    assert _outcome(decode_marker, bytes(value)) == _outcome(py_decode_any, bytes(value))


@pytest.mark.parametrize(
    ("topic", "refusal"),
    [
        (b"\x00\x80", "is not a legal Kafka topic name"),  # an illegal ASCII byte comes first
        (b"a\x80", "topic name is not ASCII"),
        (b"a\x80\x00", "topic name is not ASCII"),
    ],
)
def test_both_decoders_word_a_bad_topic_the_same(topic: bytes, refusal: str) -> None:
    """Found by the test above: the first byte that is not legal decides the wording."""
    value = encode_range_marker(RangeMarker.settle("g", "ab", 0, 0, 0))
    value = value.replace(b"\x00\x02ab", len(topic).to_bytes(2, "big") + topic)
    used, python = _outcome(decode_marker, value), _outcome(py_decode_any, value)
    assert used == python
    assert isinstance(used, str)
    assert refusal in used


@given(range_markers(), st.data())
@settings(max_examples=200)
def test_every_truncation_is_refused(marker: RangeMarker, data: st.DataObject) -> None:
    value = encode_range_marker(marker)
    cut = data.draw(st.integers(0, len(value) - 1))
    for decode in (decode_marker, py_decode_any):
        with pytest.raises(MarkerError):
            decode(value[:cut])
        with pytest.raises(MarkerError, match="trailing"):
            decode(value + b"\x00")


@given(st.integers(1, 2**200))
def test_runs_and_bits_are_two_views_of_one_set(bits: int) -> None:
    assert bits_from_runs(runs_from_bits(bits)) == bits


def test_the_encoder_picks_the_smaller_exceptions_encoding() -> None:
    few = RangeMarker.settle("g", "t", 0, 0, 9_999, exceptions=(1 << 5) | (1 << 900))
    many = RangeMarker.settle("g", "t", 0, 0, 99, exceptions=int("10" * 50, 2))
    assert encode_range_marker(few)[2] == FLAG_EXCEPTIONS_RUNS
    assert encode_range_marker(many)[2] == FLAG_EXCEPTIONS_BITMAP
    assert len(encode_range_marker(few)) < 60


HEAD = struct.Struct(">BBBiqqH")


def raw(
    *,
    version: int = 2,
    kind: int = 2,
    flags: int = 0,
    partition: int = 0,
    first: int = 0,
    last: int = 9,
    tail: bytes = b"",
) -> bytes:
    return HEAD.pack(version, kind, flags, partition, first, last, 6) + b"orders\x00\x01g" + tail


BAD = {
    "reversed": (raw(first=10, last=9), "before first offset"),
    "absurd width": (raw(last=MAX_RANGE_WIDTH), "wider than"),
    "huge width": (raw(last=2**63 - 1), "wider than"),
    "negative": (raw(partition=-1), "must not be negative"),
    "unknown kind 3": (raw(kind=3), "unknown range marker kind 3"),
    "unknown kind 0": (raw(kind=0), "unknown range marker kind 0"),
    "unknown flags": (raw(flags=4), "unknown flag bits"),
    "both encodings": (raw(flags=3), "both a bitmap and runs"),
    "bitmap length": (raw(flags=1, tail=struct.pack(">I", 3) + b"\x01\x00\x00"), "must be 2"),
    "bitmap beyond the range": (
        raw(flags=1, tail=struct.pack(">I", 2) + b"\x00\x04"),
        "beyond the range",
    ),
    "empty bitmap": (raw(flags=1, tail=struct.pack(">I", 2) + b"\x00\x00"), "empty"),
    "run past the range": (raw(flags=2, tail=struct.pack(">HII", 1, 8, 3)), "beyond the range"),
    "runs touching": (raw(flags=2, tail=struct.pack(">HIIII", 2, 0, 2, 2, 1)), "overlap"),
    "runs out of order": (raw(flags=2, tail=struct.pack(">HIIII", 2, 5, 1, 1, 1)), "overlap"),
    "zero-length run": (raw(flags=2, tail=struct.pack(">HII", 1, 3, 0)), "length 0"),
    "no runs": (raw(flags=2, tail=struct.pack(">H", 0)), "empty"),
    "covers nothing": (raw(flags=2, tail=struct.pack(">HII", 1, 0, 10)), "covers no offset"),
    "extend by 0": (raw(kind=4, tail=struct.pack(">I", 0)), "positive timeout"),
    "unknown version": (b"\x07" + raw()[1:], "unsupported marker version 7"),
    "truncated head": (raw()[:20], "too short"),
    "truncated runs": (raw(flags=2, tail=struct.pack(">HII", 2, 0, 1)), "truncated"),
}


@DECODERS
@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_range_markers_are_refused_with_the_reason(decode: Decoder, name: str) -> None:
    value, reason = BAD[name]
    with pytest.raises(MarkerError, match=reason):
        decode(value)


@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        (RangeMarker.settle("g", "t", 0, 5, 4), "before first offset"),
        (RangeMarker.settle("g", "t", 0, 0, MAX_RANGE_WIDTH), "wider than"),
        (RangeMarker.settle("g", "t", 0, 0, 3, exceptions=0b1111), "covers no offset"),
        (RangeMarker.settle("g", "t", 0, 0, 3, exceptions=1 << 4), "beyond the range"),
        (RangeMarker.settle("g", "t", 0, 0, 3, exceptions=-1), "non-negative"),
        (RangeMarker.settle("g", "t", 0, 0, 3)._replace(consumer="c"), "consumer"),
        (RangeMarker.settle("g", "t", 0, 0, 3)._replace(timeout_ms=5), "no timeout"),
        (RangeMarker.extend("g", "t", 0, 0, 3, timeout_ms=0), "timeout_ms"),
        (RangeMarker.settle("", "t", 0, 0, 3), "group"),
        (RangeMarker.settle("g", "a/b", 0, 0, 3), "legal Kafka topic"),
        (RangeMarker.settle("g\x00", "t", 0, 0, 3), "group contains a NUL"),
        (RangeMarker.start("g", "t", 0, 0, 3, consumer="c\x00"), "consumer contains a NUL"),
    ],
)
def test_the_encoder_refuses_what_the_decoders_would(marker: RangeMarker, reason: str) -> None:
    with pytest.raises(MarkerError, match=reason):
        encode_range_marker(marker)


@pytest.mark.parametrize(
    ("marker", "field"),
    [
        (RangeMarker.settle("gXg", "t", 0, 0, 3), "group"),
        (RangeMarker.start("g", "t", 0, 0, 3, consumer="cXc"), "consumer"),
    ],
)
def test_a_nul_character_in_text_is_refused_by_both_decoders(
    marker: RangeMarker, field: str
) -> None:
    """As in version 1 (tests/unit/test_protocol.py): no PostgreSQL text holds U+0000."""
    value = with_nul_for_x(encode_range_marker(marker))
    assert refusals(value) == [f"{field} contains a NUL character (U+0000)"] * 2


def test_a_batch_mixes_versions_and_keeps_going_past_bad_records() -> None:
    v1 = encode_marker(Marker.ack("g", MessageId("orders", 0, 1)))
    v2 = encode_range_marker(RangeMarker.settle("g", "orders", 0, 0, 9, exceptions=0b10))
    values: list[bytes | None] = [v1, BAD["reversed"][0], v2, None, v2]
    result = decode_batch(values)
    assert [type(m).__name__ for m in result.markers] == [
        "Marker",
        "NoneType",
        "RangeMarker",
        "NoneType",
        "RangeMarker",
    ]
    assert [i for i, _ in result.errors] == [1, 3]
    assert "before first offset" in result.errors[0][1]


# -- documented test vectors (docs/protocol.md) ------------------------------------------------

VECTORS = {
    "v2_range_start": RangeMarker.start(
        "billing", "orders", 3, 1000, 1499, timeout_ms=30_000, consumer="worker-1"
    ),
    "v2_range_start_runs": RangeMarker.start(
        "billing",
        "orders",
        3,
        1000,
        1499,
        exceptions=(1 << 7) | (0b111 << 100),
        consumer="worker-1",
    ),
    "v2_range_settle": RangeMarker.settle("billing", "orders", 3, 1000, 1499),
    "v2_range_settle_bitmap": RangeMarker.settle(
        "billing", "orders", 3, 1000, 1015, exceptions=0b0101_0101_0000_0001
    ),
    "v2_range_extend": RangeMarker.extend(
        "billing", "orders", 3, 1000, 1499, timeout_ms=120_000, exceptions=1 << 499
    ),
}


@DECODERS
@pytest.mark.parametrize("name", sorted(VECTORS))
def test_documented_v2_vectors_match_the_code(decode: Decoder, name: str) -> None:
    documented = documented_vectors()
    assert name in documented, f"docs/protocol.md lacks test vector {name}"
    value = documented[name]
    assert encode_any(VECTORS[name]) == value
    assert decode(value) == VECTORS[name]


@given(st.binary(max_size=120))
@settings(max_examples=1000)
def test_both_decoders_agree_on_random_bytes_after_the_v2_byte(data: bytes) -> None:
    value = b"\x02" + data
    assert _outcome(decode_marker, value) == _outcome(py_decode_any, value)


@given(st.binary(min_size=1, max_size=60), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]))
@settings(max_examples=1000)
def test_both_decoders_agree_on_random_exceptions(tail: bytes, kind: int, flags: int) -> None:
    head = HEAD.pack(2, kind, flags, 0, 0, 40, 6) + b"orders\x00\x01g"
    if kind == 1:
        head += b"\x00\x00\x00\x00\x00\x00"
    elif kind == 4:
        head += b"\x00\x00\x00\x01"
    value = head + tail
    assert _outcome(decode_marker, value) == _outcome(py_decode_any, value)
