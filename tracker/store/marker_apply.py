"""Applying a flush of markers to the SQL store: load what the markers can reach, fold per
lane, write what changed, in one fenced transaction.

The fold itself is the domain's (``tracker.domain.ranges.fold_lane_changes``, shared with the
in-memory store); this module is the SQL around it: which rows to read (entries by key and in
the spans of range markers, tracked ranges overlapping any touched offset, both in a bounded
walk of the primary key). Writing the result is ``tracker.store.folded_writes``': chunk by
chunk while later lanes fold, in key order, many keys per statement.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.entries import Entry, EntryKey, State
from tracker.domain.policy import PolicyLookup
from tracker.domain.ranges import fold_lane_changes, lane_of
from tracker.domain.tracked_range import RANGE_COLUMN_NAMES, LaneKey, RangeKey, TrackedRange
from tracker.protocol import RangeMarker
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .counts import CountChanges
from .dialects import keys_in
from .folded_writes import FoldedWrites
from .ownership import PartitionOwnership
from .port import ApplyResult, PartitionProgress, PendingMarker
from .store_errors import Fenced
from .tables import (
    ENTRY_COLUMN_NAMES,
    KEY_COLUMNS,
    chunks,
    entry_from_values,
    ranges_reaching,
    ranges_table,
    row_from_entry,
    tracked,
    tracked_counts,
)

#: lanes (or spans) per statement of the range-aware loads
_LANE_CHUNK = 100
#: v1 markers' offsets of a lane at most this far apart are read as one span: up to this many
#: rows no marker names may be read per gap, in exchange for one index walk instead of many
KEY_SPAN_GAP = 15
#: how the open offsets of a tracked range are counted (tracker.store.counts)
IN_FLIGHT = State.IN_FLIGHT.value


def merge_spans(
    spans: Iterable[tuple[LaneKey, int, int]], gap: int = 1
) -> list[tuple[LaneKey, int, int]]:
    """Spans merged per lane where one starts at most ``gap`` after the one before it ends
    (fewer, simpler queries); sorted by lane and first offset."""
    by_lane: dict[LaneKey, list[tuple[int, int]]] = defaultdict(list)
    for lane, first, last in spans:
        by_lane[lane].append((first, last))
    merged: list[tuple[LaneKey, int, int]] = []
    for lane in sorted(by_lane):
        merged += lane_spans(lane, sorted(by_lane[lane]), gap)
    return merged


def lane_spans(
    lane: LaneKey, spans: Iterable[tuple[int, int]], gap: int
) -> list[tuple[LaneKey, int, int]]:
    """One lane's ``(first, last)`` spans, sorted, merged where one starts at most ``gap``
    after the one before it ends."""
    out: list[tuple[LaneKey, int, int]] = []
    start = end = -1
    for first, last in spans:
        if end >= 0 and first <= end + gap:
            end = max(end, last)
            continue
        if end >= 0:
            out.append((lane, start, end))
        start, end = first, last
    if end >= 0:
        out.append((lane, start, end))
    return out


class MarkerApply(PartitionOwnership):
    """``apply``: markers in, rows and counters out, atomically with the partitions' progress."""

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
            writes = FoldedWrites(conn, self._key_chunk)
            counts = CountChanges()
            earliest: int | None = None
            try:
                # In key order: the rows go out chunk by chunk as lanes fold (FoldedWrites).
                for lane in sorted(lanes):
                    pendings = lanes[lane]
                    changes = fold_lane_changes(
                        entries.get(lane, {}),
                        list(ranges.get(lane, {}).values()),
                        pendings,
                        policy_for,
                    )
                    result.anomalies += [(pendings[i], why) for i, why in changes.anomalies]
                    for before, entry in changes.entries_written:
                        writes.upserts.append(row_from_entry(entry))
                        counts.change(before, entry)
                    for before in changes.entries_deleted:
                        writes.deletes.append(before.key)
                        counts.change(before, None)
                    group, topic = lane[0], lane[1]
                    for old in changes.ranges_before:
                        counts.add(
                            (old.markers_partition, topic, group, IN_FLIGHT), -old.open_count
                        )
                    for new in changes.ranges_after:
                        counts.add((new.markers_partition, topic, group, IN_FLIGHT), new.open_count)
                    writes.range_upserts += [t.row() for t in changes.ranges_written]
                    writes.range_deletes += changes.ranges_deleted
                    due = changes.earliest_due_ms
                    if due is not None and (earliest is None or due < earliest):
                        earliest = due
                    await writes.lane_folded()
                await writes.finish()
            except BaseException:
                await writes.abandon()
                raise
            result.earliest_due_ms = earliest
            await counts.write(conn, tracked_counts)
            result.upserted = writes.upserted
            result.deleted = writes.deleted
        return result

    async def _load_lanes(
        self, conn: AsyncConnection, lanes: dict[LaneKey, list[PendingMarker]]
    ) -> tuple[dict[LaneKey, dict[int, Entry]], dict[LaneKey, dict[RangeKey, TrackedRange]]]:
        """Everything the lanes' markers can reach, per lane: entries at the offsets they touch
        and the tracked ranges overlapping those.

        Entries are read per *span* of a lane, not per key: a flush's v1 markers name runs of
        neighbouring offsets (a consumer's batches), so the offsets of a lane merge into a few
        spans (:data:`KEY_SPAN_GAP`) and each span is one walk of the primary key, with no
        parameter per offset. Rows in a span that no v1 marker names and no range marker
        covers are dropped here (the fold would compare each with itself).
        """
        singles: dict[LaneKey, set[int]] = defaultdict(set)
        spans: list[tuple[LaneKey, int, int]] = []  #: range markers' spans: every row counts
        for lane, pendings in lanes.items():
            offsets = singles[lane]
            for pending in pendings:
                marker = pending.marker
                if isinstance(marker, RangeMarker):
                    spans.append((lane, marker.first_offset, marker.last_offset))
                else:
                    offsets.add(marker.origin_offset)
        single_spans = [
            span
            for lane, offsets in singles.items()
            for span in lane_spans(lane, ((o, o) for o in sorted(offsets)), KEY_SPAN_GAP)
        ]
        covered = merge_spans(spans)
        covered_by_lane: dict[LaneKey, list[tuple[int, int]]] = defaultdict(list)
        for lane, a, b in covered:
            covered_by_lane[lane].append((a, b))
        entries: dict[LaneKey, dict[int, Entry]] = defaultdict(dict)
        for span_chunk in chunks(merge_spans(single_spans + covered), _LANE_CHUNK):
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
                lane = (entry.group_id, entry.origin_topic, entry.origin_partition)
                offset = entry.origin_offset
                if offset in singles[lane] or any(
                    a <= offset <= b for a, b in covered_by_lane.get(lane, ())
                ):
                    entries[lane][offset] = entry
        reach = single_spans + covered  #: every offset a marker touches, and a few between
        found_ranges: dict[LaneKey, dict[RangeKey, TrackedRange]] = defaultdict(dict)
        columns = [ranges_table.c[name] for name in RANGE_COLUMN_NAMES]
        for lane_chunk in chunks(merge_spans(reach, MAX_RANGE_WIDTH), _LANE_CHUNK):
            rows = await conn.execute(
                select(*columns).where(
                    or_(*(ranges_reaching(lane, a, b) for lane, a, b in lane_chunk))
                )
            )
            for row in rows:
                tracked_range = TrackedRange.from_row(row)
                found_ranges[tracked_range.key[:3]][tracked_range.key] = tracked_range
        return entries, found_ranges
