"""The SQL store: the only code that talks to the tracker's database.

:class:`Store` is the SQL adapter of the store port (``tracker.store.port.TrackerStore``).
Each public method is one transaction; driver errors never leak (they become
:class:`StoreUnavailable`, retry later, or :class:`Fenced`, stop acting on those partitions).
It is assembled from one part per responsibility:

* ``database.py`` (:class:`SqlDatabase`): the engine, transactions, error translation;
* ``ownership.py``: claiming and fencing markers partitions (epochs);
* ``marker_apply.py``: applying a flush of markers (the fold's reads and writes);
* ``due_claims.py``: due times, claims and the records of redelivery rounds;
* here: payload copies for long delays, and reading single entries and listings (tests, the
  API's message view).

The admin API's queries live apart (``admin_reads.py`` and its subclasses) and use a
``Store`` for its transactions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Select, func, select, tuple_, update

from tracker.domain.entries import Entry, EntryKey, State
from tracker.domain.tracked_range import RANGE_COLUMN_NAMES, TrackedRange

from .dialects import keys_in
from .due_claims import DueClaims
from .marker_apply import MarkerApply
from .port import StoredPayload
from .tables import (
    ENTRY_COLUMN_NAMES,
    KEY_CHUNK,
    KEY_COLUMNS,
    RANGE_KEY_COLUMNS,
    chunks,
    dead_letters,
    decode_headers,
    encode_headers,
    entry_from_values,
    ranges_table,
    tracked,
)


class Store(MarkerApply, DueClaims):
    """All database access of the tracker's engine."""

    # -- payload copies for long delays --------------------------------------------------

    async def entries_needing_payload(self, partitions: Iterable[int], limit: int) -> list[Entry]:
        """Entries of ``partitions`` whose payload is still to be copied; a read (on SQLite it
        does not take the writer's lock)."""
        owned = sorted(set(partitions))
        if not owned:
            return []
        query = payload_wanted(owned, limit)
        return await self.read(lambda conn: [entry_from_values(row) for row in conn.execute(query)])

    async def store_payloads(self, payloads: Sequence[tuple[EntryKey, StoredPayload]]) -> None:
        async with self.transaction() as conn:
            for key, payload in payloads:
                await conn.execute(
                    update(tracked)
                    .where(tuple_(*KEY_COLUMNS) == key)
                    .values(
                        payload_stored=True,
                        payload_key=payload.key,
                        payload_value=payload.value,
                        payload_headers=encode_headers(payload.headers),
                        payload_timestamp_ms=payload.timestamp_ms,
                    )
                )

    async def load_payloads(self, keys: Sequence[EntryKey]) -> dict[EntryKey, StoredPayload]:
        """The payloads kept in the store for these entries (those that have one).

        Every redelivery round asks, usually about no entry at all: that costs nothing, and
        a question is a read (on SQLite it used to queue for the write lock, behind the
        round's own claim and record, and was a third of a burst round).
        """
        found: dict[EntryKey, StoredPayload] = {}
        if not keys:
            return found
        async with self.transaction(read_only=True) as conn:
            for chunk in chunks(keys, KEY_CHUNK):
                rows = await conn.execute(
                    select(
                        *KEY_COLUMNS,
                        tracked.c.payload_key,
                        tracked.c.payload_value,
                        tracked.c.payload_headers,
                        tracked.c.payload_timestamp_ms,
                    ).where(
                        keys_in(self.engine, KEY_COLUMNS, chunk),
                        tracked.c.payload_stored.is_(True),
                    )
                )
                for row in rows:
                    m = row._mapping
                    found[
                        (
                            m["group_id"],
                            m["origin_topic"],
                            m["origin_partition"],
                            m["origin_offset"],
                        )
                    ] = StoredPayload(
                        m["payload_key"],
                        m["payload_value"],
                        decode_headers(m["payload_headers"]),
                        m["payload_timestamp_ms"] or 0,
                    )
        return found

    # -- inspection (tests, API) -------------------------------------------------------

    async def get_entry(self, key: EntryKey) -> Entry | None:
        """The entry of ``key``: its own row, or what the tracked range holding it stands for."""
        async with self.transaction() as conn:
            found = await self._load(conn, [key])
            if key in found:
                return found[key]
            holder = await self.range_holding(conn, key)
        return None if holder is None else holder.entry_at(key[3])

    async def count_entries(self, state: State | None = None) -> int:
        """Entries, counting every open offset of a tracked range as one in flight."""
        query = select(func.count()).select_from(tracked)
        if state is not None:
            query = query.where(tracked.c.state == state.value)
        in_ranges = select(func.coalesce(func.sum(ranges_table.c.open_count), 0))
        async with self.transaction() as conn:
            total = int(await conn.scalar(query) or 0)
            if state in (None, State.IN_FLIGHT):
                total += int(await conn.scalar(in_ranges) or 0)
            return total

    async def list_entries(self, limit: int = 1000, *, group: str | None = None) -> list[Entry]:
        """Entries in key order, with the open offsets of tracked ranges as entries."""
        columns = [tracked.c[name] for name in ENTRY_COLUMN_NAMES]
        query = select(*columns).order_by(*KEY_COLUMNS).limit(limit)
        range_query = select(*(ranges_table.c[name] for name in RANGE_COLUMN_NAMES))
        if group is not None:
            query = query.where(tracked.c.group_id == group)
            range_query = range_query.where(ranges_table.c.group_id == group)
        async with self.transaction() as conn:
            entries = [entry_from_values(row) for row in await conn.execute(query)]
            for row in await conn.execute(range_query):
                tracked_range = TrackedRange.from_row(row)
                entries += [tracked_range.entry_at(o) for o in tracked_range.offsets()]
        entries.sort(key=lambda e: e.key)
        return entries[:limit]

    async def list_ranges(self) -> list[TrackedRange]:
        """Every tracked range (tests, inspection)."""
        async with self.transaction(read_only=True) as conn:
            rows = await conn.execute(
                select(*(ranges_table.c[name] for name in RANGE_COLUMN_NAMES)).order_by(
                    *RANGE_KEY_COLUMNS
                )
            )
            return [TrackedRange.from_row(row) for row in rows]

    async def list_dead_letters(
        self, limit: int = 1000, *, topic: str | None = None
    ) -> list[dict[str, Any]]:
        query = select(dead_letters).order_by(dead_letters.c.id).limit(limit)
        if topic is not None:
            query = query.where(dead_letters.c.origin_topic == topic)
        async with self.transaction() as conn:
            rows = await conn.execute(query)
            return [dict(row._mapping) for row in rows]


def payload_wanted(partitions: Sequence[int], limit: int) -> Select[Any]:
    """Up to ``limit`` entries of ``partitions`` whose payload is still to be copied, read
    from the partial index ``ix_tracked_payload_wanted`` (migration 0012), which holds only
    those: the payload keeper asks every few seconds, and a scan of 1M entries took 200 ms."""
    return (
        select(*(tracked.c[name] for name in ENTRY_COLUMN_NAMES))
        .where(
            # "+ 0": no term SQLite could walk (markers_partition, due_at_ms) for, every due
            # entry of the partitions; the partial index is what is left to it.
            (tracked.c.markers_partition + 0).in_(partitions),
            tracked.c.keep_payload.is_(True),
            tracked.c.payload_stored.is_(False),
            tracked.c.due_at_ms.is_not(None),
        )
        .limit(limit)
    )
