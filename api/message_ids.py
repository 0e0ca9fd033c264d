"""Message ids and pagination cursors of the admin API.

A message id is ``<group>/<topic>/<partition>/<offset>`` of the origin: what the tracker keys
its state by. Topic names cannot contain ``/`` and partition and offset are numbers, so the id
is split from the right and a group id may itself contain ``/``. In a URL path the id is
written as is or percent-encoded (``billing%2Forders%2F3%2F42``), both work.

Cursors are opaque to clients: base64url JSON holding the sort key of the last row returned
and a fingerprint of the query's filters, so that a cursor is refused with another query.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from tracker.domain.entries import EntryKey
from tracker.ids import is_valid_topic

from .http_errors import ApiError

MAX_PARTITION = 2**31 - 1
MAX_OFFSET = 2**63 - 1


def format_message_id(key: EntryKey) -> str:
    group, topic, partition, offset = key
    return f"{group}/{topic}/{partition}/{offset}"


def parse_message_id(text: str) -> EntryKey:
    """The entry key of a message id; :class:`ApiError` 422 explains what is wrong."""
    parts = text.rsplit("/", 3)
    example = "like billing/orders/3/42 (group/topic/partition/offset)"
    if len(parts) != 4:
        raise ApiError(422, f"message id {text[:300]!r} is not {example}")
    group, topic, partition, offset = parts
    if not group or len(group.encode("utf-8", "replace")) > 255 or "\x00" in group:
        raise ApiError(422, f"message id {text[:300]!r}: the group must be 1-255 bytes, no NUL")
    if not is_valid_topic(topic):
        raise ApiError(422, f"message id {text[:300]!r}: {topic[:260]!r} is not a topic name")
    if not (partition.isascii() and partition.isdigit() and offset.isascii() and offset.isdigit()):
        raise ApiError(422, f"message id {text[:300]!r}: partition and offset must be numbers")
    p, o = int(partition), int(offset)
    if p > MAX_PARTITION or o > MAX_OFFSET:
        raise ApiError(422, f"message id {text[:300]!r}: partition or offset out of range")
    try:
        group.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(422, "message id: the group is not valid Unicode") from None
    return (group, topic, p, o)


def fingerprint(filters: dict[str, Any]) -> str:
    """A short hash of a query's filters (cursors remember which query they belong to)."""
    raw = json.dumps(filters, sort_keys=True, default=str).encode()
    return hashlib.blake2b(raw, digest_size=6).hexdigest()


def encode_cursor(position: list[Any], query: str) -> str:
    raw = json.dumps({"v": 1, "q": query, "k": position}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


#: The values a cursor's position may hold: 64-bit integers (offsets, ids, times in
#: milliseconds: every integer the store sorts by is a BIGINT) and short strings without NUL
#: (group ids, topic names). Anything else cannot have come from ``next_cursor``, and would
#: reach the database as an overflow or a refused string: a 500 instead of a 422.
_MIN_I64 = -(2**63)
_MAX_CURSOR_TEXT = 1024


def decode_cursor(cursor: str, query: str, shape: tuple[type[int] | type[str], ...]) -> list[Any]:
    """The position in ``cursor``, one value of each type of ``shape``; :class:`ApiError` 422
    if it is not a position of this query (another query's, edited, out of range)."""
    invalid = ApiError(422, "invalid cursor: pass next_cursor from a previous page as is")
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
    except (ValueError, binascii.Error, UnicodeError):
        raise invalid from None
    if not isinstance(data, dict) or data.get("v") != 1 or not isinstance(data.get("k"), list):
        raise invalid
    if data.get("q") != query:
        raise ApiError(
            422, "this cursor belongs to a listing with other filters; start without a cursor"
        )
    position: list[Any] = data["k"]
    if len(position) != len(shape) or not all(
        _fits(value, kind) for value, kind in zip(position, shape, strict=True)
    ):
        raise invalid
    return position


def _fits(value: Any, kind: type[int] | type[str]) -> bool:
    if kind is int:
        return type(value) is int and _MIN_I64 <= value <= MAX_OFFSET
    return type(value) is str and len(value) <= _MAX_CURSOR_TEXT and "\x00" not in value
