"""The store's tables as SQLAlchemy sees them, and the conversions between their rows and the
domain's values: an entry's columns in one fixed order (rows are read by position: building a
name mapping per row cost as much as the query), the headers' binary encoding, key chunks.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Table,
    and_,
)

from tracker.domain.entries import Entry, State
from tracker.domain.tracked_range import RANGE_COLUMN_NAMES, LaneKey
from tracker.protocol_limits import MAX_OFFSET
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .models import (
    ConsoleLogout,
    DeadLetter,
    DeadLetterCount,
    MarkersPartition,
    MarkersTopicBinding,
    TrackedCount,
    TrackedMessage,
    TrackedRangeRow,
)

_T = TypeVar("_T")

tracked: Table = TrackedMessage.__table__  # type: ignore[assignment]
ranges_table: Table = TrackedRangeRow.__table__  # type: ignore[assignment]
partitions_table: Table = MarkersPartition.__table__  # type: ignore[assignment]
dead_letters: Table = DeadLetter.__table__  # type: ignore[assignment]
tracked_counts: Table = TrackedCount.__table__  # type: ignore[assignment]
dead_letter_counts: Table = DeadLetterCount.__table__  # type: ignore[assignment]
console_logouts: Table = ConsoleLogout.__table__  # type: ignore[assignment]
markers_topic_binding: Table = MarkersTopicBinding.__table__  # type: ignore[assignment]

#: The columns of a tracked range's key, in key order.
RANGE_KEY_COLUMNS = (
    ranges_table.c.group_id,
    ranges_table.c.origin_topic,
    ranges_table.c.origin_partition,
    ranges_table.c.first_offset,
)


def ranges_reaching(lane: LaneKey, first: int, last: int) -> ColumnElement[bool]:
    """The tracked ranges of ``lane`` that may hold an offset of ``[first, last]``.

    A range never spans more than MAX_RANGE_WIDTH offsets (it is a subset of one
    RANGE_START), so such a range starts in ``[first - MAX_RANGE_WIDTH + 1, last]`` and ends
    in ``[first, last + MAX_RANGE_WIDTH - 1]``: a bounded walk of either index the planner
    picks (the primary key or ix_ranges_lane_last), however many ranges the lane has
    elsewhere. Without the upper bound on last_offset, a walk of ix_ranges_lane_last (which
    PostgreSQL picks for lookups near a lane's tail) would read every later range of the lane
    if picked for one near its head. Capped at the highest offset a marker may name: a bound
    past it does not fit a 64-bit column.
    """
    r = ranges_table.c
    group, topic, partition = lane
    return and_(
        r.group_id == group,
        r.origin_topic == topic,
        r.origin_partition == partition,
        r.first_offset.between(first - MAX_RANGE_WIDTH + 1, last),
        r.last_offset.between(first, min(last + MAX_RANGE_WIDTH - 1, MAX_OFFSET)),
    )


#: The columns of an entry's key, in key order.
KEY_COLUMNS = (
    tracked.c.group_id,
    tracked.c.origin_topic,
    tracked.c.origin_partition,
    tracked.c.origin_offset,
)
ENTRY_COLUMN_NAMES = (
    "group_id",
    "origin_topic",
    "origin_partition",
    "origin_offset",
    "markers_partition",
    "state",
    "attempt",
    "copy_topic",
    "copy_partition",
    "copy_offset",
    "due_at_ms",
    "first_seen_ms",
    "updated_ms",
    "deferred",
    "consumer",
    "reason",
    "keep_payload",
    "claim_token",
)
#: The columns an upsert of an entry row overwrites (all but its key).
ENTRY_UPDATE_COLUMNS = ENTRY_COLUMN_NAMES[4:]
#: The columns an upsert of a tracked range's row overwrites (all but its key).
RANGE_UPDATE_COLUMNS = RANGE_COLUMN_NAMES[4:]
#: What an entry is counted by (``tracker.store.counts``).
COUNT_COLUMNS = (
    tracked.c.markers_partition,
    tracked.c.origin_topic,
    tracked.c.group_id,
    tracked.c.state,
)
#: The key of a row of :data:`ENTRY_COLUMN_NAMES` or ``RANGE_COLUMN_NAMES``: rows are written
#: in key order, so that two transactions lock the same rows in the same order (PostgreSQL).
ROW_KEY = operator.itemgetter(0, 1, 2, 3)
#: Keys per ``keys_in`` statement on SQLite (PostgreSQL takes them as arrays: ten times more).
KEY_CHUNK = 500


def encode_headers(headers: Iterable[tuple[str, bytes | None]]) -> bytes:
    """Headers as ``u16 name length, name, i32 value length (-1 = null), value`` repeated."""
    out = bytearray()
    for name, value in headers:
        raw = name.encode("utf-8")
        out += struct.pack(">H", len(raw)) + raw
        if value is None:
            out += struct.pack(">i", -1)
        else:
            out += struct.pack(">i", len(value)) + bytes(value)
    return bytes(out)


def decode_headers(data: bytes | None) -> tuple[tuple[str, bytes | None], ...]:
    out: list[tuple[str, bytes | None]] = []
    pos = 0
    data = data or b""
    while pos < len(data):
        (name_len,) = struct.unpack_from(">H", data, pos)
        name = data[pos + 2 : pos + 2 + name_len].decode("utf-8")
        pos += 2 + name_len
        (value_len,) = struct.unpack_from(">i", data, pos)
        pos += 4
        value = None if value_len < 0 else data[pos : pos + value_len]
        pos += max(0, value_len)
        out.append((name, value))
    return tuple(out)


def entry_from_values(row: Sequence[Any], claimed_by: str | None = None) -> Entry:
    """An :class:`Entry` from a row of exactly :data:`ENTRY_COLUMN_NAMES`, in that order.

    Rows are read by position (ingest's key lookup, claims, the admin API's listings):
    building a name mapping per row cost as much as the query. ``claimed_by`` replaces the
    row's claim token (a claim builds its entries so rather than copying each with
    ``replace``).
    """
    (
        group_id,
        origin_topic,
        origin_partition,
        origin_offset,
        markers_partition,
        state,
        attempt,
        copy_topic,
        copy_partition,
        copy_offset,
        due_at_ms,
        first_seen_ms,
        updated_ms,
        deferred,
        consumer,
        reason,
        keep_payload,
        claim_token,
    ) = row
    return Entry(
        group_id=group_id,
        origin_topic=origin_topic,
        origin_partition=origin_partition,
        origin_offset=origin_offset,
        markers_partition=markers_partition,
        state=_STATES[state],
        attempt=attempt,
        copy_topic=copy_topic,
        copy_partition=copy_partition,
        copy_offset=copy_offset,
        due_at_ms=due_at_ms,
        first_seen_ms=first_seen_ms,
        updated_ms=updated_ms,
        deferred=bool(deferred),
        consumer=consumer,
        reason=reason,
        keep_payload=bool(keep_payload),
        claim_token=claim_token if claimed_by is None else claimed_by,
    )


_STATES = {state.value: state for state in State}


def row_from_entry(entry: Entry) -> tuple[Any, ...]:
    """The values of :data:`ENTRY_COLUMN_NAMES` for ``entry``, in that order."""
    return (
        entry.group_id,
        entry.origin_topic,
        entry.origin_partition,
        entry.origin_offset,
        entry.markers_partition,
        entry.state.value,
        entry.attempt,
        entry.copy_topic,
        entry.copy_partition,
        entry.copy_offset,
        entry.due_at_ms,
        entry.first_seen_ms,
        entry.updated_ms,
        entry.deferred,
        entry.consumer,
        entry.reason,
        entry.keep_payload,
        entry.claim_token,
    )


def chunks(items: Sequence[_T], size: int) -> Iterable[Sequence[_T]]:
    """``items`` in consecutive slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
