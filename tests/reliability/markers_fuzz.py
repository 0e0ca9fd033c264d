"""Bad marker records, by kind of badness, for the markers fuzz test.

Every generator returns a value the tracker must refuse (park on the invalid-markers topic),
never one it could apply: either it breaks a rule of the wire format (docs/protocol.md,
Validation) or it names a topic/partition that does not exist. ``garbage(rng, topic)`` picks one
kind at random; the kinds cover random bytes, truncation, wrong version/kind/flags, trailing
bytes, absurd lengths and values (topic names far over 249 bytes, a length field running past
the end, negative positions, attempt 0, delays over ten years, a zero lease), invalid text,
tombstones, and well-formed markers for topics or partitions that do not exist.

Valid markers are built with ``encode_marker`` (which refuses to build an invalid one).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

from tracker.ids import MessageId
from tracker.protocol import MAX_DELAY_MS, Marker, encode_marker
from tracker.protocol_v2 import MAX_RANGE_WIDTH, RangeMarker, encode_range_marker

_HEAD = struct.Struct(">BBBHiqH")  # version, kind, flags, attempt, partition, offset, topic len
_START_TAIL = struct.Struct(">IH")  # timeout_ms, consumer length

Garbage = Callable[[random.Random, str], bytes | None]


def raw_marker(
    *,
    version: int = 1,
    kind: int = 1,
    flags: int = 0,
    attempt: int = 1,
    partition: int = 0,
    offset: int = 0,
    topic: bytes = b"orders",
    topic_len: int | None = None,
    group: bytes = b"fuzz",
    tail: bytes | None = None,
) -> bytes:
    """A marker assembled by hand, so that any field can be wrong."""
    head = _HEAD.pack(
        version,
        kind,
        flags,
        attempt,
        partition,
        offset,
        len(topic) if topic_len is None else topic_len,
    )
    if tail is None:
        tail = _START_TAIL.pack(1000, 0)
    return head + topic + struct.pack(">H", len(group)) + group + tail


def valid_start(topic: str, offset: int, *, partition: int = 0, timeout_ms: int = 60_000) -> bytes:
    return encode_marker(
        Marker.start("fuzz", MessageId(topic, partition, offset), timeout_ms=timeout_ms)
    )


def _random_bytes(rng: random.Random, topic: str) -> bytes:
    data = bytearray(rng.randbytes(rng.randint(0, 120)))
    if data and data[0] == 1:
        data[0] = 0x7F  # never even a plausible v1 head
    return bytes(data)


def _truncated(rng: random.Random, topic: str) -> bytes:
    value = valid_start(topic, rng.randrange(1_000_000))
    return value[: rng.randrange(len(value))]


def _wrong_version(rng: random.Random, topic: str) -> bytes:
    value = bytearray(valid_start(topic, rng.randrange(1_000_000)))
    value[0] = rng.choice([0, 3, 0x7F, 0xFF])  # 2 is range markers: see the v2 kinds below
    return bytes(value)


def _unknown_kind(rng: random.Random, topic: str) -> bytes:
    value = bytearray(valid_start(topic, rng.randrange(1_000_000)))
    value[1] = rng.choice([0, 6, 7, 0x80, 0xFF])
    return bytes(value)


def _unknown_flags(rng: random.Random, topic: str) -> bytes:
    value = bytearray(valid_start(topic, rng.randrange(1_000_000)))
    value[2] |= rng.choice([0x08, 0x10, 0x40, 0x80])
    return bytes(value)


def _policy_flag_on_start(rng: random.Random, topic: str) -> bytes:
    value = bytearray(valid_start(topic, rng.randrange(1_000_000)))
    value[2] |= rng.choice([0x02, 0x04])
    return bytes(value)


def _trailing_bytes(rng: random.Random, topic: str) -> bytes:
    return valid_start(topic, rng.randrange(1_000_000)) + rng.randbytes(rng.randint(1, 16))


def _huge_topic(rng: random.Random, topic: str) -> bytes:
    name = b"t" * rng.randint(250, 4000)
    return raw_marker(topic=name)


def _length_past_the_end(rng: random.Random, topic: str) -> bytes:
    return raw_marker(topic=topic.encode(), topic_len=rng.choice([200, 249, 0xFFFF]))


def _illegal_topic(rng: random.Random, topic: str) -> bytes:
    name = rng.choice([b"bad topic", b"..", b".", b"a/b", b"caf\xc3\xa9", b"x\x00y"])
    return raw_marker(topic=name)


def _empty_topic(rng: random.Random, topic: str) -> bytes:
    return raw_marker(topic=b"")


def _bad_group(rng: random.Random, topic: str) -> bytes:
    group = rng.choice([b"", b"\xff\xfe", b"\xc3", b"g" * 256])
    return raw_marker(topic=topic.encode(), group=group)


def _negative_position(rng: random.Random, topic: str) -> bytes:
    if rng.random() < 0.5:
        return raw_marker(topic=topic.encode(), partition=-rng.randint(1, 2**31))
    return raw_marker(topic=topic.encode(), offset=-rng.randint(1, 2**63))


def _attempt_zero(rng: random.Random, topic: str) -> bytes:
    return raw_marker(topic=topic.encode(), attempt=0)


def _copy_without_origin(rng: random.Random, topic: str) -> bytes:
    return raw_marker(topic=topic.encode(), attempt=rng.randint(2, 0xFFFF))


def _delay_over_ten_years(rng: random.Random, topic: str) -> bytes:
    tail = struct.pack(">QH", MAX_DELAY_MS + rng.randint(1, 2**40), 0)
    return raw_marker(topic=topic.encode(), kind=3, tail=tail)


def _delay_of_u64_max(rng: random.Random, topic: str) -> bytes:
    return raw_marker(topic=topic.encode(), kind=3, tail=struct.pack(">QH", 2**64 - 1, 0))


def _extend_by_zero(rng: random.Random, topic: str) -> bytes:
    return raw_marker(topic=topic.encode(), kind=4, tail=struct.pack(">I", 0))


def _reason_past_the_end(rng: random.Random, topic: str) -> bytes:
    return raw_marker(topic=topic.encode(), kind=5, tail=struct.pack(">H", 5000) + b"poison")


def _tombstone(rng: random.Random, topic: str) -> bytes | None:
    return None


def _unknown_topic(rng: random.Random, topic: str) -> bytes:
    # Well-formed, legal name (up to the 249-byte limit) of a topic that does not exist.
    length = rng.choice([10, 100, 249])
    name = f"nosuch-{rng.getrandbits(64):016x}"
    name = (name + "x" * length)[:length]
    return valid_start(name, rng.randrange(1_000_000))


def _unknown_partition(rng: random.Random, topic: str) -> bytes:
    return valid_start(topic, rng.randrange(1_000_000), partition=rng.randint(1000, 2**31 - 1))


# -- version 2 (range markers) ------------------------------------------------------------------

_V2_HEAD = struct.Struct(">BBBiqqH")  # version, kind, flags, partition, first, last, topic len


def raw_range(
    *,
    kind: int = 2,
    flags: int = 0,
    partition: int = 0,
    first: int = 0,
    last: int = 9,
    topic: bytes = b"orders",
    tail: bytes = b"",
) -> bytes:
    """A range marker assembled by hand (a SETTLE unless ``kind`` says otherwise)."""
    head = _V2_HEAD.pack(2, kind, flags, partition, first, last, len(topic))
    return head + topic + b"\x00\x04fuzz" + tail


def _v2_reversed(rng: random.Random, topic: str) -> bytes:
    first = rng.randrange(1, 1_000_000)
    return raw_range(topic=topic.encode(), first=first, last=first - rng.randint(1, first))


def _v2_absurd_width(rng: random.Random, topic: str) -> bytes:
    return raw_range(topic=topic.encode(), last=rng.choice([MAX_RANGE_WIDTH, 2**40, 2**63 - 1]))


def _v2_bitmap_wrong_length(rng: random.Random, topic: str) -> bytes:
    size = rng.choice([0, 1, 3, 200, 2**32 - 1])
    tail = struct.pack(">I", size) + b"\x01" * min(size, 8)
    return raw_range(topic=topic.encode(), flags=1, tail=tail)  # width 10: 2 bytes


def _v2_exceptions_beyond_range(rng: random.Random, topic: str) -> bytes:
    if rng.random() < 0.5:  # a bitmap bit past the width
        return raw_range(topic=topic.encode(), flags=1, tail=struct.pack(">I", 2) + b"\x00\x08")
    start = rng.randint(0, 9)
    return raw_range(topic=topic.encode(), flags=2, tail=struct.pack(">HII", 1, start, 11 - start))


def _v2_runs_overlapping(rng: random.Random, topic: str) -> bytes:
    runs = struct.pack(">HIIII", 2, 4, 2, rng.choice([0, 3, 5, 6]), 1)  # touch, overlap, reorder
    return raw_range(topic=topic.encode(), flags=2, tail=runs)


def _v2_covers_nothing(rng: random.Random, topic: str) -> bytes:
    if rng.random() < 0.5:
        return raw_range(topic=topic.encode(), flags=1, tail=struct.pack(">I", 2) + b"\xff\x03")
    return raw_range(topic=topic.encode(), flags=2, tail=struct.pack(">HII", 1, 0, 10))


def _v2_truncated(rng: random.Random, topic: str) -> bytes:
    value = encode_range_marker(
        RangeMarker.start(
            "fuzz", topic, 0, 5, 300, exceptions=0b1011 << 100, timeout_ms=1, consumer="c"
        )
    )
    return value[: rng.randrange(len(value))]


def _v2_unknown_kind_or_flags(rng: random.Random, topic: str) -> bytes:
    if rng.random() < 0.5:
        return raw_range(topic=topic.encode(), kind=rng.choice([0, 3, 5, 6, 0xFF]))
    return raw_range(topic=topic.encode(), flags=rng.choice([3, 4, 0x80]))


def _v2_unknown_topic(rng: random.Random, topic: str) -> bytes:
    return encode_range_marker(
        RangeMarker.settle("fuzz", f"nosuch-{rng.getrandbits(64):016x}", 0, 0, 99)
    )


#: ``name -> generator``; each value is refused by the tracker (parked).
GARBAGE: dict[str, Garbage] = {
    "random bytes": _random_bytes,
    "truncated": _truncated,
    "wrong version": _wrong_version,
    "unknown kind": _unknown_kind,
    "unknown flags": _unknown_flags,
    "delay flag on START": _policy_flag_on_start,
    "trailing bytes": _trailing_bytes,
    "topic over 249 bytes": _huge_topic,
    "length past the end": _length_past_the_end,
    "illegal topic name": _illegal_topic,
    "empty topic": _empty_topic,
    "bad group": _bad_group,
    "negative partition/offset": _negative_position,
    "attempt 0": _attempt_zero,
    "copy without origin": _copy_without_origin,
    "delay over ten years": _delay_over_ten_years,
    "delay u64 max": _delay_of_u64_max,
    "extend by 0 ms": _extend_by_zero,
    "reason past the end": _reason_past_the_end,
    "tombstone": _tombstone,
    "unknown topic": _unknown_topic,
    "unknown partition": _unknown_partition,
    "v2 reversed range": _v2_reversed,
    "v2 absurd width": _v2_absurd_width,
    "v2 bitmap of the wrong length": _v2_bitmap_wrong_length,
    "v2 exceptions beyond the range": _v2_exceptions_beyond_range,
    "v2 runs overlapping or out of order": _v2_runs_overlapping,
    "v2 exceptions covering the whole range": _v2_covers_nothing,
    "v2 truncated": _v2_truncated,
    "v2 unknown kind or flags": _v2_unknown_kind_or_flags,
    "v2 unknown topic": _v2_unknown_topic,
}


def garbage(rng: random.Random, topic: str) -> tuple[str, bytes | None]:
    """One refused value (and its kind); ``topic`` is an existing queue topic."""
    name = rng.choice(list(GARBAGE))
    return name, GARBAGE[name](rng, topic)
