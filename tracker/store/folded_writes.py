"""Writing what a flush's fold changed, lane by lane, while the next lanes fold.

A flush folds its markers per lane (``tracker.domain.ranges``) in Python, then writes the
rows that changed. Written only after the whole fold, the two ran one after the other: on
PostgreSQL, with a per-message workload (v1 DELAY: a row and seven index entries per
message), the server sat idle while the fold ran, and the fold's process waited while the
server wrote. Here the rows of the lanes folded so far go out in chunks as soon as there are
enough of them, and the statement that applies a chunk is in flight while the next lanes
fold (:func:`tracker.store.dialects.start_upsert`); one chunk at a time, as one connection
runs one statement at a time. Everything stays in the flush's one transaction, so a crash
or an error applies nothing, as before. On PostgreSQL a chunk is everything gathered, from
:data:`CHUNK_ROWS` rows (COPY takes any number at once); on SQLite it is one multi-row
statement's worth (:func:`tracker.store.dialects.sqlite_statement_rows`), the entry rows
beyond it waiting for the next lane, so that one statement is in flight behind each lane.

Rows go out in key order across chunks: the lanes are folded in key order (a lane is the
key's prefix) and each chunk is sorted, so two transactions that lock the same rows still
lock them in the same order (PostgreSQL deadlocks otherwise).
"""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.entries import EntryKey
from tracker.domain.tracked_range import RANGE_COLUMN_NAMES, RangeKey

from .dialects import (
    keys_in,
    outlive_statement,
    sqlite_statement_rows,
    start_upsert,
    upsert_rows,
)
from .tables import (
    ENTRY_COLUMN_NAMES,
    ENTRY_UPDATE_COLUMNS,
    KEY_COLUMNS,
    RANGE_KEY_COLUMNS,
    RANGE_UPDATE_COLUMNS,
    ROW_KEY,
    chunks,
    ranges_table,
    tracked,
)

#: Rows gathered before a chunk goes out. Each chunk costs a few round trips (staging,
#: applying); a few thousand rows keep those small next to the rows' own cost, and a flush
#: of ten thousand rows or more in two chunks or more overlaps.
CHUNK_ROWS = 4_000


class FoldedWrites:
    """The writes of one flush, sent in chunks; ``finish`` (or ``abandon``) before commit."""

    def __init__(self, conn: AsyncConnection, key_chunk: int) -> None:
        self._conn = conn
        self._key_chunk = key_chunk
        self.upserts: list[tuple[Any, ...]] = []
        self.deletes: list[EntryKey] = []
        self.range_upserts: list[tuple[Any, ...]] = []
        self.range_deletes: list[RangeKey] = []
        #: the entries' upsert the server is applying, if one is
        self._in_flight: asyncio.Task[Any] | None = None
        #: the most entry rows one chunk sends (None: all gathered; also when a chunk goes)
        self._most: int | None = None
        if conn.dialect.name == "sqlite":
            self._most = sqlite_statement_rows(len(ENTRY_COLUMN_NAMES))
        self.upserted = 0
        self.deleted = 0

    async def lane_folded(self) -> None:
        """Call after each lane: sends a chunk once enough rows are gathered."""
        pending = (
            len(self.upserts)
            + len(self.deletes)
            + len(self.range_upserts)
            + len(self.range_deletes)
        )
        if pending >= (self._most or CHUNK_ROWS):
            await self._send()

    async def finish(self) -> None:
        """Send what is left and wait until the database has applied every chunk."""
        await self._send(last=True)
        await self._settled()

    async def abandon(self) -> None:
        """After a failure: wait for the statement in flight (its outcome no longer
        matters, the transaction rolls back), so that the rollback finds the connection
        free."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            await outlive_statement(task)

    async def _settled(self) -> None:
        task, self._in_flight = self._in_flight, None
        if task is not None:
            await task

    async def _send(self, *, last: bool = False) -> None:
        """Write the gathered rows: the small statements first, the entries' upsert last,
        left in flight (all gathered so far if ``last``, else one chunk's worth)."""
        upserts, self.upserts = self.upserts, []
        upserts.sort(key=ROW_KEY)
        if self._most is not None and not last and len(upserts) > self._most:
            # The first statement's worth now, the rest with the next chunk (whose rows all
            # come later in key order: lanes fold in key order).
            upserts, self.upserts = upserts[: self._most], upserts[self._most :]
        deletes, self.deletes = self.deletes, []
        range_upserts, self.range_upserts = self.range_upserts, []
        range_deletes, self.range_deletes = self.range_deletes, []
        if not (upserts or deletes or range_upserts or range_deletes):
            return
        await self._settled()
        conn = self._conn
        # Many keys per statement (one round trip per chunk), not one statement per key.
        for chunk in chunks(sorted(deletes), self._key_chunk):
            await conn.execute(delete(tracked).where(keys_in(conn.engine, KEY_COLUMNS, chunk)))
        for range_chunk in chunks(sorted(range_deletes), self._key_chunk):
            await conn.execute(
                delete(ranges_table).where(keys_in(conn.engine, RANGE_KEY_COLUMNS, range_chunk))
            )
        if range_upserts:
            range_upserts.sort(key=ROW_KEY)
            await upsert_rows(
                conn, ranges_table, RANGE_COLUMN_NAMES, RANGE_UPDATE_COLUMNS, range_upserts
            )
        if upserts:
            self._in_flight = await start_upsert(
                conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, upserts
            )
        self.upserted += len(upserts) + len(range_upserts)
        self.deleted += len(deletes) + len(range_deletes)
