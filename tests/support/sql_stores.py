"""SQL stores for the store tests: migrated, their counters checked at the end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from sqlalchemy import delete

from support.counts import assert_counters_match
from tracker.store.manager import Store
from tracker.store.migrate import upgrade
from tracker.store.tables import (
    dead_letters,
    partitions_table,
    ranges_table,
    tracked,
    tracked_counts,
)


async def reset_engine_tables(store: Store) -> None:
    """Empty what the engine writes: for property tests, whose examples all run on the one
    database of the test."""
    async with store.engine.begin() as conn:
        for table in (tracked, ranges_table, tracked_counts, partitions_table, dead_letters):
            await conn.execute(delete(table))


@contextlib.asynccontextmanager
async def empty_sql_store(url: str) -> AsyncIterator[Store]:
    """A store on ``url`` (a database of the test's own), migrated; when the block ends
    without an error, its per-topic counters must match a recount of its rows."""
    store = Store.from_url(url)
    try:
        await upgrade(store.engine)
        yield store
        await assert_counters_match(store.engine)
    finally:
        await store.close()
