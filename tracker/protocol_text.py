"""Text fields of marker records, validated once and cached (both protocol versions).

A markers topic repeats the same handful of topic, group and consumer names in every record:
their validated ``str`` is kept after the first appearance, so decoding a marker costs its
integers, not its strings. The v1 and v2 decoders share these caches.
"""

from __future__ import annotations

from tracker.errors import MarkerError
from tracker.ids import is_valid_topic

CACHE_LIMIT = 4096
topic_cache: dict[bytes, str] = {}
text_cache: dict[bytes, str] = {}


_LEGAL_TOPIC_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _not_ascii(raw: bytes) -> MarkerError:
    """The error for a topic with a non-ASCII byte, worded as the C decoder words it: the
    first byte that is not legal decides (an illegal ASCII byte before it names the topic)."""
    for byte in raw:
        if byte not in _LEGAL_TOPIC_BYTES:
            if byte < 0x80:
                shown = raw[:60].decode("ascii", "replace")
                return MarkerError(f"{shown!r} is not a legal Kafka topic name")
            break
    return MarkerError("topic name is not ASCII")


def decode_topic(raw: bytes) -> str:
    """A topic name from its bytes; :class:`MarkerError` if it is not a legal one."""
    name = topic_cache.get(raw)
    if name is None:
        try:
            name = raw.decode("ascii")
        except UnicodeDecodeError:
            raise _not_ascii(raw) from None
        if not is_valid_topic(name):
            raise MarkerError(f"{name[:60]!r} is not a legal Kafka topic name")
        if len(topic_cache) >= CACHE_LIMIT:
            topic_cache.clear()
        topic_cache[raw] = name
    return name


def decode_name(raw: bytes, what: str) -> str:
    """A UTF-8 name (group, consumer) from its bytes; :class:`MarkerError` if not UTF-8 or
    if it holds a NUL (:func:`decode_text`)."""
    text = text_cache.get(raw)
    if text is None:
        text = decode_text(raw, what)
        if len(text_cache) >= CACHE_LIMIT:
            text_cache.clear()
        text_cache[raw] = text
    return text


def decode_text(raw: bytes, what: str) -> str:
    """UTF-8 text of a marker (a name, a reason); :class:`MarkerError` if it is not UTF-8 or
    holds a NUL character.

    U+0000 is valid UTF-8, but PostgreSQL cannot store it in a text column: a marker that
    carried one failed every flush it was in (on SQLite it would have been stored), so it
    would stall its partition's ingest until parked by hand. It is refused here, by both
    decoders and on every store, and parked with the other malformed markers.
    """
    if b"\x00" in raw:
        raise MarkerError(f"{what} contains a NUL character (U+0000)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MarkerError(f"{what} is not valid UTF-8") from None
