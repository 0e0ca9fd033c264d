"""The marker wire format (version 1).

Consumers write *markers* about the messages they process to one markers topic; the tracker
reads them back. This module is the only place that knows the bytes. ``docs/protocol.md`` is the
normative, byte-for-byte specification; keep the two in step (``tests/unit/test_protocol.py``
checks the documented test vectors).

Design choices, in short:

* Binary, big-endian, one fixed 19-byte head plus length-prefixed strings: compact (an ACK for a
  first delivery on topic ``orders`` by group ``billing`` is 34 bytes) and cheap to decode in
  bulk without a schema registry.
* Every duration is *relative* to the marker record's Kafka timestamp (``timeout_ms``,
  ``delay_ms``). The tracker resolves them against that timestamp, so a consumer host whose
  clock is off does not move deadlines (see ``docs/protocol.md``, "Time").
* Strict: any deviation (unknown version, kind or flag, a length that does not add up, an
  illegal topic name, a field out of range, trailing bytes) raises :class:`MarkerError` and
  nothing else, so the tracker can park a bad record and go on.
"""

from __future__ import annotations

import enum
import importlib
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from tracker.errors import MarkerError
from tracker.ids import MAX_TOPIC_LENGTH, MessageId, is_valid_topic
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
from tracker.protocol_text import decode_name, decode_topic, text_cache, topic_cache
from tracker.protocol_v2 import RangeKind, RangeMarker, encode_range_marker, py_decode_range_marker

VERSION = 1

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

#: Flag bits (byte 2).
FLAG_HAS_ORIGIN = 0x01
FLAG_POLICY_DELAY = 0x02
FLAG_DEFERRED = 0x04
_KNOWN_FLAGS = FLAG_HAS_ORIGIN | FLAG_POLICY_DELAY | FLAG_DEFERRED
_DELAY_FLAGS = FLAG_POLICY_DELAY | FLAG_DEFERRED


class MarkerKind(enum.IntEnum):
    """What a marker says about a message."""

    START = 1  #: a consumer took the message; redeliver unless settled by the deadline
    ACK = 2  #: done (terminal)
    DELAY = 3  #: redeliver after a delay: retry with backoff, or a not-yet-due message
    EXTEND = 4  #: renew the processing lease
    REJECT = 5  #: poison: dead-letter now


_KINDS = (None, *MarkerKind)  # index by the wire byte; index 0 is not a kind

# version, kind, flags, attempt, partition, offset, topic length
_HEAD = struct.Struct(">BBBHiqH")
_HEAD_SIZE = _HEAD.size  # 19
_ORIGIN = struct.Struct(">iqH")  # origin partition, origin offset, origin topic length
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_U16 = struct.Struct(">H")


