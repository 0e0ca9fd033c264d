"""Redelivery's side of the SQL store: what is due, claiming it, and recording a round.

A round claims due entries (pushing them a lease ahead, so that a replica dying mid-round
leaves them due again for the next owner), claims due tracked ranges as ranges (one row
each, whatever their width: an expired range redelivers exactly its open offsets), and records
the outcome (copied, dead-lettered, lost, retry later) for the entries and ranges still claimed
with its token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import delete, or_, select, true, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.entries import Entry, EntryKey, State
from tracker.domain.range_claims import DueClaim, range_copies, share_of_batch, take_due_ranges
from tracker.domain.tracked_range import RANGE_COLUMN_NAMES, TrackedRange
from tracker.ids import MessageId

from .counts import CountChanges
from .dialects import (
    driver_rows,
    keys_in,
    lock_rows_in_order,
    mark_claimed,
    max_bind_rows,
    upsert_rows,
)
from .due_queries import (
    CLAIMED_RANGES_DELETE,
    DUE_AT,
    DUE_QUERY_PARTITIONS,
    ENTRY_WIDTH,
    TOKEN_AT,
    claim_query,
    due_order,
    due_query,
    due_ranges_query,
    due_times_query,
)
from .ownership import PartitionOwnership
from .port import DeadLetterRecord
from .tables import (
    COUNT_COLUMNS,
    ENTRY_COLUMN_NAMES,
    ENTRY_UPDATE_COLUMNS,
    KEY_CHUNK,
    KEY_COLUMNS,
    RANGE_KEY_COLUMNS,
    RANGE_UPDATE_COLUMNS,
    ROW_KEY,
    chunks,
    dead_letters,
    entry_from_values,
    partitions_table,
    ranges_reaching,
    ranges_table,
    row_from_entry,
    tracked,
    tracked_counts,
)


class DueClaims(PartitionOwnership):
    """Due times, claims and the records of redelivery rounds."""

    async def next_due_ms(self, partitions: Iterable[int]) -> int | None:
        """The earliest due time among entries and ranges of these markers partitions."""
        by_partition = await self.next_due_by_partition(partitions)
        return min(by_partition.values()) if by_partition else None

    async def next_due_by_partition(self, partitions: Iterable[int]) -> dict[int, int]:
        """Per markers partition with anything due, the earliest due time (one query).

        Per partition because each becomes actionable on its own: the tracker acts on a
        partition's entries once it has read that partition's markers far enough.
        """
        owned = sorted(set(partitions))
        if not owned:
            return {}
        # One probe of (markers_partition, due_at_ms) per partition, whatever the table's
        # size: MIN over an IN list scanned every owned row on PostgreSQL (35x slower at 1M
        # entries than at 10k). ORDER BY .. LIMIT 1 rather than MIN, which PostgreSQL turns
        # into that probe only once its statistics say the partition has many rows (see
        # _probes in tracker/store/inspection.py).
        earliest = [
            select(tracked.c.due_at_ms)
            .where(tracked.c.markers_partition == p, tracked.c.due_at_ms.is_not(None))
            .order_by(tracked.c.due_at_ms)
            .limit(1)
            .scalar_subquery()
            for p in owned
        ] + [
            select(ranges_table.c.due_at_ms)
            .where(ranges_table.c.markers_partition == p)
            .order_by(ranges_table.c.due_at_ms)
            .limit(1)
            .scalar_subquery()
            for p in owned
        ]
        async with self.transaction(read_only=True) as conn:
            found = (await conn.execute(select(*earliest))).one()
        out: dict[int, int] = {}
        halves = (found[: len(owned)], found[len(owned) :])
        for p, entry_due, range_due in zip(owned, *halves, strict=True):
            values = [int(v) for v in (entry_due, range_due) if v is not None]
            if values:
                out[p] = min(values)
        return out

    async def copies_falling_due(
        self, partitions: Iterable[int], after_ms: int, until_ms: int, limit: int
    ) -> list[tuple[int, MessageId]]:
        owned = sorted(set(partitions))
        if not owned or until_ms <= after_ms or limit <= 0:
            return []
        t, r = tracked.c, ranges_table.c
        entry_rows = (
            select(t.due_at_ms, t.copy_topic, t.copy_partition, t.copy_offset)
            .where(
                t.markers_partition.in_(owned),
                t.due_at_ms > after_ms,
                t.due_at_ms <= until_ms,
                # a payload kept in the store is read from there, not from Kafka
                or_(t.keep_payload.is_(False), t.payload_stored.is_(False)),
            )
            .order_by(t.due_at_ms)
            .limit(limit)
        )
        range_rows = (
            select(*(r[name] for name in RANGE_COLUMN_NAMES))
            .where(r.markers_partition.in_(owned), r.due_at_ms > after_ms, r.due_at_ms <= until_ms)
            .order_by(r.due_at_ms, *RANGE_KEY_COLUMNS)
            .limit(limit)
        )
        async with self.transaction(read_only=True) as conn:
            found = [
                (int(due), MessageId(topic, partition, offset))
                for due, topic, partition, offset in await conn.execute(entry_rows)
            ]
            due_ranges = [TrackedRange.from_row(row) for row in await conn.execute(range_rows)]
        found += range_copies(due_ranges, limit)
        found.sort()
        return found[:limit]

    async def claim_due_ranges(
        self,
        markers_topic: str,
        *,
        epochs: dict[int, int],
        due_by: dict[int, int],
        now_ms: int,
        limit: int,
        lease_ms: int,
        token: str,
    ) -> DueClaim:
        """Claim up to ``limit`` messages due by ``due_by[partition]`` in our partitions.

        ``epochs`` are all partitions we believe we own (each is fenced); only those present
        in ``due_by`` are searched. Claimed entries and ranges are pushed to ``now_ms +
        lease_ms``, so if this replica dies while republishing them they become due again for
        whoever owns the partition then. Returns them as they were before the claim, and the
        partitions we turned out to be fenced from.
        """
        async with self.transaction() as conn:
            fenced = await self._fence(conn, markers_topic, epochs, now_ms)
            searched = {p: t for p, t in due_by.items() if p in epochs and p not in fenced}
            if not searched:
                return DueClaim([], [], fenced)
            claimed_due = now_ms + lease_ms
            groups = list(chunks(sorted(searched.items()), DUE_QUERY_PARTITIONS))
            sqlite = conn.dialect.name == "sqlite"
            ranges = await self._due_ranges(conn, groups, limit)
            # Due ranges and due entries share the batch in due order. SQLite reads the due
            # entries before it marks them: their due times come with them. PostgreSQL marks
            # them in the statement that finds them: their due times are read first, and
            # only if a range is due at all.
            rows: list[Sequence[Any]] = []
            if sqlite:
                rows = await self._due_rows(conn, groups, limit, None)
                entry_dues = [int(row[DUE_AT]) for row in rows]
            elif ranges:
                entry_dues = await self._due_times(conn, groups, limit)
            else:
                entry_dues = []
            range_share, entry_share = share_of_batch(ranges, entry_dues, limit)
            if not ranges:
                entry_share = limit
            ranged = await self._claim_ranges(
                conn, ranges, range_share, token=token, claimed_due=claimed_due
            )
            if sqlite:  # read, then mark by rowid (no UPDATE .. FROM .. RETURNING there)
                rows = rows[:entry_share]
                await mark_claimed(conn, tracked, rows, token=token, due_at_ms=claimed_due)
            elif entry_share:  # one statement marks the rows and returns them as they were
                rows = await self._due_rows(conn, groups, entry_share, (token, claimed_due))
        claimed = [entry_from_values(row[:ENTRY_WIDTH], token) for row in rows]
        return DueClaim(claimed, ranged, fenced)

    async def _unclaim(
        self, conn: AsyncConnection, rows: Sequence[Sequence[Any]], token: str
    ) -> None:
        """Put rows claimed in excess back as they were (their due time, no token)."""
        for row in rows:
            await conn.execute(
                update(tracked)
                .where(tuple_(*KEY_COLUMNS) == tuple(row[:4]), tracked.c.claim_token == token)
                .values(due_at_ms=row[DUE_AT], claim_token=row[TOKEN_AT])
            )

    async def _due_rows(
        self,
        conn: AsyncConnection,
        groups: Sequence[Sequence[tuple[int, int]]],
        limit: int,
        claim: tuple[str, int] | None,
    ) -> list[Sequence[Any]]:
        """The earliest ``limit`` due entry rows, in claim order; with ``claim`` (token, due:
        PostgreSQL only) marked claimed by the statement that finds them.

        SQLite allows 500 terms in a compound SELECT: a few queries for a replica owning
        hundreds of markers partitions, merged here.
        """
        rows: list[Sequence[Any]] = []
        for group in groups:
            params = _due_params(group, limit)
            if claim is None:
                query = due_query(len(group), conn.dialect.name)
                rows += await driver_rows(conn, query, params)
            else:
                params.update(token=claim[0], claimed_due=claim[1])
                rows += await driver_rows(conn, claim_query(len(group)), params)
        rows.sort(key=due_order)
        if len(groups) > 1:
            rows, extra = rows[:limit], rows[limit:]
            if extra and claim is not None:  # claimed beyond ``limit``: given back
                await self._unclaim(conn, extra, claim[0])
        return rows

    async def _due_times(
        self, conn: AsyncConnection, groups: Sequence[Sequence[tuple[int, int]]], limit: int
    ) -> list[int]:
        """The due times of the earliest ``limit`` due entries (see ``due_times_query``)."""
        dues: list[int] = []
        for group in groups:
            found = await driver_rows(conn, due_times_query(len(group)), _due_params(group, limit))
            dues += [int(row[0]) for row in found]
        return sorted(dues)[:limit]

    async def _due_ranges(
        self, conn: AsyncConnection, groups: Sequence[Sequence[tuple[int, int]]], limit: int
    ) -> list[TrackedRange]:
        """The earliest due tracked ranges, ``limit`` of them at most, in due order."""
        candidates: list[TrackedRange] = []
        for group in groups:
            rows = await driver_rows(conn, due_ranges_query(len(group)), _due_params(group, limit))
            candidates += [TrackedRange.from_row(row) for row in rows]
        return sorted(candidates, key=lambda t: (t.due_at_ms, t.key))[:limit]

    async def _claim_ranges(
        self,
        conn: AsyncConnection,
        candidates: list[TrackedRange],
        share: int,
        *,
        token: str,
        claimed_due: int,
    ) -> list[TrackedRange]:
        """Claim ``share`` offsets of the due ``candidates`` ranges, as ranges.

        A range stays one row while its round runs: the claim writes the token and the lease
        on it, and :meth:`finish_redelivery` deletes it once its copies are out. Only offsets
        the round does not finish (lost, put back) become entries of their own. Returned: the
        claimed pieces as they were (due time), with the token; the round copies each offset
        (a record with its own origin) but plans and tallies the range once
        (``tracker.engine.claimed_ranges``). The range that would cross ``share`` is split
        (``take_due_ranges``): a claim of 1,000 must not take a range of 65,536 offsets into
        one round.
        """
        taken = take_due_ranges(candidates, share, token=token, claimed_due=claimed_due)
        if taken.written:
            rows_out = sorted((t.row() for t in taken.written), key=ROW_KEY)
            for row_chunk in chunks(rows_out, max_bind_rows(self.engine, len(RANGE_COLUMN_NAMES))):
                await upsert_rows(
                    conn, ranges_table, RANGE_COLUMN_NAMES, RANGE_UPDATE_COLUMNS, row_chunk
                )
        return taken.claimed

    async def _dissolve_claimed_ranges(
        self,
        conn: AsyncConnection,
        token: str,
        finished: Sequence[EntryKey],
        counts: CountChanges,
    ) -> list[EntryKey]:
        """Delete the ranges claimed with ``token``; their offsets the round did not finish
        become entries claimed with it (for the lost and put-back paths that follow).

        Offsets settled or split off by markers since the claim are no longer in the ranges
        (a diverged offset took the token into its entry), so nothing here undoes them.
        Returned: the ``finished`` keys the deleted ranges did not hold, the only ones with
        an entry row to delete. An offset a range holds has no entry row (an offset is in a
        range or in an entry, never both), so a round of range copies costs one statement
        here, not a keyed delete per copy.
        """
        gone = await driver_rows(conn, CLAIMED_RANGES_DELETE, {"token": token})
        finished_at: dict[tuple[str, str, int], set[int]] = {}
        for group, topic, partition, offset in finished:
            finished_at.setdefault((group, topic, partition), set()).add(offset)
        held: dict[tuple[str, str, int], set[int]] = {}
        left: list[tuple[object, ...]] = []
        for row in gone:
            tracked_range = TrackedRange.from_row(row)
            lane = (tracked_range.markers_partition, tracked_range.origin_topic)
            count_key = (*lane, tracked_range.group_id, State.IN_FLIGHT.value)
            counts.add(count_key, -tracked_range.open_count)
            origin = (
                tracked_range.group_id,
                tracked_range.origin_topic,
                tracked_range.origin_partition,
            )
            offsets = set(tracked_range.offsets())
            held.setdefault(origin, set()).update(offsets)
            # Only what the round did not finish is made into entries, one by one.
            for offset in sorted(offsets.difference(finished_at.get(origin, ()))):
                left.append(row_from_entry(tracked_range.entry_at(offset)))
                counts.add(count_key, 1)
        for row_chunk in chunks(sorted(left, key=ROW_KEY), 5_000):
            await upsert_rows(conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, row_chunk)
        return [key for key in finished if key[3] not in held.get(key[:3], ())]

    async def finish_redelivery(
        self,
        token: str,
        *,
        markers_topic: str,
        partitions: Iterable[int],
        done: Sequence[EntryKey],
        dead: Sequence[DeadLetterRecord],
        lost: Sequence[tuple[EntryKey, str]],
        retry: Sequence[tuple[EntryKey, int]],
        now_ms: int,
    ) -> None:
        """Record the outcome of a redelivery round for entries claimed with ``token``.

        ``done``: a copy was produced (the entry goes; the copy's START recreates it).
        ``dead``: published to the DLQ. ``lost``: the original is gone (kept, with reason).
        ``retry``: could not act now; due again at the given time.

        ``partitions``: the markers partitions of the claimed entries. Their rows are locked
        first, as every ingest flush (``apply``) does before it writes entries: a flush and a
        round's record on the same partition then run one after the other instead of locking
        the same entry rows in different orders (which PostgreSQL ends with a deadlock, and
        whose victim, if it is this record, leaves copies out and entries claimed).
        """
        async with self.transaction() as conn:
            await self._lock_partitions(conn, markers_topic, partitions)
            counts = CountChanges()
            finished = sorted([*done, *(d.entry.key for d in dead)])
            entries_finished = await self._dissolve_claimed_ranges(conn, token, finished, counts)
            for chunk in chunks(entries_finished, KEY_CHUNK):
                gone = await conn.execute(
                    delete(tracked)
                    .where(keys_in(self.engine, KEY_COLUMNS, chunk), tracked.c.claim_token == token)
                    .returning(*COUNT_COLUMNS)
                )
                for count_key in gone:
                    counts.add(tuple(count_key), -1)
            if dead:
                rows = [
                    {
                        "group_id": d.entry.group_id,
                        "origin_topic": d.entry.origin_topic,
                        "origin_partition": d.entry.origin_partition,
                        "origin_offset": d.entry.origin_offset,
                        "source_topic": d.entry.copy_topic,
                        "source_partition": d.entry.copy_partition,
                        "source_offset": d.entry.copy_offset,
                        "dlq_topic": d.dlq_topic,
                        "dlq_partition": d.dlq_partition,
                        "dlq_offset": d.dlq_offset,
                        "reason": d.reason,
                        "last_error": d.entry.reason,
                        "attempts": d.entry.attempt,
                        "first_seen_ms": d.entry.first_seen_ms,
                        "dead_lettered_ms": d.dead_lettered_ms,
                        "message_key": d.message_key,
                        "redriven_ms": None,
                    }
                    for d in dead
                ]
                for row_chunk in chunks(rows, max_bind_rows(self.engine, 17)):
                    await conn.execute(dead_letters.insert().values(list(row_chunk)))
            await self._mark_lost(conn, sorted(lost), now_ms, counts, token=token)
            await counts.write(conn, tracked_counts)
            for key, due_ms in sorted(retry):
                await conn.execute(
                    update(tracked)
                    .where(tuple_(*KEY_COLUMNS) == key, tracked.c.claim_token == token)
                    .values(due_at_ms=due_ms, claim_token=None)
                )

    async def range_holding(self, conn: AsyncConnection, key: EntryKey) -> TrackedRange | None:
        """The tracked range whose open offsets include ``key``'s (at most one)."""
        r = ranges_table.c
        rows = await conn.execute(
            select(*(r[name] for name in RANGE_COLUMN_NAMES)).where(
                ranges_reaching((key[0], key[1], key[2]), key[3], key[3])
            )
        )
        for row in rows:
            candidate = TrackedRange.from_row(row)
            if candidate.holds(key[3]):
                return candidate
        return None

    async def split_from_range(self, conn: AsyncConnection, key: EntryKey) -> Entry | None:
        """Move ``key`` out of the tracked range holding it into an entry row of its own.

        For a change to one message of a range (an operator action): the offset diverges,
        so it gets the per-message row that v1 would have had all along; the range keeps the
        rest. Call with the entry's markers partition locked. ``None``: no range holds it.
        The counters do not move (in flight either way).
        """
        holder = await self.range_holding(conn, key)
        if holder is None:
            return None
        entry = holder.entry_at(key[3])
        await conn.execute(delete(ranges_table).where(tuple_(*RANGE_KEY_COLUMNS) == holder.key))
        holder.open_bits &= ~(1 << (key[3] - holder.base_offset))
        if holder.open_bits:
            holder.normalize()
            await upsert_rows(
                conn, ranges_table, RANGE_COLUMN_NAMES, RANGE_UPDATE_COLUMNS, [holder.row()]
            )
        await upsert_rows(
            conn, tracked, ENTRY_COLUMN_NAMES, ENTRY_UPDATE_COLUMNS, [row_from_entry(entry)]
        )
        return entry

    async def mark_lost(self, items: Sequence[tuple[EntryKey, str]], now_ms: int) -> None:
        """Record entries as lost (their original is gone), whoever claimed them.

        A key a tracked range holds (a first delivery in flight) is split out of it first, into
        the entry row it stands for, and that entry is marked.
        """
        if not items:
            return
        async with self.transaction() as conn:
            # Lock the entries' markers partitions first, as every writer of entries does
            # (ingest would otherwise overwrite the change with what it read before it).
            partitions: set[int] = set()
            with_rows: set[EntryKey] = set()
            for chunk in chunks([k for k, _ in items], KEY_CHUNK):
                found = await conn.execute(
                    select(tracked.c.markers_partition, *KEY_COLUMNS).where(
                        keys_in(self.engine, KEY_COLUMNS, chunk)
                    )
                )
                for partition, group, topic, origin_partition, offset in found:
                    partitions.add(partition)
                    with_rows.add((group, topic, origin_partition, offset))
            in_ranges: list[EntryKey] = []
            for wanted, _ in items:
                if wanted in with_rows:
                    continue
                holder = await self.range_holding(conn, wanted)
                if holder is not None:
                    partitions.add(holder.markers_partition)
                    in_ranges.append(wanted)
            await lock_rows_in_order(
                conn,
                select(partitions_table.c.partition)
                .where(partitions_table.c.partition.in_(sorted(partitions)))
                .order_by(partitions_table.c.markers_topic),
                partitions_table.c.partition,
            )
            for wanted in in_ranges:  # looked up again under the lock: ingest may have moved it
                await self.split_from_range(conn, wanted)
            counts = CountChanges()
            await self._mark_lost(conn, sorted(items), now_ms, counts)
            await counts.write(conn, tracked_counts)

    async def _mark_lost(
        self,
        conn: AsyncConnection,
        items: Sequence[tuple[EntryKey, str]],
        now_ms: int,
        counts: CountChanges,
        *,
        token: str | None = None,
    ) -> None:
        """Mark ``items`` lost (only those claimed with ``token``, if given), counting it."""
        if not items:
            return
        owned = tracked.c.claim_token == token if token is not None else true()
        before: dict[EntryKey, tuple[Any, ...]] = {}
        for chunk in chunks([k for k, _ in items], KEY_CHUNK):
            rows = await conn.execute(
                select(*KEY_COLUMNS, *COUNT_COLUMNS).where(
                    keys_in(self.engine, KEY_COLUMNS, chunk), owned
                )
            )
            for row in rows:
                before[tuple(row[:4])] = tuple(row[4:])
        for key, reason in items:
            if key not in before:
                continue
            await conn.execute(
                update(tracked)
                .where(tuple_(*KEY_COLUMNS) == key, owned)
                .values(
                    state=State.LOST.value,
                    due_at_ms=None,
                    reason=reason,
                    claim_token=None,
                    updated_ms=now_ms,
                )
            )
            partition, topic, group, state = before[key]
            counts.add((partition, topic, group, state), -1)
            counts.add((partition, topic, group, State.LOST.value), 1)


def _due_params(group: Sequence[tuple[int, int]], limit: int) -> dict[str, Any]:
    """The parameters of ``due_query`` and its kin: ``p<i>``/``t<i>`` (partition, due by)."""
    params: dict[str, Any] = {"limit": limit}
    for i, (p, t) in enumerate(group):
        params[f"p{i}"], params[f"t{i}"] = p, t
    return params
