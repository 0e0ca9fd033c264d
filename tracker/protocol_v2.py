"""Range markers: the marker wire format, version 2.

Version 1 (:mod:`tracker.protocol`) says one thing about one message per record, so a consumer
writes two records (START and ACK) per message and the tracker folds two markers per message.
Version 2 says it about a whole fetched batch: one record covers an *offset range* of one queue
partition, with an *exceptions* set for the offsets inside the range it does not cover. The
common case (a batch taken, every message acked) costs two records per batch, whatever its size;
per-message records remain for the messages that diverge (retry, reject, copies), and those are
written in version 1, which stays valid on the same topic (rolling upgrades, polyglot writers).

The model is Kafka share groups (KIP-932): ``ShareAcknowledge`` acknowledges ``FirstOffset`` to
``LastOffset`` with one type when uniform, and ``SharePartition`` keeps in-flight state per batch,
split per offset only where offsets diverge. ``docs/protocol.md`` ("Version 2: range markers")
is the normative, byte-for-byte specification; ``tests/unit/test_protocol_v2.py`` checks its
test vectors against both decoders.

Choices, in short (the reasons are in docs/protocol.md):

* A range marker is about *first deliveries* only: every covered offset is its own origin and
  the marker speaks for attempt 1. A redelivered copy names another origin (which may live on
  another markers partition) and an attempt, so its markers stay per message (v1).
* Exceptions travel as a bitmap or as runs, whichever is smaller, and decode to one canonical
  form: a Python ``int`` whose bit ``i`` stands for offset ``first_offset + i``.
* Strict as v1: anything out of shape raises :class:`MarkerError` and the record is parked.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from typing import NamedTuple

from tracker.errors import MarkerError
from tracker.ids import MAX_TOPIC_LENGTH, MessageId, is_valid_topic
from tracker.protocol_limits import (
    MAX_CONSUMER_LENGTH,
    MAX_GROUP_LENGTH,
    MAX_OFFSET,
    MAX_PARTITION,
    MAX_TIMEOUT_MS,
)
from tracker.protocol_text import decode_name, decode_topic

VERSION = 2

#: Flag bits (byte 2): how the exceptions are encoded; neither: the range has none.
FLAG_EXCEPTIONS_BITMAP = 0x01
FLAG_EXCEPTIONS_RUNS = 0x02

#: The widest range one marker may cover (a client splits wider batches).
MAX_RANGE_WIDTH = 65_536
#: The most runs one exceptions list may hold (more would be bigger than the bitmap anyway).
MAX_RUNS = MAX_RANGE_WIDTH // 2


class RangeKind(enum.IntEnum):
    """What a range marker says about the offsets it covers (numbered as the v1 kinds)."""

    RANGE_START = 1  #: a consumer took these messages (attempt 1), as v1 START each
    RANGE_SETTLE = 2  #: these messages are done, as v1 ACK each
    RANGE_EXTEND = 4  #: renew the lease of these messages, as v1 EXTEND each


_KINDS = {kind.value: kind for kind in RangeKind}

# version, kind, flags, partition, first offset, last offset, topic length
_HEAD = struct.Struct(">BBBiqqH")
_HEAD_SIZE = _HEAD.size  # 25
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_RUN = struct.Struct(">II")


class RangeMarker(NamedTuple):
    """One decoded range marker.

    ``exceptions``: bit ``i`` set means offset ``first_offset + i`` is *not* covered (not
    this group's, deferred, a copy tracked per message (START); not acked (SETTLE); not
    extended (EXTEND)). ``timeout_ms`` is the lease (START: ``0`` means the topic's policy;
    EXTEND: at least 1 ms), relative to the record's timestamp as in v1.
    """

    kind: RangeKind
    group: str
    topic: str
    partition: int
    first_offset: int
    last_offset: int
    exceptions: int = 0
    timeout_ms: int = 0
    consumer: str = ""

    # The fields v1 code reads to route and check a marker: a range is its own origin.

    @property
    def origin_topic(self) -> str:
        return self.topic

    @property
    def origin_partition(self) -> int:
        return self.partition

    @property
    def attempt(self) -> int:
        """Range markers speak for first deliveries only."""
        return 1

    @property
    def width(self) -> int:
        return self.last_offset - self.first_offset + 1

    @property
    def covered(self) -> int:
        """The covered offsets as bits (bit ``i``: offset ``first_offset + i``)."""
        return ((1 << self.width) - 1) & ~self.exceptions

    def offsets(self) -> Iterator[int]:
        """The covered offsets, ascending."""
        return iter_bits(self.covered, self.first_offset)

    def messages(self) -> Iterator[MessageId]:
        for offset in self.offsets():
            yield MessageId(self.topic, self.partition, offset)

    # Constructors (they do not validate; encode does).

    @classmethod
    def start(
        cls,
        group: str,
        topic: str,
        partition: int,
        first_offset: int,
        last_offset: int,
        *,
        exceptions: int = 0,
        timeout_ms: int = 0,
        consumer: str = "",
    ) -> RangeMarker:
        return cls(
            RangeKind.RANGE_START,
            group,
            topic,
            partition,
            first_offset,
            last_offset,
            exceptions,
            timeout_ms,
            consumer,
        )

    @classmethod
    def settle(
        cls,
        group: str,
        topic: str,
        partition: int,
        first_offset: int,
        last_offset: int,
        *,
        exceptions: int = 0,
    ) -> RangeMarker:
        return cls(
            RangeKind.RANGE_SETTLE, group, topic, partition, first_offset, last_offset, exceptions
        )

    @classmethod
    def extend(
        cls,
        group: str,
        topic: str,
        partition: int,
        first_offset: int,
        last_offset: int,
        *,
        timeout_ms: int,
        exceptions: int = 0,
    ) -> RangeMarker:
        return cls(
            RangeKind.RANGE_EXTEND,
            group,
            topic,
            partition,
            first_offset,
            last_offset,
            exceptions,
            timeout_ms,
        )


def iter_bits(bits: int, base: int = 0) -> Iterator[int]:
    """``base + i`` for every set bit ``i`` of ``bits``, ascending.

    A run of set bits at a time (a range is mostly one run: a batch with a few offsets
    settled or left out), each as a ``range``: no big-int operation per offset.
    """
    if bits < 0:  # infinitely many set bits: would never end
        raise ValueError(f"a bitmask cannot be negative: {bits}")
    while bits:
        zeros = (bits & -bits).bit_length() - 1
        bits >>= zeros
        base += zeros
        ones = (bits ^ (bits + 1)).bit_length() - 1
        yield from range(base, base + ones)
        bits >>= ones
        base += ones


def bits_from_runs(runs: list[tuple[int, int]]) -> int:
    """The bits of ``(start, length)`` runs."""
    bits = 0
    for start, length in runs:
        bits |= ((1 << length) - 1) << start
    return bits


def runs_from_bits(bits: int) -> list[tuple[int, int]]:
    """``bits`` as sorted, non-adjacent ``(start, length)`` runs."""
    runs: list[tuple[int, int]] = []
    while bits:
        start = (bits & -bits).bit_length() - 1
        shifted = bits >> start
        length = (~shifted & (shifted + 1)).bit_length() - 1  # trailing ones
        runs.append((start, length))
        bits &= ~(((1 << length) - 1) << start)
    return runs


# --------------------------------------------------------------------------------------------
# Encoding


def _check_int(value: int, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise MarkerError(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _text(value: str, what: str, limit: int, *, required: bool = False) -> bytes:
    if not isinstance(value, str):
        raise MarkerError(f"{what} must be a string")
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MarkerError(f"{what} is not encodable as UTF-8") from exc
    if b"\x00" in data:  # tracker/protocol_text.py: decode_text
        raise MarkerError(f"{what} contains a NUL character (U+0000)")
    if required and not data:
        raise MarkerError(f"{what} must not be empty")
    if len(data) > limit:
        raise MarkerError(f"{what} is {len(data)} bytes; the limit is {limit}")
    return data


_topic_bytes: dict[str, bytes] = {}
_group_bytes: dict[str, bytes] = {}


def encode_range_marker(marker: RangeMarker) -> bytes:
    """Serialize ``marker`` to the v2 wire format, validating every field.

    Raises :class:`MarkerError` for anything the tracker would refuse to decode. Exceptions
    are written as runs when that is smaller than the bitmap, as the bitmap otherwise.
    """
    kind = marker.kind
    if not isinstance(kind, RangeKind):
        raise MarkerError(f"unknown range marker kind {kind!r}")
    _check_int(marker.partition, "partition", 0, MAX_PARTITION)
    first = _check_int(marker.first_offset, "first offset", 0, MAX_OFFSET)
    last = _check_int(marker.last_offset, "last offset", 0, MAX_OFFSET)
    if last < first:
        raise MarkerError(f"last offset {last} is before first offset {first}")
    width = last - first + 1
    if width > MAX_RANGE_WIDTH:
        raise MarkerError(f"a range of {width} offsets is wider than {MAX_RANGE_WIDTH}")
    exceptions = marker.exceptions
    if isinstance(exceptions, bool) or not isinstance(exceptions, int) or exceptions < 0:
        raise MarkerError("exceptions must be a non-negative int (a bitmask)")
    if exceptions >> width:
        raise MarkerError("exceptions name offsets beyond the range")
    if exceptions == (1 << width) - 1:
        raise MarkerError("the exceptions cover the whole range: the marker covers no offset")
    topic = _topic_bytes.get(marker.topic) if type(marker.topic) is str else None
    if topic is None:
        if not isinstance(marker.topic, str) or not is_valid_topic(marker.topic):
            raise MarkerError(f"topic {marker.topic!r} is not a legal Kafka topic name")
        topic = _topic_bytes[marker.topic] = marker.topic.encode("ascii")
        if len(_topic_bytes) > 4096:
            _topic_bytes.clear()
    group = _group_bytes.get(marker.group) if type(marker.group) is str else None
    if group is None:
        group = _text(marker.group, "group", MAX_GROUP_LENGTH, required=True)
        _group_bytes[marker.group] = group
        if len(_group_bytes) > 4096:
            _group_bytes.clear()

    tail: list[bytes] = []
    if kind is RangeKind.RANGE_START:
        timeout = _check_int(marker.timeout_ms, "timeout_ms", 0, MAX_TIMEOUT_MS)
        consumer = _text(marker.consumer, "consumer", MAX_CONSUMER_LENGTH)
        tail += [_U32.pack(timeout), _U16.pack(len(consumer)), consumer]
    else:
        if marker.consumer:
            raise MarkerError("only a RANGE_START names a consumer")
        if kind is RangeKind.RANGE_EXTEND:
            tail.append(_U32.pack(_check_int(marker.timeout_ms, "timeout_ms", 1, MAX_TIMEOUT_MS)))
        elif marker.timeout_ms:
            raise MarkerError("a RANGE_SETTLE carries no timeout")

    flags = _encode_exceptions(exceptions, width, tail) if exceptions else 0
    head = _HEAD.pack(VERSION, kind, flags, marker.partition, first, last, len(topic))
    return b"".join([head, topic, _U16.pack(len(group)), group, *tail])


def _encode_exceptions(exceptions: int, width: int, out: list[bytes]) -> int:
    """Append ``exceptions`` as runs or as a bitmap, whichever is smaller; return the flag."""
    bitmap_size = 4 + (width + 7) // 8
    runs = runs_from_bits(exceptions) if exceptions.bit_count() * 8 < bitmap_size else None
    if runs is not None and 2 + 8 * len(runs) < bitmap_size:
        out.append(_U16.pack(len(runs)))
        out += [_RUN.pack(start, length) for start, length in runs]
        return FLAG_EXCEPTIONS_RUNS
    size = (width + 7) // 8
    out += [_U32.pack(size), exceptions.to_bytes(size, "little")]
    return FLAG_EXCEPTIONS_BITMAP


# --------------------------------------------------------------------------------------------
# Decoding

_unpack_head = _HEAD.unpack_from
_unpack_u32 = _U32.unpack_from
_unpack_run = _RUN.unpack_from
_topic = decode_topic
_name = decode_name


def py_decode_range_marker(value: bytes) -> RangeMarker:  # noqa: PLR0915
    """Parse one v2 record value. Raises :class:`MarkerError` and nothing else.

    The reference decoder; ``tracker/_speedups.c`` implements the same rules.
    """
    size = len(value)
    if size < _HEAD_SIZE:
        if size and value[0] != VERSION:
            raise MarkerError(f"unsupported marker version {value[0]}")
        raise MarkerError(f"marker of {size} bytes is too short")
    version, kind_byte, flags, partition, first, last, topic_len = _unpack_head(value)
    if version != VERSION:
        raise MarkerError(f"unsupported marker version {version}")
    kind = _KINDS.get(kind_byte)
    if kind is None:
        raise MarkerError(f"unknown range marker kind {kind_byte}")
    if flags & ~(FLAG_EXCEPTIONS_BITMAP | FLAG_EXCEPTIONS_RUNS):
        raise MarkerError(f"unknown flag bits 0x{flags:02x}")
    if flags == FLAG_EXCEPTIONS_BITMAP | FLAG_EXCEPTIONS_RUNS:
        raise MarkerError("exceptions cannot be both a bitmap and runs")
    if partition < 0 or first < 0 or last < 0:
        raise MarkerError("partition and offsets must not be negative")
    if last < first:
        raise MarkerError(f"last offset {last} is before first offset {first}")
    width = last - first + 1
    if width > MAX_RANGE_WIDTH:
        raise MarkerError(f"a range of {width} offsets is wider than {MAX_RANGE_WIDTH}")
    if not 0 < topic_len <= MAX_TOPIC_LENGTH:
        raise MarkerError(f"topic length {topic_len} is out of range")
    pos = _HEAD_SIZE + topic_len
    if pos + 2 > size:
        raise MarkerError("marker truncated in the topic")
    topic = _topic(value[_HEAD_SIZE:pos])
    end = pos + 2 + ((value[pos] << 8) | value[pos + 1])
    if end > size or end == pos + 2 or end - pos - 2 > MAX_GROUP_LENGTH:
        raise MarkerError("group is empty, too long or truncated")
    group = _name(value[pos + 2 : end], "group")
    pos = end

    timeout_ms = 0
    consumer = ""
    if kind is RangeKind.RANGE_START:
        if pos + 6 > size:
            raise MarkerError("RANGE_START marker truncated")
        timeout_ms = _unpack_u32(value, pos)[0]
        end = pos + 6 + ((value[pos + 4] << 8) | value[pos + 5])
        if end - pos - 6 > MAX_CONSUMER_LENGTH or end > size:
            raise MarkerError("consumer id too long or truncated")
        if end > pos + 6:
            consumer = _name(value[pos + 6 : end], "consumer")
        pos = end
    elif kind is RangeKind.RANGE_EXTEND:
        if pos + 4 > size:
            raise MarkerError("RANGE_EXTEND marker truncated")
        timeout_ms = _unpack_u32(value, pos)[0]
        if timeout_ms == 0:
            raise MarkerError("RANGE_EXTEND must ask for a positive timeout")
        pos += 4

    exceptions = 0
    if flags & FLAG_EXCEPTIONS_BITMAP:
        if pos + 4 > size:
            raise MarkerError("exceptions bitmap truncated")
        length = _unpack_u32(value, pos)[0]
        if length != (width + 7) // 8:
            raise MarkerError(
                f"exceptions bitmap of {length} bytes for a range of {width} offsets "
                f"(must be {(width + 7) // 8})"
            )
        pos += 4
        if pos + length > size:
            raise MarkerError("exceptions bitmap truncated")
        exceptions = int.from_bytes(value[pos : pos + length], "little")
        pos += length
        if exceptions >> width:
            raise MarkerError("exceptions bitmap has bits set beyond the range")
        if not exceptions:
            raise MarkerError("exceptions bitmap is empty (leave the flag unset instead)")
    elif flags & FLAG_EXCEPTIONS_RUNS:
        if pos + 2 > size:
            raise MarkerError("exceptions runs truncated")
        count = (value[pos] << 8) | value[pos + 1]
        pos += 2
        if count == 0:
            raise MarkerError("exceptions runs are empty (leave the flag unset instead)")
        if pos + 8 * count > size:
            raise MarkerError("exceptions runs truncated")
        previous_end = -1
        for _ in range(count):
            start, length = _unpack_run(value, pos)
            pos += 8
            if length == 0:
                raise MarkerError("an exceptions run has length 0")
            if start <= previous_end:
                raise MarkerError("exceptions runs overlap, touch or are out of order")
            if start + length > width:
                raise MarkerError("an exceptions run reaches beyond the range")
            exceptions |= ((1 << length) - 1) << start
            previous_end = start + length
    if exceptions == (1 << width) - 1:
        raise MarkerError("the exceptions cover the whole range: the marker covers no offset")
    if pos != size:
        raise MarkerError(f"{size - pos} unexpected trailing bytes")
    return RangeMarker(kind, group, topic, partition, first, last, exceptions, timeout_ms, consumer)
