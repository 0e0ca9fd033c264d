"""Ownership and fencing of markers partitions in the SQL store.

Each markers partition has a row with an *epoch*. A replica that is assigned the partition
bumps the epoch (:meth:`PartitionOwnership.claim_partitions`); every later write for that
partition (applying markers, claiming due entries) first updates the row *where the epoch is
still ours* (:meth:`PartitionOwnership._fence`). On PostgreSQL that update also row-locks the
partition, so a takeover and a write serialize; on SQLite there is one writer anyway. A
replica whose epoch moved on gets :class:`~tracker.store.store_errors.Fenced`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from sqlalchemy import BigInteger, Integer, String, and_, bindparam, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import Select
from sqlalchemy.sql.dml import Update

from .counts import recount
from .database import SqlDatabase
from .dialects import driver_rows, insert_ignore
from .port import Claim
from .tables import partitions_table, ranges_table, tracked, tracked_counts


@functools.cache
def partitions_lock(partitions: int) -> Select[Any]:
    """Locks ``partitions`` markers partitions' rows in partition order (PostgreSQL: ``FOR
    UPDATE``). Parameters ``markers_topic`` and ``p<i>``. Built once per partition count."""
    p = partitions_table.c
    owned = [bindparam(f"p{i}", type_=Integer) for i in range(partitions)]
    return (
        select(p.partition)
        .where(p.markers_topic == bindparam("markers_topic", type_=String), p.partition.in_(owned))
        .order_by(p.partition)
        .with_for_update()
    )


@functools.cache
def fence_touch(partitions: int) -> Update:
    """Touches the rows of ``partitions`` markers partitions whose epoch is still ours,
    returning them. Parameters ``markers_topic``, ``now_ms`` and ``p<i>`` / ``e<i>`` (a
    partition and the epoch we hold for it). Built once per partition count."""
    p = partitions_table.c
    # (partition, epoch) IN ((p0, e0), ...): SQLite parses an OR chain as deep as it is
    # long, and refuses one past 1,000 terms; a list of rows has no such limit.
    ours = [
        tuple_(bindparam(f"p{i}", type_=Integer), bindparam(f"e{i}", type_=BigInteger))
        for i in range(partitions)
    ]
    return (
        update(partitions_table)
        .where(
            p.markers_topic == bindparam("markers_topic", type_=String),
            tuple_(p.partition, p.epoch).in_(ours),
        )
        .values(updated_ms=bindparam("now_ms", type_=BigInteger))
        .returning(p.partition)
    )


class PartitionOwnership(SqlDatabase):
    """Claims, releases and fences markers partitions; reads how far each is applied."""

    async def claim_partitions(
        self, markers_topic: str, partitions: Iterable[int], owner: str, now_ms: int
    ) -> dict[int, Claim]:
        """Take these markers partitions over: bump their epochs, return where to resume."""
        claims: dict[int, Claim] = {}
        uncounted: list[int] = []
        p = partitions_table.c
        async with self.transaction() as conn:
            for partition in sorted(set(partitions)):
                key = and_(p.markers_topic == markers_topic, p.partition == partition)
                await conn.execute(
                    insert_ignore(
                        self.engine,
                        partitions_table,
                        [
                            {
                                "markers_topic": markers_topic,
                                "partition": partition,
                                "epoch": 0,
                                "owner": None,
                                "next_offset": -1,
                                "updated_ms": now_ms,
                            }
                        ],
                    )
                )
                result = await conn.execute(
                    update(partitions_table)
                    .where(key)
                    .values(epoch=p.epoch + 1, owner=owner, updated_ms=now_ms)
                    .returning(p.epoch, p.next_offset, p.counted_epoch)
                )
                epoch, next_offset, counted_epoch = result.one()
                claims[partition] = Claim(epoch, None if next_offset < 0 else next_offset)
                if counted_epoch != epoch - 1:
                    uncounted.append(partition)
            # The rows are ours and locked now. A partition whose previous owner kept its
            # counters (counted_epoch is that owner's epoch) has exact counters already; the
            # others are counted again, whatever an owner of an older version wrote (see
            # tracker.store.counts). From here on this replica keeps them all.
            await recount(conn, tracked_counts, tracked, uncounted, ranges=ranges_table)
            await conn.execute(
                update(partitions_table)
                .where(p.markers_topic == markers_topic, p.partition.in_(sorted(claims)))
                .values(counted_epoch=p.epoch)
            )
        return claims

    async def release_partitions(self, markers_topic: str, epochs: dict[int, int]) -> None:
        """Give partitions up (on revoke or shutdown) if they are still ours."""
        async with self.transaction() as conn:
            for partition, epoch in epochs.items():
                await conn.execute(
                    update(partitions_table)
                    .where(
                        partitions_table.c.markers_topic == markers_topic,
                        partitions_table.c.partition == partition,
                        partitions_table.c.epoch == epoch,
                    )
                    .values(owner=None)
                )

    async def _fence(
        self,
        conn: AsyncConnection,
        markers_topic: str,
        epochs: dict[int, int],
        now_ms: int,
        next_offsets: dict[int, int] | None = None,
    ) -> set[int]:
        """Touch each partition row where the epoch is ours; return the partitions fenced."""
        if next_offsets is None and epochs:
            return await self._fence_all(conn, markers_topic, epochs, now_ms)
        fenced: set[int] = set()
        for partition in sorted(epochs):
            values: dict[str, Any] = {"updated_ms": now_ms}
            if next_offsets is not None and partition in next_offsets:
                values["next_offset"] = next_offsets[partition]
            result = await conn.execute(
                update(partitions_table)
                .where(
                    partitions_table.c.markers_topic == markers_topic,
                    partitions_table.c.partition == partition,
                    partitions_table.c.epoch == epochs[partition],
                )
                .values(**values)
            )
            if result.rowcount != 1:
                fenced.add(partition)
        return fenced

    async def _lock_partitions(
        self, conn: AsyncConnection, markers_topic: str, partitions: Iterable[int]
    ) -> None:
        """Lock these markers partitions' rows in partition order until the transaction ends,
        as every writer of their entries does first (PostgreSQL; SQLite's write transactions
        already run one at a time)."""
        if conn.dialect.name == "sqlite":
            return
        owned = sorted(set(partitions))
        if not owned:
            return
        params: dict[str, Any] = {f"p{i}": partition for i, partition in enumerate(owned)}
        params["markers_topic"] = markers_topic
        await driver_rows(conn, partitions_lock(len(owned)), params)

    async def _fence_all(
        self, conn: AsyncConnection, markers_topic: str, epochs: dict[int, int], now_ms: int
    ) -> set[int]:
        """:meth:`_fence` without offsets to write: one statement (two on PostgreSQL, whose
        rows are locked in partition order first, as every writer locks them).

        Every redelivery round and every claim runs this: the statements are built once per
        partition count (:func:`partitions_lock`, :func:`fence_touch`) and go to the driver
        as they are (building them per call was a tenth of a burst round's claim)."""
        await self._lock_partitions(conn, markers_topic, epochs)
        owned = sorted(epochs.items())
        params: dict[str, Any] = {"markers_topic": markers_topic, "now_ms": now_ms}
        for i, (partition, epoch) in enumerate(owned):
            params[f"p{i}"] = partition
            params[f"e{i}"] = epoch
        touched = await driver_rows(conn, fence_touch(len(owned)), params)
        return set(epochs) - {int(row[0]) for row in touched}

    async def partition_offsets(self, markers_topic: str) -> dict[int, tuple[int, int]]:
        """``{partition: (epoch, next_offset)}`` for a markers topic."""
        async with self.transaction() as conn:
            rows = await conn.execute(
                select(
                    partitions_table.c.partition,
                    partitions_table.c.epoch,
                    partitions_table.c.next_offset,
                ).where(partitions_table.c.markers_topic == markers_topic)
            )
            return {r.partition: (r.epoch, r.next_offset) for r in rows}
