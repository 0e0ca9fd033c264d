"""The store in memory: the :class:`~tracker.store.port.TrackerStore` port over dictionaries.

For tests of engine logic that should run in milliseconds, ours and users' (a consumer team
can run ingest and redelivery against it without a database). It keeps the same rules as the
SQL store, and the contract suite (``tests/contract/test_store_contract.py``) holds both to
them: each call is atomic, epochs fence replicas, markers fold with the same domain function
(:func:`tracker.domain.ranges.fold_lane_changes`), claims push entries to the lease and hand
back what they were, a round's record only changes the entries its token still holds (its
dead letters are recorded whatever: their DLQ records were produced).

Several :class:`InMemoryStore` objects on one :class:`MemoryDatabase` are several replicas on
one database. Nothing is persisted; there is no counter table and no admin side (the admin
API and the console need SQL).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tracker.domain.entries import Entry, EntryKey, State
from tracker.domain.policy import PolicyLookup
from tracker.domain.range_claims import DueClaim, range_copies, share_of_batch, take_due_ranges
from tracker.domain.ranges import fold_lane_changes, lane_of, touched
from tracker.domain.tracked_range import LaneKey, RangeKey, TrackedRange
from tracker.ids import MessageId
from tracker.protocol import RangeMarker
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .port import (
    ApplyResult,
    Claim,
    DeadLetterRecord,
    PartitionProgress,
    PendingMarker,
    StoredPayload,
)
from .store_errors import Fenced, StoreUnavailable


@dataclass(slots=True)
class _PartitionRow:
    epoch: int
    owner: str | None
    next_offset: int  #: -1: nothing applied yet
    updated_ms: int


@dataclass
class MemoryDatabase:
    """What a database would hold: shared by the stores (replicas) built on it."""

    entries: dict[EntryKey, Entry] = field(default_factory=dict)
    #: tracked ranges per lane, by range key (kept as copies: ranges are mutable)
    ranges: dict[LaneKey, dict[RangeKey, TrackedRange]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    partitions: dict[tuple[str, int], _PartitionRow] = field(default_factory=dict)
    payloads: dict[EntryKey, StoredPayload] = field(default_factory=dict)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    #: one writer at a time, as a transaction would have it (calls never interleave)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: set to make every call fail as a database that went away would
    unavailable: bool = False


class InMemoryStore:
    """A :class:`~tracker.store.port.TrackerStore` over a :class:`MemoryDatabase`."""

    def __init__(self, database: MemoryDatabase | None = None) -> None:
        self.database = database if database is not None else MemoryDatabase()

    @property
    def _db(self) -> MemoryDatabase:
        if self.database.unavailable:
            raise StoreUnavailable("the in-memory database is marked unavailable")
        return self.database

    async def ping(self) -> None:
        self._db  # noqa: B018 - raises when unavailable

    async def close(self) -> None:
        pass

    # -- ownership ----------------------------------------------------------------------

    async def claim_partitions(
        self, markers_topic: str, partitions: Iterable[int], owner: str, now_ms: int
    ) -> dict[int, Claim]:
        db = self._db
        claims: dict[int, Claim] = {}
        async with db.lock:
            for partition in sorted(set(partitions)):
                row = db.partitions.setdefault(
                    (markers_topic, partition), _PartitionRow(0, None, -1, now_ms)
                )
                row.epoch += 1
                row.owner = owner
                row.updated_ms = now_ms
                claims[partition] = Claim(
                    row.epoch, None if row.next_offset < 0 else row.next_offset
                )
        return claims

    async def release_partitions(self, markers_topic: str, epochs: dict[int, int]) -> None:
        db = self._db
        async with db.lock:
            for partition, epoch in epochs.items():
                row = db.partitions.get((markers_topic, partition))
                if row is not None and row.epoch == epoch:
                    row.owner = None

    def _fenced(self, markers_topic: str, epochs: dict[int, int]) -> set[int]:
        fenced = set()
        for partition, epoch in epochs.items():
            row = self.database.partitions.get((markers_topic, partition))
            if row is None or row.epoch != epoch:
                fenced.add(partition)
        return fenced

    def _touch(self, markers_topic: str, partitions: Iterable[int], now_ms: int) -> None:
        for partition in partitions:
            self.database.partitions[(markers_topic, partition)].updated_ms = now_ms

    # -- ingest -------------------------------------------------------------------------

    async def apply(
        self,
        markers_topic: str,
        progress: dict[int, PartitionProgress],
        markers: Sequence[PendingMarker],
        policy_for: PolicyLookup,
        now_ms: int,
    ) -> ApplyResult:
        db = self._db
        lanes: dict[LaneKey, list[PendingMarker]] = defaultdict(list)
        for pending in markers:
            lanes[lane_of(pending.marker)].append(pending)
        result = ApplyResult()
        async with db.lock:
            fenced = self._fenced(markers_topic, {p: pr.epoch for p, pr in progress.items()})
            if fenced:
                raise Fenced(fenced)
            # Every lane is folded before anything is written: a fold that fails (a policy
            # lookup that raises) leaves the database as it was, as a rolled-back transaction.
            folded = [
                (
                    lane,
                    pendings,
                    fold_lane_changes(
                        self._entries_reached(lane, pendings),
                        self._ranges_reached(lane, pendings),
                        pendings,
                        policy_for,
                    ),
                )
                for lane, pendings in lanes.items()
            ]
            for partition, pr in progress.items():
                row = db.partitions[(markers_topic, partition)]
                row.next_offset, row.updated_ms = pr.next_offset, now_ms
            earliest: int | None = None
            for lane, pendings, changes in folded:
                result.anomalies += [(pendings[i], why) for i, why in changes.anomalies]
                for _, entry in changes.entries_written:
                    db.entries[entry.key] = entry  # the token too, as the SQL upsert writes it
                for before in changes.entries_deleted:
                    self._delete_entry(before.key)
                for key in changes.ranges_deleted:
                    del db.ranges[lane][key]
                for tracked_range in changes.ranges_written:
                    db.ranges[lane][tracked_range.key] = replace(tracked_range)
                result.upserted += len(changes.entries_written) + len(changes.ranges_written)
                result.deleted += len(changes.entries_deleted) + len(changes.ranges_deleted)
                earliest = _earlier(earliest, changes.earliest_due_ms)
            result.earliest_due_ms = earliest
        return result

    def _ranges_reached(
        self, lane: LaneKey, pendings: Sequence[PendingMarker]
    ) -> list[TrackedRange]:
        """The lane's ranges holding any offset the markers touch (as the SQL store loads)."""
        spans = [touched(p.marker) for p in pendings]
        found = []
        for tracked_range in self.database.ranges.get(lane, {}).values():
            first, last = tracked_range.key[3], tracked_range.last_offset
            if any(a - MAX_RANGE_WIDTH + 1 <= first <= b and last >= a for a, b in spans):
                found.append(tracked_range)
        return found

    def _entries_reached(
        self, lane: LaneKey, pendings: Sequence[PendingMarker]
    ) -> dict[int, Entry]:
        """The lane's entries that its markers can reach, by origin offset."""
        entries = self.database.entries
        found: dict[int, Entry] = {}
        for pending in pendings:
            first, last = touched(pending.marker)
            ranged = isinstance(pending.marker, RangeMarker)
            for offset in range(first, last + 1) if ranged else (first,):
                entry = entries.get((*lane, offset))
                if entry is not None:
                    found[offset] = entry
        return found

    def _delete_entry(self, key: EntryKey) -> None:
        del self.database.entries[key]
        self.database.payloads.pop(key, None)

    # -- redelivery ---------------------------------------------------------------------

    async def next_due_by_partition(self, partitions: Iterable[int]) -> dict[int, int]:
        db = self._db
        owned = set(partitions)
        out: dict[int, int] = {}
        for entry in db.entries.values():
            if entry.markers_partition in owned and entry.due_at_ms is not None:
                p = entry.markers_partition
                out[p] = min(out.get(p, entry.due_at_ms), entry.due_at_ms)
        for by_key in db.ranges.values():
            for tracked_range in by_key.values():
                p = tracked_range.markers_partition
                if p in owned:
                    out[p] = min(out.get(p, tracked_range.due_at_ms), tracked_range.due_at_ms)
        return out

    async def next_due_ms(self, partitions: Iterable[int]) -> int | None:
        by_partition = await self.next_due_by_partition(partitions)
        return min(by_partition.values()) if by_partition else None

    async def copies_falling_due(
        self, partitions: Iterable[int], after_ms: int, until_ms: int, limit: int
    ) -> list[tuple[int, MessageId]]:
        db = self._db
        owned = set(partitions)
        found = [
            (e.due_at_ms, MessageId(e.copy_topic, e.copy_partition, e.copy_offset))
            for key, e in db.entries.items()
            if e.markers_partition in owned
            and e.due_at_ms is not None
            and after_ms < e.due_at_ms <= until_ms
            and not (e.keep_payload and key in db.payloads)
        ]
        due_ranges = [
            tracked_range
            for by_key in db.ranges.values()
            for tracked_range in by_key.values()
            if tracked_range.markers_partition in owned
            and after_ms < tracked_range.due_at_ms <= until_ms
        ]
        due_ranges.sort(key=lambda t: (t.due_at_ms, t.key))
        found += range_copies(due_ranges, limit)
        found.sort()
        return found[: max(0, limit)]

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
        db = self._db
        async with db.lock:
            fenced = self._fenced(markers_topic, epochs)
            self._touch(markers_topic, set(epochs) - fenced, now_ms)
            searched = {p: t for p, t in due_by.items() if p in epochs and p not in fenced}
            if not searched:
                return DueClaim([], [], fenced)
            candidates = [
                t
                for by_key in db.ranges.values()
                for t in by_key.values()
                if t.markers_partition in searched and t.due_at_ms <= searched[t.markers_partition]
            ]
            due = sorted(
                (
                    e
                    for e in db.entries.values()
                    if e.markers_partition in searched
                    and e.due_at_ms is not None
                    and e.due_at_ms <= searched[e.markers_partition]
                ),
                key=lambda e: (e.due_at_ms, *e.key),
            )[:limit]
            # As the SQL store: due ranges and due entries share the batch in due order.
            dues = [e.due_at_ms for e in due if e.due_at_ms is not None]
            range_share, entry_share = share_of_batch(candidates, dues, limit)
            due = due[:entry_share]
            taken = take_due_ranges(
                candidates, range_share, token=token, claimed_due=now_ms + lease_ms
            )
            for tracked_range in taken.written:
                db.ranges[tracked_range.key[:3]][tracked_range.key] = tracked_range
            for entry in due:
                db.entries[entry.key] = replace(
                    entry, claim_token=token, due_at_ms=now_ms + lease_ms
                )
        claimed = [replace(entry, claim_token=token) for entry in due]
        return DueClaim(claimed, [replace(t) for t in taken.claimed], fenced)

    def _dissolve_claimed_ranges(self, token: str, finished: set[EntryKey]) -> None:
        """As the SQL store: the token's ranges go; their unfinished offsets become entries."""
        for by_key in self.database.ranges.values():
            for key, tracked_range in list(by_key.items()):
                if tracked_range.claim_token != token:
                    continue
                del by_key[key]
                for offset in tracked_range.offsets():
                    entry = tracked_range.entry_at(offset)
                    if entry.key not in finished:
                        self.database.entries[entry.key] = entry

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
        db = self._db
        async with db.lock:
            finished = [*done, *(d.entry.key for d in dead)]
            self._dissolve_claimed_ranges(token, set(finished))
            for key in finished:
                entry = db.entries.get(key)
                if entry is not None and entry.claim_token == token:
                    self._delete_entry(key)
            for record in dead:
                db.dead_letters.append(_dead_letter_row(len(db.dead_letters) + 1, record))
            self._mark_lost(lost, now_ms, token=token)
            for key, due_ms in retry:
                entry = db.entries.get(key)
                if entry is not None and entry.claim_token == token:
                    db.entries[key] = replace(entry, due_at_ms=due_ms, claim_token=None)

    async def mark_lost(self, items: Sequence[tuple[EntryKey, str]], now_ms: int) -> None:
        db = self._db
        async with db.lock:
            for key, _ in items:  # as the SQL store: a range-held key is split out first
                if key not in db.entries:
                    self._split_from_range(key)
            self._mark_lost(items, now_ms, token=None)

    def _range_holding(self, key: EntryKey) -> TrackedRange | None:
        """The tracked range whose open offsets include ``key``'s (at most one)."""
        for tracked_range in self.database.ranges.get(key[:3], {}).values():
            if tracked_range.holds(key[3]):
                return tracked_range
        return None

    def _split_from_range(self, key: EntryKey) -> None:
        """Move ``key`` out of the tracked range holding it into an entry of its own."""
        holder = self._range_holding(key)
        if holder is None:
            return
        self.database.entries[key] = holder.entry_at(key[3])
        lane = self.database.ranges[key[:3]]
        del lane[holder.key]
        rest = holder.piece(holder.open_bits & ~(1 << (key[3] - holder.base_offset)))
        if rest.open_bits:
            lane[rest.key] = rest

    def _mark_lost(
        self, items: Sequence[tuple[EntryKey, str]], now_ms: int, *, token: str | None
    ) -> None:
        entries = self.database.entries
        for key, reason in items:
            entry = entries.get(key)
            if entry is None or (token is not None and entry.claim_token != token):
                continue
            entries[key] = replace(
                entry,
                state=State.LOST,
                due_at_ms=None,
                reason=reason,
                claim_token=None,
                updated_ms=now_ms,
            )

    # -- payload copies for long delays -------------------------------------------------------

    async def entries_needing_payload(self, partitions: Iterable[int], limit: int) -> list[Entry]:
        db = self._db
        owned = set(partitions)
        found = [
            e
            for key, e in db.entries.items()
            if e.markers_partition in owned
            and e.keep_payload
            and key not in db.payloads
            and e.due_at_ms is not None
        ]
        return found[:limit]

    async def store_payloads(self, payloads: Sequence[tuple[EntryKey, StoredPayload]]) -> None:
        db = self._db
        async with db.lock:
            for key, payload in payloads:
                if key in db.entries:
                    db.payloads[key] = payload

    async def load_payloads(self, keys: Sequence[EntryKey]) -> dict[EntryKey, StoredPayload]:
        db = self._db
        return {key: db.payloads[key] for key in keys if key in db.payloads}

    # -- inspection ---------------------------------------------------------------------------

    async def get_entry(self, key: EntryKey) -> Entry | None:
        db = self._db
        entry = db.entries.get(key)
        if entry is not None:
            return entry
        holder = self._range_holding(key)
        return None if holder is None else holder.entry_at(key[3])

    async def count_entries(self, state: State | None = None) -> int:
        db = self._db
        total = sum(1 for e in db.entries.values() if state is None or e.state is state)
        if state in (None, State.IN_FLIGHT):
            total += sum(t.open_count for by_key in db.ranges.values() for t in by_key.values())
        return total

    async def list_entries(self, limit: int = 1000, *, group: str | None = None) -> list[Entry]:
        db = self._db
        entries = [e for e in db.entries.values() if group is None or e.group_id == group]
        for lane, by_key in db.ranges.items():
            if group is None or lane[0] == group:
                for t in by_key.values():
                    entries += [t.entry_at(offset) for offset in t.offsets()]
        entries.sort(key=lambda e: e.key)
        return entries[:limit]

    async def list_ranges(self) -> list[TrackedRange]:
        db = self._db
        found = [replace(t) for by_key in db.ranges.values() for t in by_key.values()]
        return sorted(found, key=lambda t: t.key)

    async def list_dead_letters(
        self, limit: int = 1000, *, topic: str | None = None
    ) -> list[dict[str, Any]]:
        db = self._db
        rows = [r for r in db.dead_letters if topic is None or r["origin_topic"] == topic]
        return [dict(r) for r in rows[:limit]]

    async def partition_offsets(self, markers_topic: str) -> dict[int, tuple[int, int]]:
        db = self._db
        return {
            partition: (row.epoch, row.next_offset)
            for (topic, partition), row in db.partitions.items()
            if topic == markers_topic
        }


def _earlier(current: int | None, due_ms: int | None) -> int | None:
    if due_ms is None:
        return current
    return due_ms if current is None or due_ms < current else current


def _dead_letter_row(row_id: int, record: DeadLetterRecord) -> dict[str, Any]:
    """The ``dead_letters`` row the SQL store inserts for ``record``."""
    entry = record.entry
    return {
        "id": row_id,
        "group_id": entry.group_id,
        "origin_topic": entry.origin_topic,
        "origin_partition": entry.origin_partition,
        "origin_offset": entry.origin_offset,
        "source_topic": entry.copy_topic,
        "source_partition": entry.copy_partition,
        "source_offset": entry.copy_offset,
        "dlq_topic": record.dlq_topic,
        "dlq_partition": record.dlq_partition,
        "dlq_offset": record.dlq_offset,
        "reason": record.reason,
        "last_error": entry.reason,
        "attempts": entry.attempt,
        "first_seen_ms": entry.first_seen_ms,
        "dead_lettered_ms": record.dead_lettered_ms,
        "message_key": record.message_key,
        "redriven_ms": None,
    }
