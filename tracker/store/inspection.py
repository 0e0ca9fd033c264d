"""The admin API's reads: tracked messages (filtered, keyset-paginated, with the offsets that
tracked ranges stand for), one message's record, per-topic statistics, dead letters."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Select,
    select,
    tuple_,
)

from tracker.domain.entries import EntryKey, State
from tracker.domain.tracked_range import RANGE_COLUMN_NAMES, TrackedRange
from tracker.domain.value_records import value_record
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .admin_reads import (
    ENTRY_VIEW_COLUMNS,
    DeadLetterFilter,
    EntryView,
    actions_table,
    dead_letter_where,
    entry_view,
    typed_row,
)
from .operator_actions import ActionRecord, action_record
from .port import StoredPayload
from .tables import (
    KEY_COLUMNS,
    dead_letters,
    decode_headers,
    ranges_table,
    tracked,
)
from .topic_statistics import TopicStatistics


class EntryOrder(enum.StrEnum):
    KEY = "key"  #: by (group, topic, partition, offset): stable under any concurrent writes
    DUE = "due"  #: by due time, then key: stable under inserts; excludes lost entries


@dataclass(frozen=True, slots=True)
class EntryFilter:
    """Conditions of a listing of tracked messages; ``None`` means "any"."""

    topic: str | None = None
    partition: int | None = None
    states: tuple[State, ...] = ()
    group: str | None = None
    due_before_ms: int | None = None
    due_after_ms: int | None = None
    min_attempt: int | None = None
    #: first delivered strictly before (how old a message is, whatever its attempts)
    seen_before_ms: int | None = None


@value_record
class MessageRecord:
    """What the store knows of one message (``InspectionQueries.message_record``)."""

    view: EntryView | None  #: its tracked entry, if it is tracked
    actions: list[ActionRecord]  #: operator actions on it, oldest first
    dead_letters: list[dict[str, Any]]  #: its dead letters, oldest first


def _entry_where(query: Select[Any], flt: EntryFilter) -> Select[Any]:
    if flt.topic is not None:
        query = query.where(tracked.c.origin_topic == flt.topic)
    if flt.partition is not None:
        query = query.where(tracked.c.origin_partition == flt.partition)
    if flt.states:
        query = query.where(tracked.c.state.in_([s.value for s in flt.states]))
    if flt.group is not None:
        query = query.where(tracked.c.group_id == flt.group)
    if flt.due_before_ms is not None:
        query = query.where(tracked.c.due_at_ms < flt.due_before_ms)
    if flt.due_after_ms is not None:
        query = query.where(tracked.c.due_at_ms >= flt.due_after_ms)
    if flt.min_attempt is not None:
        query = query.where(tracked.c.attempt >= flt.min_attempt)
    if flt.seen_before_ms is not None:
        query = query.where(tracked.c.first_seen_ms < flt.seen_before_ms)
    return query


def _after(sort: Sequence[Any], after: Sequence[Any], flt: EntryFilter) -> Any:
    """The keyset condition "after ``after`` in ``sort`` order", as an index range.

    A column the filter fixes (the topic, the group) is left out of the row comparison when
    the cursor has the same value there: the comparison is the same, and what is left is
    the rest of the listing's index (``ix_tracked_topic_key``: topic, group, partition,
    offset), which the planners can then seek instead of filtering the topic from its start.
    """
    fixed = {tracked.c.origin_topic.key: flt.topic, tracked.c.group_id.key: flt.group}
    kept = [
        (column, value)
        for column, value in zip(sort, after, strict=True)
        if fixed.get(column.key) is None or fixed[column.key] != value
    ]
    columns = [column for column, _ in kept]
    return tuple_(*columns) > typed_row(columns, [value for _, value in kept])


def _sort_key(order: EntryOrder) -> Any:
    """The keyset sort key of a listing in ``order`` (as ``after`` gives it)."""
    if order is EntryOrder.KEY:
        return lambda view: view.entry.key
    return lambda view: (view.entry.due_at_ms, *view.entry.key)


def _first_range_views(
    ranges: Iterable[TrackedRange],
    sort_key: Callable[[EntryView], tuple[Any, ...]],
    after: Sequence[Any] | None,
    limit: int,
) -> list[EntryView]:
    """The first ``limit`` entries (by ``sort_key``, after ``after``) the ranges stand for.

    Ranges are expanded in the order of their first entries, and the walk stops once
    ``limit`` entries are certain: a page reads a few ranges' offsets, not ``limit`` ranges'
    worth (100 ranges of 500 offsets made every page build 10,000 entries). Within a range
    the order is its offsets' (one due time per range).
    """

    def first_view(tracked_range: TrackedRange) -> EntryView:
        return EntryView(tracked_range.entry_at(next(tracked_range.offsets())), False)

    views: list[EntryView] = []
    threshold: tuple[Any, ...] | None = None
    for tracked_range in sorted(ranges, key=lambda t: sort_key(first_view(t))):
        if threshold is not None and sort_key(first_view(tracked_range)) > threshold:
            break
        taken = 0
        for offset in tracked_range.offsets():
            view = EntryView(tracked_range.entry_at(offset), False)
            if after is not None and sort_key(view) <= tuple(after):
                continue
            if threshold is not None and sort_key(view) > threshold:
                break
            views.append(view)
            taken += 1
            if taken >= limit:
                break
        if len(views) >= limit:
            views.sort(key=sort_key)
            del views[limit:]
            threshold = sort_key(views[-1])
    return views


def _range_queries(
    flt: EntryFilter, order: EntryOrder, after: Sequence[Any] | None, limit: int
) -> list[Select[Any]]:
    """The reads of the tracked ranges that hold the first ``limit`` entries (in ``order``,
    after ``after``) of a listing (``tracker/domain/ranges.py``: each open offset of a range
    is an in-flight entry); none where the filter leaves ranges out.

    Ranges are read in (lane, first offset) order, or (due, lane, first offset): the
    first ``limit`` of them hold the first ``limit`` entries, because every range holds
    its first offset. Only where ``after`` falls inside a lane are the ranges that
    straddle it (first offset before it, last after it) read as well.
    """
    if flt.states and State.IN_FLIGHT not in flt.states:
        return []
    if flt.min_attempt is not None and flt.min_attempt > 1:
        return []
    r = ranges_table.c
    base = select(*(r[name] for name in RANGE_COLUMN_NAMES))
    if flt.topic is not None:
        base = base.where(r.origin_topic == flt.topic)
    if flt.partition is not None:
        base = base.where(r.origin_partition == flt.partition)
    if flt.group is not None:
        base = base.where(r.group_id == flt.group)
    if flt.due_before_ms is not None:
        base = base.where(r.due_at_ms < flt.due_before_ms)
    if flt.due_after_ms is not None:
        base = base.where(r.due_at_ms >= flt.due_after_ms)
    if flt.seen_before_ms is not None:
        base = base.where(r.first_seen_ms < flt.seen_before_ms)
    lane = (r.group_id, r.origin_topic, r.origin_partition)
    queries: list[Select[Any]] = []
    by: tuple[Any, ...]
    if order is EntryOrder.KEY:
        by = (*lane, r.first_offset)
        if after is None:
            queries.append(base.order_by(*by).limit(limit))
        else:
            here = [c == v for c, v in zip(lane, after[:3], strict=True)]
            o = after[3]
            queries += [
                base.where(
                    *here, r.first_offset.between(o - MAX_RANGE_WIDTH, o), r.last_offset > o
                ),
                base.where(*here, r.first_offset > o).order_by(r.first_offset).limit(limit),
                base.where(tuple_(*lane) > typed_row(lane, after[:3])).order_by(*by).limit(limit),
            ]
    else:
        by = (r.due_at_ms, *lane, r.first_offset)
        if after is None:
            queries.append(base.order_by(*by).limit(limit))
        else:
            due, o = after[0], after[4]
            here = [
                r.due_at_ms == due,
                *(c == v for c, v in zip(lane, after[1:4], strict=True)),
            ]
            later = (r.due_at_ms, *lane)
            queries += [
                base.where(
                    *here, r.first_offset.between(o - MAX_RANGE_WIDTH, o), r.last_offset > o
                ),
                base.where(*here, r.first_offset > o).order_by(r.first_offset).limit(limit),
                base.where(tuple_(*later) > typed_row(later, after[:4])).order_by(*by).limit(limit),
            ]
    return queries


class InspectionQueries(TopicStatistics):
    """What operators look at: listings, one message's record, statistics, dead letters."""

    async def list_entries(
        self,
        flt: EntryFilter,
        *,
        order: EntryOrder = EntryOrder.KEY,
        after: Sequence[Any] | None = None,
        limit: int = 100,
    ) -> list[EntryView]:
        """One page of tracked entries, after the keyset position ``after``.

        ``after`` is the sort key of the last row of the previous page: the entry key for
        :attr:`EntryOrder.KEY`, ``(due_at_ms, *key)`` for :attr:`EntryOrder.DUE`. Keyset
        pagination never repeats or skips a row whose sort key does not change meanwhile.
        """
        query = _entry_where(select(*ENTRY_VIEW_COLUMNS), flt)
        sort = KEY_COLUMNS if order is EntryOrder.KEY else (tracked.c.due_at_ms, *KEY_COLUMNS)
        if order is EntryOrder.DUE:
            query = query.where(tracked.c.due_at_ms.is_not(None))
        if after is not None:
            query = query.where(_after(sort, after, flt))
        query = query.order_by(*sort).limit(limit)
        in_ranges = _range_queries(flt, order, after, limit)

        def page(conn: Connection) -> list[EntryView]:
            views = [entry_view(row) for row in conn.execute(query)]
            found: dict[tuple[Any, ...], TrackedRange] = {}
            for range_query in in_ranges:
                for row in conn.execute(range_query):
                    tracked_range = TrackedRange.from_row(row)
                    found[tracked_range.key] = tracked_range
            if not found:
                return views
            sort_key = _sort_key(order)
            views += _first_range_views(found.values(), sort_key, after, limit)
            return sorted(views, key=sort_key)[:limit]

        return await self._read(page)

    async def get_entry(self, key: EntryKey) -> EntryView | None:
        async with self._transaction(read_only=True) as conn:
            return await self._entry_view_at(conn, key)

    async def stored_payload(self, key: EntryKey) -> StoredPayload | None:
        """The payload copy the store keeps for a long delay, if any."""
        async with self._transaction(read_only=True) as conn:
            row = (
                await conn.execute(
                    select(
                        tracked.c.payload_key,
                        tracked.c.payload_value,
                        tracked.c.payload_headers,
                        tracked.c.payload_timestamp_ms,
                    ).where(tuple_(*KEY_COLUMNS) == key, tracked.c.payload_stored.is_(True))
                )
            ).first()
        if row is None:
            return None
        m = row._mapping
        return StoredPayload(
            m["payload_key"],
            m["payload_value"],
            decode_headers(m["payload_headers"]),
            m["payload_timestamp_ms"] or 0,
        )

    async def message_record(self, key: EntryKey, limit: int = 100) -> MessageRecord:
        """Everything the store knows of one message, read in one transaction: its entry,
        the latest ``limit`` operator actions and dead letters, each oldest first."""
        a, d = actions_table.c, dead_letters.c
        actions = (
            select(actions_table)
            .where(tuple_(a.group_id, a.origin_topic, a.origin_partition, a.origin_offset) == key)
            .order_by(a.id.desc())
            .limit(limit)
        )
        dead = (
            select(dead_letters)
            .where(tuple_(d.group_id, d.origin_topic, d.origin_partition, d.origin_offset) == key)
            .order_by(d.id.desc())
            .limit(limit)
        )
        async with self._transaction(read_only=True) as conn:
            view = await self._entry_view_at(conn, key)
            action_rows = list(await conn.execute(actions))
            dead_rows = list(await conn.execute(dead))
        return MessageRecord(
            view,
            [action_record(row) for row in reversed(action_rows)],
            [dict(row._mapping) for row in reversed(dead_rows)],
        )

    # -- statistics -------------------------------------------------------------------------

    # -- dead letters -----------------------------------------------------------------------

    async def list_dead_letters(
        self, flt: DeadLetterFilter, *, before_id: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """One page of dead letters, newest first, with ids below ``before_id``."""
        query = dead_letter_where(select(dead_letters), flt)
        if before_id is not None:
            query = query.where(dead_letters.c.id < before_id)
        query = query.order_by(dead_letters.c.id.desc()).limit(limit)
        async with self._transaction(read_only=True) as conn:
            return [dict(row._mapping) for row in await conn.execute(query)]

    async def get_dead_letter(self, dead_letter_id: int) -> dict[str, Any] | None:
        async with self._transaction(read_only=True) as conn:
            row = (
                await conn.execute(select(dead_letters).where(dead_letters.c.id == dead_letter_id))
            ).first()
        return dict(row._mapping) if row is not None else None
