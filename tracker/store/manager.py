"""The store manager: the only code that talks to the database.

Each public method is one transaction. Driver errors never leak: they become
:class:`StoreUnavailable` (retry later) or :class:`Fenced` (stop acting on those partitions).

Ownership and fencing: each markers partition has a row with an *epoch*. A replica that is
assigned the partition bumps the epoch; every later write for that partition (applying
markers, claiming due entries) first updates the row *where the epoch is still ours*. On
PostgreSQL that update also row-locks the partition, so a takeover and a write serialize; on
SQLite there is one writer anyway. A replica whose epoch moved on gets :class:`Fenced`.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import (
    and_,
    delete,
    func,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracker.domain.entries import Entry, EntryKey, State
from tracker.domain.policy import PolicyLookup
from tracker.domain.ranges import (
    RANGE_COLUMN_NAMES,
    LaneKey,
    LaneMarker,
    RangeKey,
    TrackedRange,
    fold_lane_changes,
    lane_of,
    touched,
)
from tracker.errors import KmqError
from tracker.protocol import RangeMarker
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .counts import CountChanges, recount
from .dialects import (
    create_engine,
    driver_rows,
    insert_ignore,
    is_sqlite,
    keys_in,
    lock_rows_in_order,
    mark_claimed,
    max_bind_rows,
    read_engine,
    upsert_rows,
)
from .due_queries import (
    DUE_AT,
    DUE_QUERY_PARTITIONS,
    ENTRY_WIDTH,
    TOKEN_AT,
    claim_query,
    due_order,
    due_query,
)
from .errors import Fenced, StoreUnavailable
from .port import (
    ApplyResult,
    Claim,
    DeadLetterRecord,
    PartitionProgress,
    PendingMarker,
    StoredPayload,
)
from .tables import (
    ENTRY_COLUMN_NAMES,
    KEY_COLUMNS,
    RANGE_KEY_COLUMNS,
    chunks,
    dead_letters,
    decode_headers,
    encode_headers,
    entry_from_values,
    partitions_table,
    ranges_table,
    row_from_entry,
    tracked,
    tracked_counts,
)

_UPDATE_COLUMNS = ENTRY_COLUMN_NAMES[4:]
_KEY_CHUNK = 500
#: lanes (or spans) per statement of the range-aware loads
_LANE_CHUNK = 100
_RANGE_UPDATE_COLUMNS = RANGE_COLUMN_NAMES[4:]
_RANGE_LANE = (
    ranges_table.c.group_id,
    ranges_table.c.origin_topic,
    ranges_table.c.origin_partition,
)
#: what an entry is counted by (tracker.store.counts)
_COUNT_COLUMNS = (tracked.c.markers_partition, tracked.c.origin_topic, tracked.c.state)
#: how the open offsets of a tracked range are counted (tracker.store.counts)
IN_FLIGHT = State.IN_FLIGHT.value
_ROW_KEY = operator.itemgetter(0, 1, 2, 3)  #: the key of a row of ENTRY_COLUMN_NAMES


def _merge_spans(
    spans: Iterable[tuple[LaneKey, int, int]], gap: int = 1
) -> list[tuple[LaneKey, int, int]]:
    """Spans of one lane merged where less than ``gap`` apart (fewer, simpler queries)."""
    merged: list[tuple[LaneKey, int, int]] = []
    for lane, first, last in sorted(spans):
        if merged and merged[-1][0] == lane and first <= merged[-1][2] + gap:
            if last > merged[-1][2]:
                merged[-1] = (lane, merged[-1][1], last)
        else:
            merged.append((lane, first, last))
    return merged


class Store:
    """All database access of the tracker (and, later, of the admin API)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        #: the same pool, for transactions that only read (they never wait for SQLite's writer)
        self.read_engine = read_engine(engine)
        #: SQLite has one writer at a time. Writers of this process queue here, in order, and
        #: are handed the database the moment the previous one commits; left to SQLite's busy
        #: handler, a waiting writer polls with sleeps of up to 100 ms (a redelivery round's
        #: record waited 150 ms for a 25 ms claim). Other processes still wait on the busy
        #: timeout.
        self._writer: asyncio.Lock | None = asyncio.Lock() if is_sqlite(engine) else None

    @classmethod
    def from_url(cls, url: str, *, echo: bool = False) -> Store:
        return cls(create_engine(url, echo=echo))

    @property
    def is_sqlite(self) -> bool:
        return is_sqlite(self.engine)

    @property
    def _key_chunk(self) -> int:
        """Keys per :func:`keys_in` statement (PostgreSQL takes them as arrays: more)."""
        return _KEY_CHUNK if self.is_sqlite else 10 * _KEY_CHUNK

    async def close(self) -> None:
        await self.engine.dispose()

    @contextlib.asynccontextmanager
    async def transaction(
        self,
        *,
        read_only: bool = False,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> AsyncIterator[AsyncConnection]:
        """One transaction, with driver errors translated to :class:`StoreUnavailable`.

        ``read_only`` transactions never wait for SQLite's write lock (see
        :func:`~tracker.store.dialects.read_engine`). Our own errors (``Fenced``,
        ``StoreUnavailable``, ...) and the driver errors named in ``passthrough`` (the admin
        store's unique-key races, which its callers resolve) pass through untranslated.
        """
        engine = self.read_engine if read_only else self.engine
        writer = None if read_only else self._writer
        try:
            async with writer or contextlib.nullcontext(), engine.begin() as connection:
                yield connection
        except KmqError:
            raise
        except passthrough:
            raise
        except (SQLAlchemyError, OSError, ConnectionError) as exc:
            raise StoreUnavailable(f"database error: {type(exc).__name__}: {exc}") from exc

    async def ping(self) -> None:
        """Raise :class:`StoreUnavailable` unless the database answers."""
        async with self.transaction() as conn:
            await conn.execute(select(1))

    # -- ownership ---------------------------------------------------------------------

    async def claim_partitions(
        self, markers_topic: str, partitions: Iterable[int], owner: str, now_ms: int
    ) -> dict[int, Claim]:
        """Take these markers partitions over: bump their epochs, return where to resume."""
        claims: dict[int, Claim] = {}
        async with self.transaction() as conn:
            for partition in sorted(set(partitions)):
                key = and_(
                    partitions_table.c.markers_topic == markers_topic,
                    partitions_table.c.partition == partition,
                )
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
                    .values(epoch=partitions_table.c.epoch + 1, owner=owner, updated_ms=now_ms)
                    .returning(partitions_table.c.epoch, partitions_table.c.next_offset)
                )
                epoch, next_offset = result.one()
                claims[partition] = Claim(epoch, None if next_offset < 0 else next_offset)
            # The rows are ours and locked now: whatever the previous owners wrote, the
            # counters of these partitions are exact from here on (see tracker.store.counts).
            await recount(
                conn, tracked_counts, tracked, claims, ranges=ranges_table, engine=self.engine
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

    async def _fence_all(
        self, conn: AsyncConnection, markers_topic: str, epochs: dict[int, int], now_ms: int
    ) -> set[int]:
        """:meth:`_fence` without offsets to write: one statement (two on PostgreSQL, whose
        rows are locked in partition order first, as every writer locks them)."""
        p = partitions_table.c
        owned = sorted(epochs.items())
        await lock_rows_in_order(
            conn,
            select(p.partition).where(
                p.markers_topic == markers_topic, p.partition.in_([q for q, _ in owned])
            ),
            p.partition,
        )
        touched = await conn.execute(
            update(partitions_table)
            .where(p.markers_topic == markers_topic, tuple_(p.partition, p.epoch).in_(owned))
            .values(updated_ms=now_ms)
            .returning(p.partition)
        )
        return set(epochs) - {partition for (partition,) in touched}

    # -- ingest ------------------------------------------------------------------------

    async def _load(self, conn: AsyncConnection, keys: Sequence[EntryKey]) -> dict[EntryKey, Entry]:
        found: dict[EntryKey, Entry] = {}
        columns = [tracked.c[name] for name in ENTRY_COLUMN_NAMES]
        for chunk in chunks(keys, self._key_chunk):
            rows = await conn.execute(
                select(*columns).where(keys_in(self.engine, KEY_COLUMNS, chunk))
            )
            for row in rows:
                entry = entry_from_values(row)
                found[entry.key] = entry
        return found

    async def apply(
        self,
        markers_topic: str,
        progress: dict[int, PartitionProgress],
        markers: Sequence[PendingMarker],
        policy_for: PolicyLookup,
        now_ms: int,
    ) -> ApplyResult:
        """Apply markers (in order) and record how far each partition is applied, atomically.

        Markers fold in memory first, per lane (group, origin topic and partition: the unit
        whose markers are ordered), over the entries and tracked ranges they can reach
        (``tracker/domain/ranges.py``): a START followed by its ACK, or a RANGE_START and the
        RANGE_SETTLE of its whole batch, write nothing. Raises :class:`Fenced` (and applies
        nothing) if any partition is no longer ours.
        """
        lanes: dict[LaneKey, list[PendingMarker]] = defaultdict(list)
        for pending in markers:
            lanes[lane_of(pending.marker)].append(pending)
        result = ApplyResult()
        async with self.transaction() as conn:
            fenced = await self._fence(
                conn,
                markers_topic,
                {p: pr.epoch for p, pr in progress.items()},
                now_ms,
                {p: pr.next_offset for p, pr in progress.items()},
            )
            if fenced:
                raise Fenced(fenced)
            if not lanes:
                return result
            entries, ranges = await self._load_lanes(conn, lanes)
            upserts: list[tuple[Any, ...]] = []
            deletes: list[EntryKey] = []
            range_upserts: list[tuple[Any, ...]] = []
            range_deletes: list[RangeKey] = []
            counts = CountChanges()
            earliest: int | None = None
            for lane, pendings in lanes.items():
                changes = fold_lane_changes(
                    entries.get(lane, {}),
                    list(ranges.get(lane, {}).values()),
                    [LaneMarker(p.marker, p.ref_ms, p.markers_partition) for p in pendings],
                    policy_for,
                )
                result.anomalies += [(pendings[i], why) for i, why in changes.anomalies]
                for before, entry in changes.entries_written:
                    upserts.append(row_from_entry(entry))
                    counts.change(before, entry)
                for before in changes.entries_deleted:
                    deletes.append(before.key)
                    counts.change(before, None)
                topic = lane[1]
                for old in changes.ranges_before:
                    counts.add((old.markers_partition, topic, IN_FLIGHT), -old.open_count)
                for new in changes.ranges_after:
                    counts.add((new.markers_partition, topic, IN_FLIGHT), new.open_count)
                range_upserts += [t.row() for t in changes.ranges_written]
                range_deletes += changes.ranges_deleted
                due = changes.earliest_due_ms
                if due is not None and (earliest is None or due < earliest):
                    earliest = due
            result.earliest_due_ms = earliest
            await self._write_folded(conn, upserts, deletes, range_upserts, range_deletes)
            await counts.write(conn, self.engine, tracked_counts)
            result.upserted = len(upserts) + len(range_upserts)
            result.deleted = len(deletes) + len(range_deletes)
        return result

    async def _write_folded(
        self,
        conn: AsyncConnection,
        upserts: list[tuple[Any, ...]],
        deletes: list[EntryKey],
        range_upserts: list[tuple[Any, ...]],
        range_deletes: list[RangeKey],
    ) -> None:
        """Write what a fold changed: entries, then ranges."""
        # Rows are written in key order, as finish_redelivery does: two transactions that
        # lock the same rows in the same order cannot deadlock (PostgreSQL).
        if upserts:
            upserts.sort(key=_ROW_KEY)
            await upsert_rows(conn, tracked, ENTRY_COLUMN_NAMES, _UPDATE_COLUMNS, upserts)
        # Many keys per statement (one round trip per chunk), not one statement per key.
        for chunk in chunks(sorted(deletes), self._key_chunk):
            await conn.execute(delete(tracked).where(keys_in(self.engine, KEY_COLUMNS, chunk)))
        for range_chunk in chunks(sorted(range_deletes), self._key_chunk):
            await conn.execute(
                delete(ranges_table).where(keys_in(self.engine, RANGE_KEY_COLUMNS, range_chunk))
            )
        if range_upserts:
            range_upserts.sort(key=_ROW_KEY)
            await upsert_rows(
                conn, ranges_table, RANGE_COLUMN_NAMES, _RANGE_UPDATE_COLUMNS, range_upserts
            )

    async def _load_lanes(
        self, conn: AsyncConnection, lanes: dict[LaneKey, list[PendingMarker]]
    ) -> tuple[dict[LaneKey, dict[int, Entry]], dict[LaneKey, dict[RangeKey, TrackedRange]]]:
        """Everything the lanes' markers can reach, per lane: entries by origin offset (by key
        and in the ranges' spans) and the tracked ranges overlapping what they touch."""
        keys: list[EntryKey] = []
        spans: list[tuple[LaneKey, int, int]] = []
        reach: list[tuple[LaneKey, int, int]] = []  #: every offset a marker touches
        for lane, pendings in lanes.items():
            for pending in pendings:
                first, last = touched(pending.marker)
                if isinstance(pending.marker, RangeMarker):
                    spans.append((lane, first, last))
                else:
                    keys.append((*lane, first))
                reach.append((lane, first, last))
        loaded = await self._load(conn, list(dict.fromkeys(keys))) if keys else {}
        for span_chunk in chunks(_merge_spans(spans), _LANE_CHUNK):
            columns = [tracked.c[name] for name in ENTRY_COLUMN_NAMES]
            rows = await conn.execute(
                select(*columns).where(
                    or_(
                        *(
                            and_(
                                tracked.c.group_id == g,
                                tracked.c.origin_topic == t,
                                tracked.c.origin_partition == p,
                                tracked.c.origin_offset.between(a, b),
                            )
                            for (g, t, p), a, b in span_chunk
                        )
                    )
                )
            )
            for row in rows:
                entry = entry_from_values(row)
                loaded[entry.key] = entry
        found_ranges: dict[LaneKey, dict[RangeKey, TrackedRange]] = defaultdict(dict)
        columns = [ranges_table.c[name] for name in RANGE_COLUMN_NAMES]
        r = ranges_table.c
        # A range never spans more than MAX_RANGE_WIDTH offsets (it is a subset of one
        # RANGE_START), so the ranges holding any offset of [a, b] start in
        # [a - MAX_RANGE_WIDTH + 1, b]: a bounded walk of the primary key, however many
        # ranges the lane has elsewhere.
        for lane_chunk in chunks(_merge_spans(reach, MAX_RANGE_WIDTH), _LANE_CHUNK):
            rows = await conn.execute(
                select(*columns).where(
                    or_(
                        *(
                            and_(
                                r.group_id == g,
                                r.origin_topic == t,
                                r.origin_partition == p,
                                r.first_offset.between(a - MAX_RANGE_WIDTH + 1, b),
                                r.last_offset >= a,
                            )
                            for (g, t, p), a, b in lane_chunk
                        )
                    )
                )
            )
            for row in rows:
                tracked_range = TrackedRange.from_row(row)
                found_ranges[tracked_range.key[:3]][tracked_range.key] = tracked_range
        entries: dict[LaneKey, dict[int, Entry]] = defaultdict(dict)
        for key, entry in loaded.items():
            entries[key[:3]][key[3]] = entry
        return entries, found_ranges

    # -- redelivery --------------------------------------------------------------------

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

    async def claim_due(
        self,
        markers_topic: str,
        *,
        epochs: dict[int, int],
        due_by: dict[int, int],
        now_ms: int,
        limit: int,
        lease_ms: int,
        token: str,
    ) -> tuple[list[Entry], set[int]]:
        """Claim up to ``limit`` entries due by ``due_by[partition]`` in our partitions.

        ``epochs`` are all partitions we believe we own (each is fenced); only those present
        in ``due_by`` are searched. Claimed entries are pushed to ``now_ms + lease_ms``, so if
        this replica dies while republishing them they become due again for whoever owns the
        partition then. Returns the claimed entries (as they were before the claim) and the
        partitions we turned out to be fenced from.
        """
        async with self.transaction() as conn:
            fenced = await self._fence(conn, markers_topic, epochs, now_ms)
            searched = {p: t for p, t in due_by.items() if p in epochs and p not in fenced}
            if not searched:
                return [], fenced
            await self._expand_due_ranges(conn, searched, limit)
            # SQLite allows 500 terms in a compound SELECT: a few queries for a replica
            # owning hundreds of markers partitions, merged here.
            rows: list[Sequence[Any]] = []
            groups = list(chunks(sorted(searched.items()), DUE_QUERY_PARTITIONS))
            sqlite = conn.dialect.name == "sqlite"
            for group in groups:
                params: dict[str, Any] = {"limit": limit}
                for i, (p, t) in enumerate(group):
                    params[f"p{i}"], params[f"t{i}"] = p, t
                if sqlite:  # read, then mark by rowid (no UPDATE .. FROM .. RETURNING there)
                    rows += await driver_rows(conn, due_query(len(group), "sqlite"), params)
                else:  # one statement marks the rows and returns them as they were
                    params.update(token=token, claimed_due=now_ms + lease_ms)
                    rows += await driver_rows(conn, claim_query(len(group)), params)
            rows.sort(key=due_order)
            if len(groups) > 1:
                # Claimed beyond ``limit`` on PostgreSQL: given back in the same transaction.
                rows, extra = rows[:limit], rows[limit:]
                if extra and not sqlite:
                    await self._unclaim(conn, extra, token)
            if sqlite:
                await mark_claimed(conn, tracked, rows, token=token, due_at_ms=now_ms + lease_ms)
        return [entry_from_values(row[:ENTRY_WIDTH], token) for row in rows], fenced

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

    async def _expand_due_ranges(
        self, conn: AsyncConnection, due_by: dict[int, int], limit: int
    ) -> None:
        """Turn the earliest due ranges, about ``limit`` offsets of them, into entries.

        An expired range redelivers exactly its open offsets, and redelivery is per message
        (every copy is a record of its own, with its own attempt), so this is where a range
        ends: its offsets become ordinary in-flight entries of attempt 1, which the due query
        that follows claims like any other. The counters do not move (in flight either way).

        Ranges are taken in due order until their open offsets reach ``limit`` (at least
        one range): a claim of 1,000 must not turn 1,000 ranges of 500 offsets each into
        half a million rows. Ranges left for later are due no earlier than those taken.
        """
        r = ranges_table.c
        columns = [r[name] for name in RANGE_COLUMN_NAMES]
        candidates: list[TrackedRange] = []
        for group in chunks(sorted(due_by.items()), DUE_QUERY_PARTITIONS):
            rows = await conn.execute(
                select(*columns)
                .where(or_(*(and_(r.markers_partition == p, r.due_at_ms <= t) for p, t in group)))
                .order_by(r.due_at_ms)
                .limit(limit)
            )
            candidates += [TrackedRange.from_row(row) for row in rows]
        if not candidates:
            return
        candidates.sort(key=lambda t: (t.due_at_ms, t.key))
        due: list[TrackedRange] = []
        offsets = 0
        for tracked_range in candidates:
            if offsets >= limit:
                break
            due.append(tracked_range)
            offsets += tracked_range.open_count
        rows_out = sorted(
            (row_from_entry(t.entry_at(offset)) for t in due for offset in t.offsets()),
            key=_ROW_KEY,
        )
        for row_chunk in chunks(rows_out, 5_000):
            await upsert_rows(conn, tracked, ENTRY_COLUMN_NAMES, _UPDATE_COLUMNS, row_chunk)
        for key_chunk in chunks(sorted(t.key for t in due), self._key_chunk):
            await conn.execute(
                delete(ranges_table).where(keys_in(self.engine, RANGE_KEY_COLUMNS, key_chunk))
            )

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
            await lock_rows_in_order(
                conn,
                select(partitions_table.c.partition).where(
                    partitions_table.c.markers_topic == markers_topic,
                    partitions_table.c.partition.in_(sorted(set(partitions))),
                ),
                partitions_table.c.partition,
            )
            counts = CountChanges()
            finished = sorted([*done, *(d.entry.key for d in dead)])
            for chunk in chunks(finished, _KEY_CHUNK):
                gone = await conn.execute(
                    delete(tracked)
                    .where(keys_in(self.engine, KEY_COLUMNS, chunk), tracked.c.claim_token == token)
                    .returning(*_COUNT_COLUMNS)
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
            await counts.write(conn, self.engine, tracked_counts)
            for key, due_ms in sorted(retry):
                await conn.execute(
                    update(tracked)
                    .where(tuple_(*KEY_COLUMNS) == key, tracked.c.claim_token == token)
                    .values(due_at_ms=due_ms, claim_token=None)
                )

    # -- payload copies for long delays --------------------------------------------------

    async def entries_needing_payload(self, partitions: Iterable[int], limit: int) -> list[Entry]:
        owned = sorted(set(partitions))
        if not owned:
            return []
        columns = [tracked.c[name] for name in ENTRY_COLUMN_NAMES]
        async with self.transaction() as conn:
            rows = await conn.execute(
                select(*columns)
                .where(
                    tracked.c.markers_partition.in_(owned),
                    tracked.c.keep_payload.is_(True),
                    tracked.c.payload_stored.is_(False),
                    tracked.c.due_at_ms.is_not(None),
                )
                .limit(limit)
            )
            return [entry_from_values(row) for row in rows]

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

    async def mark_lost(self, items: Sequence[tuple[EntryKey, str]], now_ms: int) -> None:
        """Record entries as lost (their original is gone), whoever claimed them."""
        if not items:
            return
        async with self.transaction() as conn:
            # Lock the entries' markers partitions first, as every writer of entries does
            # (ingest would otherwise overwrite the change with what it read before it).
            partitions: set[int] = set()
            for chunk in chunks([k for k, _ in items], _KEY_CHUNK):
                found = await conn.execute(
                    select(tracked.c.markers_partition)
                    .where(keys_in(self.engine, KEY_COLUMNS, chunk))
                    .distinct()
                )
                partitions.update(p for (p,) in found)
            await lock_rows_in_order(
                conn,
                select(partitions_table.c.partition)
                .where(partitions_table.c.partition.in_(sorted(partitions)))
                .order_by(partitions_table.c.markers_topic),
                partitions_table.c.partition,
            )
            counts = CountChanges()
            await self._mark_lost(conn, sorted(items), now_ms, counts)
            await counts.write(conn, self.engine, tracked_counts)

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
        for chunk in chunks([k for k, _ in items], _KEY_CHUNK):
            rows = await conn.execute(
                select(*KEY_COLUMNS, *_COUNT_COLUMNS).where(
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
            partition, topic, state = before[key]
            counts.add((partition, topic, state), -1)
            counts.add((partition, topic, State.LOST.value), 1)

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
            for chunk in chunks(keys, _KEY_CHUNK):
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

    async def range_holding(self, conn: AsyncConnection, key: EntryKey) -> TrackedRange | None:
        """The tracked range whose open offsets include ``key``'s (at most one)."""
        r = ranges_table.c
        rows = await conn.execute(
            select(*(r[name] for name in RANGE_COLUMN_NAMES)).where(
                r.group_id == key[0],
                r.origin_topic == key[1],
                r.origin_partition == key[2],
                r.first_offset.between(key[3] - MAX_RANGE_WIDTH + 1, key[3]),
                r.last_offset >= key[3],
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
                conn, ranges_table, RANGE_COLUMN_NAMES, _RANGE_UPDATE_COLUMNS, [holder.row()]
            )
        await upsert_rows(
            conn, tracked, ENTRY_COLUMN_NAMES, _UPDATE_COLUMNS, [row_from_entry(entry)]
        )
        return entry

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


PolicyFactory = Callable[[str], PolicyLookup]
