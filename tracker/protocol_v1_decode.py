"""The Python decoder of version 1 markers: the reference the C decoder (``tracker/_speedups.c``)
is tested against, and the decoder used where the C one is not built (``KMQ_PURE_PYTHON``).

Strict, as docs/protocol.md requires: any deviation raises :class:`MarkerError` and nothing
else, so the tracker can park a bad record and go on.
"""

from __future__ import annotations

from tracker.errors import MarkerError
from tracker.ids import MAX_TOPIC_LENGTH
from tracker.protocol_limits import (
    MAX_CONSUMER_LENGTH,
    MAX_DELAY_MS,
    MAX_GROUP_LENGTH,
    MAX_REASON_LENGTH,
)
from tracker.protocol_text import decode_name, decode_text, decode_topic, text_cache, topic_cache
from tracker.protocol_v1 import (
    DELAY_FLAGS,
    FLAG_DEFERRED,
    FLAG_HAS_ORIGIN,
    FLAG_POLICY_DELAY,
    HEAD_SIZE,
    HEAD_STRUCT,
    KINDS_BY_BYTE,
    KNOWN_FLAGS,
    ORIGIN_STRUCT,
    U32_STRUCT,
    U64_STRUCT,
    VERSION,
    Marker,
)

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
    return decode_text(raw, "reason")


def _refuse_head(  # noqa: PLR0917 - mirrors the head tuple
    version: int, kind: int, flags: int, attempt: int, partition: int, offset: int, topic_len: int
) -> MarkerError:
    """Explain why a head failed the combined fast check in :func:`decode_marker`."""
    if version != VERSION:
        return MarkerError(f"unsupported marker version {version}")
    if not 1 <= kind <= 5:
        return MarkerError(f"unknown marker kind {kind}")
    if flags & ~KNOWN_FLAGS:
        return MarkerError(f"unknown flag bits 0x{flags:02x}")
    if attempt == 0:
        return MarkerError("attempt must be >= 1")
    if partition < 0 or offset < 0:
        return MarkerError("partition and offset must not be negative")
    return MarkerError(f"topic length {topic_len} is out of range")


_new_marker = tuple.__new__
_unpack_head = HEAD_STRUCT.unpack_from
_unpack_origin = ORIGIN_STRUCT.unpack_from
_unpack_u32 = U32_STRUCT.unpack_from
_unpack_u64 = U64_STRUCT.unpack_from


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
    if size < HEAD_SIZE + 3:
        if size and value[0] != VERSION:
            raise MarkerError(f"unsupported marker version {value[0]}")
        raise MarkerError(f"marker of {size} bytes is too short")
    head = _unpack_head(value)
    version, kind, flags, attempt, partition, offset, topic_len = head
    # One combined test for the common case; the slow path says what exactly is wrong.
    if (
        version != VERSION
        or not 0 < kind < 6
        or flags > KNOWN_FLAGS
        or attempt == 0
        or partition < 0
        or offset < 0
        or not 0 < topic_len <= MAX_TOPIC_LENGTH
    ):
        raise _refuse_head(*head)
    pos = HEAD_SIZE + topic_len
    if pos + 2 > size:
        raise MarkerError("marker truncated in the topic")
    raw = value[HEAD_SIZE:pos]
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
    if kind != 3 and flags & DELAY_FLAGS:
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
            KINDS_BY_BYTE[kind],
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
