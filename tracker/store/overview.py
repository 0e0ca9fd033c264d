"""Store-wide figures for the web console's overview and dead-letter pages.

Every query here is bounded whatever the size of the tables, so that a page answers in
milliseconds with a million tracked messages: counts of what is due now stop at a cap (a
backlog of due messages is shown as "cap+"), groups of dead letters are taken from the newest
ones only, and per-minute dead letters use the (origin topic, time) index one topic at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.entries import State

from .manager import Store
from .tables import dead_letter_counts, dead_letters, partitions_table, ranges_table, tracked

#: Due entries counted per page at most (per kind of row: entries, then ranges).
DUE_CAP = 10_000
#: Dead letters (newest, not redriven) that the reason groups are made from.
GROUPS_SCAN = 10_000


@dataclass(frozen=True, slots=True)
class DueCounts:
    """Entries per origin topic whose deadline or due time has passed: waiting to be
    redelivered (or dead-lettered) by the tracker now."""

    by_topic: dict[str, int]
    capped: bool  #: the counting stopped at :data:`DUE_CAP`: there are at least this many


@dataclass(frozen=True, slots=True)
class ReasonGroup:
    topic: str
    reason: str
    count: int
    last_ms: int


@dataclass(frozen=True, slots=True)
class MarkersPartitionState:
    """One markers partition as the store knows it: its owner and how far it is applied."""

    partition: int
    owner: str | None
    epoch: int
    next_offset: int
    updated_ms: int


@dataclass(frozen=True, slots=True)
class Overview:
    """The store's part of the console's overview (``OverviewQueries.overview``)."""

    due: DueCounts
    dead_letters_per_minute: list[int]  #: oldest first
    partitions: list[MarkersPartitionState]


class OverviewQueries:
    """Read-only, bounded queries behind the console's summary views."""

    def __init__(self, store: Store, markers_topic: str) -> None:
        self.store = store
        self.markers_topic = markers_topic

    async def overview(self, now_ms: int, minutes: int = 60) -> Overview:
        """What is due now, dead letters per minute and the markers partitions, in one read
        transaction (a page's database work is a few statements, not a few transactions)."""
        async with self.store.transaction(read_only=True) as conn:
            return Overview(
                await self._due_now(conn, now_ms, DUE_CAP),
                await self._dead_letters_per_minute(conn, now_ms, minutes),
                await self._markers_partitions(conn),
            )

    async def _due_now(self, conn: AsyncConnection, now_ms: int, cap: int) -> DueCounts:
        """Entries (and open offsets of tracked ranges) that are due at ``now_ms``."""
        t, r = tracked.c, ranges_table.c
        live = (State.IN_FLIGHT.value, State.DELAYED.value)
        # ix_tracked_state_due_key (state, due_at_ms, ...): a range scan of what is due, cut at
        # the cap.
        due = (
            select(t.origin_topic)
            .where(t.state.in_(live), t.due_at_ms <= now_ms)
            .limit(cap + 1)
            .subquery()
        )
        counted = select(due.c.origin_topic, func.count()).group_by(due.c.origin_topic)
        ranges = select(r.origin_topic, r.open_bits).where(r.due_at_ms <= now_ms).limit(cap + 1)
        out: dict[str, int] = {}
        for topic, count in await conn.execute(counted):
            out[topic] = int(count)
        range_rows = (await conn.execute(ranges)).all()
        capped = sum(out.values()) > cap or len(range_rows) > cap
        for topic, bits in range_rows[:cap]:
            open_count = int.from_bytes(bits, "little").bit_count()
            out[topic] = out.get(topic, 0) + open_count
        return DueCounts(out, capped)

    async def _dead_letters_per_minute(
        self, conn: AsyncConnection, now_ms: int, minutes: int
    ) -> list[int]:
        """Dead letters recorded in each of the last ``minutes`` minutes, oldest first."""
        start = now_ms - minutes * 60_000
        d = dead_letters.c
        # Floor division in both dialects (SQLAlchemy renders ``//`` for each).
        minute = ((d.dead_lettered_ms - start) // 60_000).label("minute")
        buckets = [0] * minutes
        topics = (
            await conn.execute(select(dead_letter_counts.c.origin_topic).distinct())
        ).scalars()
        for topic in list(topics):
            # One range of ix_dead_letters_topic_time (origin_topic, dead_lettered_ms).
            counted = (
                select(minute, func.count())
                .where(d.origin_topic == topic)
                .where(d.dead_lettered_ms >= start, d.dead_lettered_ms < now_ms)
                .group_by(minute)
            )
            for index, count in await conn.execute(counted):
                if 0 <= int(index) < minutes:
                    buckets[int(index)] += int(count)
        return buckets

    async def _markers_partitions(self, conn: AsyncConnection) -> list[MarkersPartitionState]:
        p = partitions_table.c
        query = (
            select(p.partition, p.owner, p.epoch, p.next_offset, p.updated_ms)
            .where(p.markers_topic == self.markers_topic)
            .order_by(p.partition)
        )
        return [MarkersPartitionState(*row) for row in (await conn.execute(query)).all()]

    async def dead_letter_topics(self) -> list[str]:
        """The origin topics that have dead letters, by name: a few counter rows (0003)."""
        dc = dead_letter_counts.c
        query = select(dc.origin_topic).where(dc.total > 0).distinct().order_by(dc.origin_topic)
        async with self.store.transaction(read_only=True) as conn:
            return [name for (name,) in await conn.execute(query)]

    async def reason_groups(self, *, scan: int = GROUPS_SCAN, top: int = 50) -> list[ReasonGroup]:
        """Dead letters not redriven, grouped by origin topic and reason, largest first, from
        the newest ``scan`` of them."""
        d = dead_letters.c
        newest = (
            select(d.origin_topic, d.reason, d.dead_lettered_ms)
            .where(d.redriven_ms.is_(None))
            .order_by(d.id.desc())
            .limit(scan)
            .subquery()
        )
        grouped = (
            select(
                newest.c.origin_topic,
                newest.c.reason,
                func.count(),
                func.max(newest.c.dead_lettered_ms),
            )
            .group_by(newest.c.origin_topic, newest.c.reason)
            .order_by(func.count().desc(), newest.c.origin_topic, newest.c.reason)
            .limit(top)
        )
        async with self.store.transaction(read_only=True) as conn:
            rows = (await conn.execute(grouped)).all()
        return [
            ReasonGroup(topic, reason, int(count), int(last)) for topic, reason, count, last in rows
        ]
