"""The entry counters (``tracked_counts``, migration 0003): how the store keeps them exact.

The topic statistics read how many entries each (markers partition, origin topic, consumer
group, state) holds (migration 0008 added the group) from these counters instead of counting
a table of millions. Every transaction that writes entries gathers its changes in a
:class:`CountChanges` and adds them before it commits, so the counters move with the rows
they count. Not a database trigger: entries are the ingest hot path, and a row trigger cost
~10 us per row on SQLite, a quarter of the unacked ingest rate (dead letters, written at DLQ
rates, do use triggers).

Every writer of an entry holds its markers partition's row lock (fencing, and the admin API's
serialization with ingest), so a transaction's view of the entries it changes is exact.

:func:`recount` makes a partition's counters exact again whatever was written before, by an
owner of an older version that did not count, say. It is a scan of the partition's rows
(~0.35 us per row), so a takeover runs it only where it must: ``markers_partitions.counted_epoch``
(0010) is the epoch of the last owner that kept the counters from its takeover on, and a
replica taking over at epoch ``n`` trusts them when it is ``n - 1`` (its predecessor counted).
An owner of a version before 0010 bumps the epoch without setting it, so the next counting
owner recounts. A future change to what is counted resets ``counted_epoch`` in its migration;
an operator who edited the counters by hand does the same (docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Table, delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.entries import Entry

from .dialects import add_to_counters

#: (markers partition, origin topic, consumer group, state)
CountKey = tuple[int, str, str, str]
#: A counter row's columns: its key (:data:`CountKey`), then the count.
COUNT_ROW = ("markers_partition", "origin_topic", "group_id", "state", "entries")


class CountChanges:
    """Counter deltas of one transaction, written by :meth:`write` before it commits."""

    __slots__ = ("_deltas",)

    def __init__(self) -> None:
        self._deltas: dict[CountKey, int] = {}

    def add(self, key: CountKey, delta: int) -> None:
        self._deltas[key] = self._deltas.get(key, 0) + delta

    def change(self, before: Entry | None, after: Entry | None) -> None:
        """An entry went from ``before`` to ``after`` (``None``: absent)."""
        old = None if before is None else _key(before)
        new = None if after is None else _key(after)
        if old == new:
            return
        if old is not None:
            self.add(old, -1)
        if new is not None:
            self.add(new, 1)

    async def write(self, conn: AsyncConnection, table: Table) -> None:
        """Add the deltas to ``table`` (in key order: PostgreSQL locks rows in that order)."""
        rows = [(*key, n) for key, n in sorted(self._deltas.items()) if n]
        self._deltas.clear()
        await add_to_counters(conn, table, COUNT_ROW, ["entries"], rows)


def _key(entry: Entry) -> CountKey:
    return (entry.markers_partition, entry.origin_topic, entry.group_id, entry.state.value)


async def recount(
    conn: AsyncConnection,
    counts: Table,
    entries: Table,
    partitions: Iterable[int],
    *,
    ranges: Table | None = None,
) -> None:
    """Set the counters of ``partitions`` to a count of their entries.

    The open offsets of tracked ``ranges`` count as in-flight entries (they are: one range
    row stands for one in-flight entry per open offset).

    Call with the partitions' rows locked (as a takeover does), so nobody writes entries of
    theirs meanwhile.
    """
    owned = sorted(set(partitions))
    if not owned:
        return
    await conn.execute(delete(counts).where(counts.c.markers_partition.in_(owned)))
    e = entries.c
    counted = (
        select(e.markers_partition, e.origin_topic, e.group_id, e.state, func.count())
        .where(e.markers_partition.in_(owned))
        .group_by(e.markers_partition, e.origin_topic, e.group_id, e.state)
    )
    await conn.execute(counts.insert().from_select(list(COUNT_ROW), counted))
    if ranges is None:
        return
    r = ranges.c
    summed = await conn.execute(
        select(r.markers_partition, r.origin_topic, r.group_id, func.sum(r.open_count))
        .where(r.markers_partition.in_(owned))
        .group_by(r.markers_partition, r.origin_topic, r.group_id)
    )
    rows = [(p, t, g, "in_flight", int(n)) for p, t, g, n in summed if n]
    await add_to_counters(conn, counts, COUNT_ROW, ["entries"], rows)