class Marker(NamedTuple):
    """One decoded marker.

    ``topic/partition/offset`` is the record the consumer received (a first delivery or a
    redelivered copy); ``origin_*`` is the first delivery of the logical message and equals the
    record's own position on a first delivery. The tracker keys its state by ``(group, origin)``.

    Kind-specific fields are zero/empty where they do not apply:

    * ``timeout_ms`` (START, EXTEND): the lease, relative to the marker's Kafka timestamp;
      ``0`` on START means "the topic's configured processing timeout".
    * ``delay_ms`` (DELAY): redeliver this long after the marker's timestamp;
      ``policy_delay`` means the consumer asked for the topic's backoff policy instead;
      ``deferred`` marks a delayed message read before its time (not a failed attempt).
    * ``consumer`` (START): the consumer's client/member id, for inspection.
    * ``reason`` (DELAY, REJECT): free text from the application.
    """

    kind: MarkerKind
    group: str
    topic: str
    partition: int
    offset: int
    attempt: int
    origin_topic: str
    origin_partition: int
    origin_offset: int
    timeout_ms: int = 0
    delay_ms: int = 0
    policy_delay: bool = False
    consumer: str = ""
    reason: str = ""
    deferred: bool = False

    @property
    def message(self) -> MessageId:
        """The record this marker is about."""
        return MessageId(self.topic, self.partition, self.offset)

    @property
    def origin(self) -> MessageId:
        """The first delivery of the logical message."""
        return MessageId(self.origin_topic, self.origin_partition, self.origin_offset)

    # Constructors: the readable way to build markers (they do not validate; encode does).

    @classmethod
    def _for(
        cls,
        kind: MarkerKind,
        group: str,
        message: MessageId,
        attempt: int,
        origin: MessageId | None,
    ) -> Marker:
        o = origin or message
        return cls(kind, group, *message, attempt, *o)

    @classmethod
    def start(
        cls,
        group: str,
        message: MessageId,
        *,
        attempt: int = 1,
        origin: MessageId | None = None,
        timeout_ms: int = 0,
        consumer: str = "",
    ) -> Marker:
        o = origin or message
        return cls(MarkerKind.START, group, *message, attempt, *o, timeout_ms, 0, False, consumer)

    @classmethod
    def ack(
        cls, group: str, message: MessageId, *, attempt: int = 1, origin: MessageId | None = None
    ) -> Marker:
        return cls._for(MarkerKind.ACK, group, message, attempt, origin)

    @classmethod
    def delay(
        cls,
        group: str,
        message: MessageId,
        *,
        attempt: int = 1,
        origin: MessageId | None = None,
        delay_ms: int | None = None,
        reason: str = "",
        deferred: bool = False,
    ) -> Marker:
        """A DELAY marker; ``delay_ms=None`` leaves the delay to the topic's backoff policy.

        ``deferred=True``: the consumer read a delayed message before its due time; the tracker
        republishes it when due without counting an attempt.
        """
        return cls._for(MarkerKind.DELAY, group, message, attempt, origin)._replace(
            delay_ms=delay_ms or 0, policy_delay=delay_ms is None, reason=reason, deferred=deferred
        )

    @classmethod
    def extend(
        cls,
        group: str,
        message: MessageId,
        *,
        timeout_ms: int,
        attempt: int = 1,
        origin: MessageId | None = None,
    ) -> Marker:
        return cls._for(MarkerKind.EXTEND, group, message, attempt, origin)._replace(
            timeout_ms=timeout_ms
        )

    @classmethod
    def reject(
        cls,
        group: str,
        message: MessageId,
        *,
        reason: str,
        attempt: int = 1,
        origin: MessageId | None = None,
    ) -> Marker:
        return cls._for(MarkerKind.REJECT, group, message, attempt, origin)._replace(reason=reason)


# --------------------------------------------------------------------------------------------
# Encoding


# Writers encode the same few topic, group and consumer names over and over: the validated
# bytes of each are kept (bounded), so a marker costs its integers, not its strings.
_ENCODE_CACHE_LIMIT = 4096
_topic_bytes: dict[str, bytes] = {}
_text_bytes: dict[str, bytes] = {}


def _check_topic(name: str, what: str) -> bytes:
    if type(name) is str:
        data = _topic_bytes.get(name)
        if data is not None:
            return data
    if not isinstance(name, str) or not is_valid_topic(name):
        raise MarkerError(f"{what} {name!r} is not a legal Kafka topic name")
    data = name.encode("ascii")
    if len(_topic_bytes) >= _ENCODE_CACHE_LIMIT:
        _topic_bytes.clear()
    _topic_bytes[name] = data
    return data


def _check_text(value: str, what: str, limit: int, *, required: bool = False) -> bytes:
    data = _text_bytes.get(value) if type(value) is str and len(value) <= 255 else None
    if data is None:
        if not isinstance(value, str):
            raise MarkerError(f"{what} must be a string")
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates
            raise MarkerError(f"{what} is not encodable as UTF-8") from exc
        if len(value) <= 255:  # names, not free text: few distinct values
            if len(_text_bytes) >= _ENCODE_CACHE_LIMIT:
                _text_bytes.clear()
            _text_bytes[value] = data
    if required and not data:
        raise MarkerError(f"{what} must not be empty")
    if len(data) > limit:
        raise MarkerError(f"{what} is {len(data)} bytes; the limit is {limit}")
    return data


