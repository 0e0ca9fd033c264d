"""The marker wire format: round trips, strictness, and the documented test vectors."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.marker_strategies import markers
from support.protocol_vectors import documented_vectors, refusals, with_nul_for_x

from tracker.errors import MarkerError
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import (
    MAX_DELAY_MS,
    MAX_TIMEOUT_MS,
    SPEEDUPS,
    AnyMarker,
    Marker,
    decode_batch,
    decode_marker,
    encode_any,
    encode_marker,
    py_decode_any,
    py_decode_marker,
)

pytestmark = pytest.mark.unit

Decoder = Callable[[Any], AnyMarker]


def _outcome(decode: Decoder, data: object) -> AnyMarker | str:
    try:
        return decode(data)
    except MarkerError:
        return "refused"


def test_the_c_decoder_is_built_where_required() -> None:
    """CI sets KMQ_REQUIRE_SPEEDUPS: there the C decoder must be in use, not silently absent."""
    if os.environ.get("KMQ_REQUIRE_SPEEDUPS") and not os.environ.get("KMQ_PURE_PYTHON"):
        assert SPEEDUPS


@given(markers(), st.data())
@settings(max_examples=500)
def test_c_and_python_decoders_agree_on_corrupted_markers(
    marker: Marker, data: st.DataObject
) -> None:
    encoded = bytearray(encode_marker(marker))
    for _ in range(data.draw(st.integers(0, 3))):
        encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(encoded)))
    value = bytes(encoded[:cut])
    assert _outcome(decode_marker, value) == _outcome(py_decode_any, value)


@given(st.binary(max_size=120))
@settings(max_examples=1000)
def test_c_and_python_decoders_agree_on_random_bytes(data: bytes) -> None:
    head = b"\x01" + data  # start with the version byte so that parsing goes deeper
    for value in (data, head):
        assert _outcome(decode_marker, value) == _outcome(py_decode_any, value)


@given(st.lists(st.one_of(markers(), st.binary(max_size=60), st.none()), max_size=20))
@settings(max_examples=300)
def test_decode_batch_in_c_agrees_with_the_python_loop(items: list[Marker | bytes | None]) -> None:
    """decode_batch's C path (no exception per refused value) reports exactly what decoding
    each value with the Python decoder would: the same markers, the same refusal messages."""
    values: list[Any] = [encode_marker(i) if isinstance(i, Marker) else i for i in items]
    values += [bytearray(v) for v in values[:2] if v is not None]  # as decode_marker accepts
    expected_markers: list[AnyMarker | None] = []
    expected_errors: list[tuple[int, str]] = []
    for i, value in enumerate(values):
        try:
            expected_markers.append(py_decode_any(value))
        except MarkerError as exc:
            expected_markers.append(None)
            expected_errors.append((i, str(exc)))
    result = decode_batch(values)
    assert (result.markers, result.errors) == (expected_markers, expected_errors)


@given(markers())
@settings(max_examples=500)
def test_every_marker_round_trips(marker: Marker) -> None:
    data = encode_marker(marker)
    for decode in (decode_marker, py_decode_marker):
        decoded = decode(data)
        assert decoded == marker
        assert decoded.kind is marker.kind
        assert type(decoded) is Marker
        assert encode_marker(decoded) == data


@given(markers(), st.data())
@settings(max_examples=300)
def test_every_truncation_is_refused(marker: Marker, data: st.DataObject) -> None:
    encoded = encode_marker(marker)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    for decode in (decode_marker, py_decode_marker):
        with pytest.raises(MarkerError):
            decode(encoded[:cut])


@given(markers(), st.binary(min_size=1, max_size=16))
def test_trailing_bytes_are_refused(marker: Marker, extra: bytes) -> None:
    with pytest.raises(MarkerError, match="trailing"):
        decode_marker(encode_marker(marker) + extra)


@given(markers(), st.integers(0, 255).filter(lambda v: v not in {1, 2}))
def test_other_versions_are_refused(marker: Marker, version: int) -> None:
    """Version 1 and 2 are the protocol's; a v1 body under the byte 2 is refused by the v2
    rules with their own reason (tests/unit/test_protocol_v2.py)."""
    encoded = bytearray(encode_marker(marker))
    encoded[0] = version
    with pytest.raises(MarkerError, match="version"):
        decode_marker(bytes(encoded))


@given(st.binary(max_size=300))
@settings(max_examples=2000)
def test_random_bytes_raise_only_marker_error(data: bytes) -> None:
    """Random input either is a valid marker (which then re-encodes to itself) or is refused."""
    try:
        marker = decode_marker(data)
    except MarkerError:
        return
    _assert_reencodes(marker, data)


def _assert_reencodes(marker: AnyMarker, data: bytes) -> None:
    """A v1 value is canonical (it re-encodes to itself); a v2 one at least round-trips (its
    exceptions may be in the larger of the two encodings, which the encoder never picks)."""
    if isinstance(marker, Marker):
        assert encode_marker(marker) == data
    else:
        assert decode_marker(encode_any(marker)) == marker


@given(markers(), st.data())
@settings(max_examples=500)
def test_single_byte_corruption_never_crashes(marker: Marker, data: st.DataObject) -> None:
    encoded = bytearray(encode_marker(marker))
    index = data.draw(st.integers(0, len(encoded) - 1))
    encoded[index] = data.draw(st.integers(0, 255))
    try:
        decoded = decode_marker(bytes(encoded))
    except MarkerError:
        return
    _assert_reencodes(decoded, bytes(encoded))


@pytest.mark.parametrize("value", [None, "text", 42, b"", b"\x01", bytearray(b"\x01\x02")])
@pytest.mark.parametrize("decode", [decode_marker, py_decode_marker])
def test_non_markers_raise_marker_error(value: object, decode: Decoder) -> None:
    with pytest.raises(MarkerError):
        decode(value)


def _with_head(**fields: int) -> bytes:
    base = {
        "version": 1,
        "kind": 2,
        "flags": 0,
        "attempt": 1,
        "partition": 0,
        "offset": 0,
        "topic_len": 1,
    }
    base.update(fields)
    head = struct.pack(">BBBHiqH", *base.values())
    return head + b"t" + b"\x00\x01g"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": 0}, "unknown marker kind 0"),
        ({"kind": 9}, "unknown marker kind 9"),
        ({"flags": 0x80}, "unknown flag bits"),
        ({"attempt": 0}, "attempt must be >= 1"),
        ({"partition": -1}, "must not be negative"),
        ({"offset": -5}, "must not be negative"),
        ({"topic_len": 0}, "topic length 0"),
        ({"attempt": 2}, "must name its origin"),
    ],
)
@pytest.mark.parametrize("decode", [decode_marker, py_decode_marker])
def test_bad_heads_say_what_is_wrong(fields: dict[str, int], message: str, decode: Decoder) -> None:
    with pytest.raises(MarkerError, match=re.escape(message)):
        decode(_with_head(**fields))


@pytest.mark.parametrize("decode", [decode_marker, py_decode_marker])
def test_illegal_topic_names_are_refused_both_ways(decode: Decoder) -> None:
    bad = _with_head(topic_len=1).replace(b"t\x00\x01g", b"/\x00\x01g")
    with pytest.raises(MarkerError, match="legal Kafka topic"):
        decode(bad)
    with pytest.raises(MarkerError, match="legal Kafka topic"):
        encode_marker(Marker.ack("g", MessageId("a/b", 0, 0)))
    with pytest.raises(MarkerError, match="legal Kafka topic"):
        encode_marker(Marker.ack("g", MessageId("x" * 250, 0, 0)))


_NUL_CASES = [
    (Marker.ack("gXg", MessageId("t", 0, 0)), "group"),
    (Marker.start("g", MessageId("t", 0, 0), consumer="cXc"), "consumer"),
    (Marker.reject("g", MessageId("t", 0, 0), reason="bad X byte"), "reason"),
    (Marker.delay("g", MessageId("t", 0, 1), reason="rX", origin=MessageId("t", 0, 0)), "reason"),
]


@pytest.mark.parametrize(("marker", "field"), _NUL_CASES)
def test_a_nul_character_in_text_is_refused_by_both_decoders(marker: Marker, field: str) -> None:
    """U+0000 is valid UTF-8, but no PostgreSQL text column holds it: a marker carrying one
    failed every flush it was in, stalling its partition. Both decoders refuse it (so it is
    parked like any malformed marker), worded the same."""
    value = with_nul_for_x(encode_marker(marker))
    assert refusals(value) == [f"{field} contains a NUL character (U+0000)"] * 2


@pytest.mark.parametrize(("marker", "field"), _NUL_CASES)
def test_the_encoder_refuses_a_nul_character_in_text(marker: Marker, field: str) -> None:
    with_nul = marker._replace(**{field: getattr(marker, field).replace("X", "\x00")})
    with pytest.raises(MarkerError, match=re.escape(f"{field} contains a NUL character")):
        encode_marker(with_nul)


@pytest.mark.parametrize(
    "marker",
    [
        Marker.ack("", MessageId("t", 0, 0)),
        Marker.ack("g" * 256, MessageId("t", 0, 0)),
        Marker.ack("g", MessageId("t", -1, 0)),
        Marker.ack("g", MessageId("t", 0, 2**63)),
        Marker.ack("g", MessageId("t", 0, 0), attempt=2),
        Marker.ack("g", MessageId("t", 0, 1), attempt=0, origin=MessageId("t", 0, 0)),
        Marker.extend("g", MessageId("t", 0, 0), timeout_ms=0),
        Marker.start("g", MessageId("t", 0, 0), timeout_ms=MAX_TIMEOUT_MS + 1),
        Marker.delay("g", MessageId("t", 0, 0), delay_ms=MAX_DELAY_MS + 1),
        Marker.delay("g", MessageId("t", 0, 0), delay_ms=-1),
        Marker.reject("g", MessageId("t", 0, 0), reason="x" * 4097),
        Marker.start("g", MessageId("t", 0, 0), consumer="\ud800"),
        Marker.ack("g", MessageId("t", 0, 0))._replace(policy_delay=True),
        Marker.ack("g", MessageId("t", 0, 0))._replace(deferred=True),
        Marker.delay("g", MessageId("t", 0, 0))._replace(deferred=True),
    ],
)
def test_encoder_refuses_what_the_decoder_would(marker: Marker) -> None:
    with pytest.raises(MarkerError):
        encode_marker(marker)


def test_policy_delay_is_distinct_from_zero_delay() -> None:
    m = MessageId("orders", 0, 7)
    policy = decode_marker(encode_marker(Marker.delay("g", m)))
    zero = decode_marker(encode_marker(Marker.delay("g", m, delay_ms=0)))
    assert isinstance(policy, Marker)
    assert isinstance(zero, Marker)
    assert policy.policy_delay
    assert not zero.policy_delay
    assert policy.delay_ms == zero.delay_ms == 0


def test_decode_batch_keeps_going_past_bad_records() -> None:
    good = encode_marker(Marker.ack("g", MessageId("t", 0, 1)))
    result = decode_batch([good, b"\x07garbage", None, good])
    assert [m is not None for m in result.markers] == [True, False, False, True]
    assert [index for index, _ in result.errors] == [1, 2]
    for index, why in result.errors:  # the message decode_marker raises with
        with pytest.raises(MarkerError) as raised:
            decode_marker([good, b"\x07garbage", None, good][index])
        assert why == str(raised.value)


# -- documented test vectors (docs/protocol.md) ------------------------------------------------

VECTORS = {
    "start": Marker.start(
        "billing", MessageId("orders", 3, 42), timeout_ms=30_000, consumer="worker-1"
    ),
    "ack": Marker.ack("billing", MessageId("orders", 3, 42)),
    "delay_copy": Marker.delay(
        "billing",
        MessageId("orders", 1, 900),
        attempt=2,
        origin=MessageId("orders", 3, 42),
        delay_ms=60_000,
        reason="timeout",
    ),
    "policy_delay": Marker.delay("billing", MessageId("orders", 3, 42), reason="busy"),
    "deferred": Marker.delay(
        "billing",
        MessageId("orders", 3, 42),
        delay_ms=3_600_000,
        reason="deliver-at",
        deferred=True,
    ),
    "extend": Marker.extend("billing", MessageId("orders", 3, 42), timeout_ms=120_000),
    "reject": Marker.reject("billing", MessageId("orders", 3, 42), reason="bad json"),
}


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_documented_vectors_match_the_code(name: str) -> None:
    documented = documented_vectors()
    assert name in documented, f"docs/protocol.md lacks test vector {name}"
    data = documented[name]
    assert encode_marker(VECTORS[name]) == data
    assert decode_marker(data) == VECTORS[name]


def test_documented_partitioning_vectors() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    rows = re.findall(r"^\| `([\w.-]+)` \| (\d+) \| (\d+) \| (\d+) \|$", doc, re.MULTILINE)
    assert rows, "docs/protocol.md lacks the partitioning table"
    for topic, partition, partitions, expected in rows:
        assert markers_partition(topic, int(partition), int(partitions)) == int(expected)


def test_marker_key_and_partition_depend_only_on_origin() -> None:
    origin = MessageId("orders", 3, 42)
    copy = MessageId("orders.retry", 0, 5)
    assert marker_key(origin.topic, origin.partition) == b"orders:3"
    first = Marker.start("g", origin)
    again = Marker.ack("g", copy, attempt=2, origin=origin)
    assert (first.origin_topic, first.origin_partition) == (
        again.origin_topic,
        again.origin_partition,
    )
    assert markers_partition("orders", 3, 12) == markers_partition("orders", 3, 12)
    with pytest.raises(ValueError, match="at least one partition"):
        markers_partition("orders", 3, 0)
