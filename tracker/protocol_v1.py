"""The marker wire format, version 1: the marker, its kinds and flags, and its encoding.

Consumers write *markers* about the messages they process to one markers topic; the tracker
reads them back. This module and ``tracker.protocol_v1_decode`` (its Python decoder) are the
only Python that knows the bytes of v1 (``tracker/_speedups.c`` decodes them too;
``tracker.protocol`` is the entry point for both versions). ``docs/protocol.md`` is the
normative, byte-for-byte specification; keep them in step (``tests/unit/test_protocol.py``
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
import struct
from typing import NamedTuple

from tracker.errors import MarkerError
from tracker.ids import MessageId, is_valid_topic
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

VERSION = 1

#: Flag bits (byte 2).
FLAG_HAS_ORIGIN = 0x01
FLAG_POLICY_DELAY = 0x02
FLAG_DEFERRED = 0x04
KNOWN_FLAGS = FLAG_HAS_ORIGIN | FLAG_POLICY_DELAY | FLAG_DEFERRED
DELAY_FLAGS = FLAG_POLICY_DELAY | FLAG_DEFERRED


class MarkerKind(enum.IntEnum):
    """What a marker says about a message."""

    START = 1  #: a consumer took the message; redeliver unless settled by the deadline
    ACK = 2  #: done (terminal)
    DELAY = 3  #: redeliver after a delay: retry with backoff, or a not-yet-due message
    EXTEND = 4  #: renew the processing lease
    REJECT = 5  #: poison: dead-letter now


KINDS_BY_BYTE = (None, *MarkerKind)  # index by the wire byte; index 0 is not a kind

# version, kind, flags, attempt, partition, offset, topic length
HEAD_STRUCT = struct.Struct(">BBBHiqH")
HEAD_SIZE = HEAD_STRUCT.size  # 19
ORIGIN_STRUCT = struct.Struct(">iqH")  # origin partition, origin offset, origin topic length
U32_STRUCT = struct.Struct(">I")
U64_STRUCT = struct.Struct(">Q")
U16_STRUCT = struct.Struct(">H")


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
        if b"\x00" in data:  # tracker/protocol_text.py: decode_text
            raise MarkerError(f"{what} contains a NUL character (U+0000)")
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


_pack_head = HEAD_STRUCT.pack


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
    parts += [U16_STRUCT.pack(len(group)), group]
    if has_origin:
        origin_topic = _check_topic(marker.origin_topic, "origin topic")
        parts += [
            ORIGIN_STRUCT.pack(origin_partition, origin_offset, len(origin_topic)),
            origin_topic,
        ]

    if kind is MarkerKind.START:
        timeout = _check_int(marker.timeout_ms, "timeout_ms", 0, MAX_TIMEOUT_MS)
        consumer = _check_text(marker.consumer, "consumer", MAX_CONSUMER_LENGTH)
        parts += [U32_STRUCT.pack(timeout), U16_STRUCT.pack(len(consumer)), consumer]
    elif kind is MarkerKind.EXTEND:
        parts.append(
            U32_STRUCT.pack(_check_int(marker.timeout_ms, "timeout_ms", 1, MAX_TIMEOUT_MS))
        )
    elif kind is MarkerKind.DELAY:
        delay = _check_int(marker.delay_ms, "delay_ms", 0, MAX_DELAY_MS)
        reason = _check_text(marker.reason, "reason", MAX_REASON_LENGTH)
        parts += [U64_STRUCT.pack(delay), U16_STRUCT.pack(len(reason)), reason]
    elif kind is MarkerKind.REJECT:
        reason = _check_text(marker.reason, "reason", MAX_REASON_LENGTH)
        parts += [U16_STRUCT.pack(len(reason)), reason]
    return b"".join(parts)