def _check_int(value: int, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise MarkerError(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _check_position(marker: Marker) -> None:
    """Raise the precise error for the position field that failed the fast check."""
    _check_int(marker.attempt, "attempt", 1, MAX_ATTEMPT)
    _check_int(marker.partition, "partition", 0, MAX_PARTITION)
    _check_int(marker.offset, "offset", 0, MAX_OFFSET)
    _check_int(marker.origin_partition, "origin partition", 0, MAX_PARTITION)
    _check_int(marker.origin_offset, "origin offset", 0, MAX_OFFSET)


_pack_head = _HEAD.pack


def encode_marker(marker: Marker) -> bytes:
    """Serialize ``marker`` to the v1 wire format, validating every field.

    Raises :class:`MarkerError` for anything the tracker would refuse to decode, so a writer
    using this function can never emit a marker that gets parked as invalid.
    """
    kind = marker.kind
    if not isinstance(kind, MarkerKind):
        raise MarkerError(f"unknown marker kind {kind!r}")
    attempt, partition, offset = marker.attempt, marker.partition, marker.offset
    origin_partition, origin_offset = marker.origin_partition, marker.origin_offset
    # One combined check on the hot path (``type(x) is int`` also refuses bools);
    # _check_position says which field is wrong.
    if not (
        type(attempt) is int
        and type(partition) is int
        and type(offset) is int
        and type(origin_partition) is int
        and type(origin_offset) is int
        and 1 <= attempt <= MAX_ATTEMPT
        and 0 <= partition <= MAX_PARTITION
        and 0 <= offset <= MAX_OFFSET
        and 0 <= origin_partition <= MAX_PARTITION
        and 0 <= origin_offset <= MAX_OFFSET
    ):
        _check_position(marker)
    topic = _check_topic(marker.topic, "topic")
    group = _check_text(marker.group, "group", MAX_GROUP_LENGTH, required=True)
    has_origin = (
        origin_offset != offset
        or origin_partition != partition
        or marker.origin_topic != marker.topic
    )
    flags = FLAG_HAS_ORIGIN if has_origin else 0
    if kind is not MarkerKind.DELAY and (marker.policy_delay or marker.deferred):
        raise MarkerError("policy_delay and deferred are only meaningful on DELAY markers")
    if marker.policy_delay and marker.deferred:
        raise MarkerError(
            "a deferred DELAY carries its own delay; it cannot leave it to the policy"
        )
    if kind is MarkerKind.DELAY and marker.deferred:
        flags |= FLAG_DEFERRED
    if kind is MarkerKind.DELAY and marker.policy_delay:
        if marker.delay_ms != 0:
            raise MarkerError("a DELAY that leaves the delay to the policy must have delay_ms=0")
        flags |= FLAG_POLICY_DELAY
    if not has_origin and attempt != 1:
        raise MarkerError("a redelivered copy (attempt > 1) must name its origin")

    parts = [_pack_head(VERSION, kind, flags, attempt, partition, offset, len(topic)), topic]
    parts += [_U16.pack(len(group)), group]
    if has_origin:
        origin_topic = _check_topic(marker.origin_topic, "origin topic")
        parts += [_ORIGIN.pack(origin_partition, origin_offset, len(origin_topic)), origin_topic]

    if kind is MarkerKind.START:
        timeout = _check_int(marker.timeout_ms, "timeout_ms", 0, MAX_TIMEOUT_MS)
        consumer = _check_text(marker.consumer, "consumer", MAX_CONSUMER_LENGTH)
        parts += [_U32.pack(timeout), _U16.pack(len(consumer)), consumer]
    elif kind is MarkerKind.EXTEND:
        parts.append(_U32.pack(_check_int(marker.timeout_ms, "timeout_ms", 1, MAX_TIMEOUT_MS)))
    elif kind is MarkerKind.DELAY:
        delay = _check_int(marker.delay_ms, "delay_ms", 0, MAX_DELAY_MS)
        reason = _check_text(marker.reason, "reason", MAX_REASON_LENGTH)
        parts += [_U64.pack(delay), _U16.pack(len(reason)), reason]
    elif kind is MarkerKind.REJECT:
        reason = _check_text(marker.reason, "reason", MAX_REASON_LENGTH)
        parts += [_U16.pack(len(reason)), reason]
    return b"".join(parts)


def encode_any(marker: Marker | RangeMarker) -> bytes:
    """Serialize a marker of either version (v1 :class:`Marker`, v2 :class:`RangeMarker`)."""
    if isinstance(marker, RangeMarker):
        return encode_range_marker(marker)
    return encode_marker(marker)


# --------------------------------------------------------------------------------------------
# Decoding
#
# The decoder is the tracker's hot path, so it trades a little elegance for speed: one
# ``unpack_from`` for the fixed head, string lengths read straight from the bytes, and small
# caches that turn the handful of distinct topic / group / consumer names into validated,
# interned ``str`` objects after their first appearance.

# The caches are shared with the v2 decoder (tracker/protocol_text.py).
_topic_cache = topic_cache
_text_cache = text_cache
_topic = decode_topic
_name = decode_name


def _reason(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MarkerError("reason is not valid UTF-8") from None


def _refuse_head(  # noqa: PLR0917 - mirrors the head tuple
    version: int, kind: int, flags: int, attempt: int, partition: int, offset: int, topic_len: int
) -> MarkerError:
    """Explain why a head failed the combined fast check in :func:`decode_marker`."""
    if version != VERSION:
        return MarkerError(f"unsupported marker version {version}")
    if not 1 <= kind <= 5:
        return MarkerError(f"unknown marker kind {kind}")
    if flags & ~_KNOWN_FLAGS:
        return MarkerError(f"unknown flag bits 0x{flags:02x}")
    if attempt == 0:
        return MarkerError("attempt must be >= 1")
    if partition < 0 or offset < 0:
        return MarkerError("partition and offset must not be negative")
    return MarkerError(f"topic length {topic_len} is out of range")


_new_marker = tuple.__new__
_unpack_head = _HEAD.unpack_from
_unpack_origin = _ORIGIN.unpack_from
_unpack_u32 = _U32.unpack_from
_unpack_u64 = _U64.unpack_from


def py_decode_marker(value: bytes | bytearray | memoryview | None) -> Marker:  # noqa: PLR0915
    """Parse one marker record value. Raises :class:`MarkerError` and nothing else.

    This is the reference decoder; :func:`decode_marker` is the C build of the same rules
    (``tracker/_speedups.c``) when it is available.
    """
    if type(value) is not bytes:
        if isinstance(value, bytes | bytearray | memoryview):
            value = bytes(value)
        else:
            raise MarkerError("a marker record must have a bytes value (got a tombstone?)")
    size = len(value)
    if size < _HEAD_SIZE + 3:
        if size and value[0] != VERSION:
            raise MarkerError(f"unsupported marker version {value[0]}")
        raise MarkerError(f"marker of {size} bytes is too short")
    head = _unpack_head(value)
    version, kind, flags, attempt, partition, offset, topic_len = head
    # One combined test for the common case; the slow path says what exactly is wrong.
    if (
        version != VERSION
        or not 0 < kind < 6
        or flags > _KNOWN_FLAGS
        or attempt == 0
        or partition < 0
        or offset < 0
        or not 0 < topic_len <= MAX_TOPIC_LENGTH
    ):
        raise _refuse_head(*head)
    pos = _HEAD_SIZE + topic_len
    if pos + 2 > size:
        raise MarkerError("marker truncated in the topic")
    raw = value[_HEAD_SIZE:pos]
    topic = _topic_cache.get(raw) or _topic(raw)
    end = pos + 2 + ((value[pos] << 8) | value[pos + 1])
    if end > size or end == pos + 2 or end - pos - 2 > MAX_GROUP_LENGTH:
        raise MarkerError("group is empty, too long or truncated")
    raw = value[pos + 2 : end]
    group = _text_cache.get(raw) or _name(raw, "group")
    pos = end

    if flags & FLAG_HAS_ORIGIN:
        if pos + 14 > size:
            raise MarkerError("marker truncated in the origin")
        origin_partition, origin_offset, origin_len = _unpack_origin(value, pos)
        if origin_partition < 0 or origin_offset < 0:
            raise MarkerError("origin partition and offset must not be negative")
        if not 0 < origin_len <= MAX_TOPIC_LENGTH:
            raise MarkerError(f"origin topic length {origin_len} is out of range")
        pos += 14
        end = pos + origin_len
        if end > size:
            raise MarkerError("marker truncated in the origin topic")
        raw = value[pos:end]
        origin_topic = _topic_cache.get(raw) or _topic(raw)
        pos = end
        if origin_offset == offset and origin_partition == partition and origin_topic == topic:
            raise MarkerError("origin flag set but the origin equals the message")
    elif attempt != 1:
        raise MarkerError("a redelivered copy (attempt > 1) must name its origin")
    else:
        origin_topic, origin_partition, origin_offset = topic, partition, offset

    timeout_ms = delay_ms = 0
    consumer = reason = ""
    policy_delay = deferred = False
    if kind != 3 and flags & _DELAY_FLAGS:
        raise MarkerError("the policy-delay and deferred flags are only valid on DELAY markers")
    if kind == 2:  # ACK: nothing more
        pass
    elif kind == 1:  # START
        if pos + 6 > size:
            raise MarkerError("START marker truncated")
        timeout_ms = _unpack_u32(value, pos)[0]
        end = pos + 6 + ((value[pos + 4] << 8) | value[pos + 5])
        if end - pos - 6 > MAX_CONSUMER_LENGTH or end > size:
            raise MarkerError("consumer id too long or truncated")
        if end > pos + 6:
            raw = value[pos + 6 : end]
            consumer = _text_cache.get(raw) or _name(raw, "consumer")
        pos = end
    elif kind == 3:  # DELAY
        if pos + 10 > size:
            raise MarkerError("DELAY marker truncated")
        delay_ms = _unpack_u64(value, pos)[0]
        if delay_ms > MAX_DELAY_MS:
            raise MarkerError(f"delay of {delay_ms} ms is beyond the protocol's limit")
        policy_delay = bool(flags & FLAG_POLICY_DELAY)
        deferred = bool(flags & FLAG_DEFERRED)
        if policy_delay and delay_ms:
            raise MarkerError("a policy DELAY must carry delay_ms=0")
        if policy_delay and deferred:
            raise MarkerError("a deferred DELAY cannot leave its delay to the policy")
        end = pos + 10 + ((value[pos + 8] << 8) | value[pos + 9])
        if end - pos - 10 > MAX_REASON_LENGTH or end > size:
            raise MarkerError("DELAY marker reason too long or truncated")
        reason = _reason(value[pos + 10 : end])
        pos = end
    elif kind == 4:  # EXTEND
        if pos + 4 > size:
            raise MarkerError("EXTEND marker truncated")
        timeout_ms = _unpack_u32(value, pos)[0]
        if timeout_ms == 0:
            raise MarkerError("EXTEND must ask for a positive timeout")
        pos += 4
    else:  # REJECT
        if pos + 2 > size:
            raise MarkerError("REJECT marker truncated")
        end = pos + 2 + ((value[pos] << 8) | value[pos + 1])
        if end - pos - 2 > MAX_REASON_LENGTH or end > size:
            raise MarkerError("REJECT marker reason too long or truncated")
        reason = _reason(value[pos + 2 : end])
        pos = end
    if pos != size:
        raise MarkerError(f"{size - pos} unexpected trailing bytes")
    marker: Marker = _new_marker(
        Marker,
        (
            _KINDS[kind],
            group,
            topic,
            partition,
            offset,
            attempt,
            origin_topic,
            origin_partition,
            origin_offset,
            timeout_ms,
            delay_ms,
            policy_delay,
            consumer,
            reason,
            deferred,
        ),
    )
    return marker


#: A decoded marker of either version.
AnyMarker = Marker | RangeMarker


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
    if os.environ.get("KMQ_PURE_PYTHON"):
        return None
    try:
        # By name, not ``from tracker import _speedups``: that reads as an import of the
        # package itself, which imports this module (a cycle to the import contracts).
        _speedups = importlib.import_module("tracker._speedups")
    except ImportError:
        return None
    _speedups.configure(Marker, _KINDS, MarkerError, RangeMarker, _RANGE_KINDS)
    return _speedups


_speedups_module = _c_decoder()
_c_decode: Callable[[bytes], AnyMarker] | None = (
    None if _speedups_module is None else _speedups_module.decode
)
_c_decode_many: Callable[[list[bytes | None]], tuple[list[AnyMarker | None], list[tuple[int, str]]]]
_c_decode_many = None if _speedups_module is None else _speedups_module.decode_many  # type: ignore[assignment]
#: Whether the C decoder is in use.
SPEEDUPS = _c_decode is not None
#: The C column builder (``pipeline.decode`` turns decoded markers into Arrow buffers with it),
#: or None without the C decoder.
c_marker_columns: Callable[[list[AnyMarker | None]], tuple[Any, ...]] | None = (
    None if _speedups_module is None else getattr(_speedups_module, "marker_columns", None)
)  # getattr: a module built before marker_columns existed still decodes


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
