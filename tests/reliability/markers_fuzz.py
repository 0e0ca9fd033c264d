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
    value[0] = rng.choice([0, 2, 3, 0x7F, 0xFF])
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
}


def garbage(rng: random.Random, topic: str) -> tuple[str, bytes | None]:
    """One refused value (and its kind); ``topic`` is an existing queue topic."""
    name = rng.choice(list(GARBAGE))
    return name, GARBAGE[name](rng, topic)
