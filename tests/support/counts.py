"""Checks that the counters the database keeps (migrations 0003, 0008) match their tables.

``tracked_counts`` is kept by the store in every transaction that writes entries,
``dead_letter_counts`` by triggers. The store, API and engine fixtures call
:func:`assert_counters_match` when a test ends, so every write path the suite exercises
(ingest, claims, redelivery rounds, operator actions, redrives, resets) is checked on SQLite
and on PostgreSQL.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracker.store.tables import (
    dead_letter_counts,
    dead_letters,
    ranges_table,
    tracked,
    tracked_counts,
)


async def counters_and_recount(engine: AsyncEngine) -> tuple[Any, Any]:
    """(what the counters say, a recount of the rows), both without zero entries."""
    t, d = tracked.c, dead_letters.c
    c, dc = tracked_counts.c, dead_letter_counts.c
    async with engine.connect() as conn:
        kept_entries = {
            (p, topic, group, state): n
            for p, topic, group, state, n in await conn.execute(
                select(c.markers_partition, c.origin_topic, c.group_id, c.state, c.entries)
            )
            if n
        }
        entries = {
            (p, topic, group, state): n
            for p, topic, group, state, n in await conn.execute(
                select(
                    t.markers_partition, t.origin_topic, t.group_id, t.state, func.count()
                ).group_by(t.markers_partition, t.origin_topic, t.group_id, t.state)
            )
        }
        # Every open offset of a tracked range is one in-flight entry.
        r = ranges_table.c
        for p, topic, group, n in await conn.execute(
            select(
                r.markers_partition, r.origin_topic, r.group_id, func.sum(r.open_count)
            ).group_by(r.markers_partition, r.origin_topic, r.group_id)
        ):
            if n:
                count_key = (p, topic, group, "in_flight")
                entries[count_key] = entries.get(count_key, 0) + int(n)
        kept_dead = {
            (topic, group): (total, waiting)
            for topic, group, total, waiting in await conn.execute(
                select(dc.origin_topic, dc.group_id, dc.total, dc.waiting)
            )
            if total or waiting
        }
        dead = {
            (topic, group): (total, waiting)
            for topic, group, total, waiting in await conn.execute(
                select(
                    d.origin_topic,
                    d.group_id,
                    func.count(),
                    func.sum(case((d.redriven_ms.is_(None), 1), else_=0)),
                ).group_by(d.origin_topic, d.group_id)
            )
        }
    return (kept_entries, kept_dead), (entries, dead)


async def assert_counters_match(engine: AsyncEngine) -> None:
    kept, recount = await counters_and_recount(engine)
    assert kept == recount, f"counters {kept} != recount {recount}"
