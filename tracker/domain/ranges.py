"""Tracked ranges: in-flight state per fetched batch, split per offset only on divergence.

A v2 RANGE_START (:mod:`tracker.protocol_v2`) puts a whole batch of first deliveries in flight
at once. Keeping one entry per message for it would put back the per-message cost that range
markers remove, so the store keeps it as a :class:`TrackedRange`: one row holding the deadline,
the consumer and a bitmask of the offsets still in flight. A RANGE_SETTLE clears bits; a range
with no bit left is gone. This is what Kafka's ``SharePartition`` does with its in-flight
batches (KIP-932).

Semantics never depend on the representation: a range stands for exactly the per-message
entries that v1 markers would have produced (each covered offset in flight, attempt 1, its own
origin and copy, the range's deadline, consumer and times), and :func:`fold_lane` applies v1
and v2 markers so that :func:`expand` of its result always equals what
:func:`tracker.domain.entries.apply_marker` gives marker by marker (the property test in
``tests/unit/test_range_model.py`` checks exactly that). Where one offset of a range diverges (a
v1 DELAY, REJECT, EXTEND or START for it, an ACK of a copy's origin, an operator action), it
leaves the range and becomes an ordinary per-message entry; a partial RANGE_EXTEND or a START
over offsets of an older range splits the range into ranges with disjoint bits instead.

Ranges of one *lane* (group, topic, partition) may overlap in span but never share an open
offset, and every range is kept *normalized*: bit 0 is set (its first offset is its lowest open
offset), so the first offset identifies a range within its lane.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

from tracker.domain.entries import Entry, apply_marker
from tracker.domain.policy import PolicyLookup
from tracker.domain.tracked_range import LaneKey, RangeKey, TrackedRange
from tracker.domain.value_records import value_record
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker, MarkerKind
from tracker.protocol_v2 import MAX_RANGE_WIDTH, RangeKind, RangeMarker


class FoldInput(Protocol):
    """What the fold needs of a marker: the marker, its reference time, its markers partition.

    The stores pass the markers they were given as they are (``PendingMarker``), not a copy per
    marker: a flush of an acked v1 workload holds ~100k of them.
    """

    @property
    def marker(self) -> AnyMarker: ...

    @property
    def ref_ms(self) -> int: ...

    @property
    def markers_partition(self) -> int: ...


@value_record
class LaneMarker:
    """A marker of one lane with what the fold needs (a :class:`FoldInput` of its own)."""

    marker: AnyMarker
    ref_ms: int
    markers_partition: int


@dataclass(slots=True)
class LaneState:
    """What the store knows of one lane, as far as a flush's markers can touch it.

    ``entries``: per-message entries by origin offset; ``None`` marks one deleted by the fold
    (a row to delete if it was loaded). ``ranges``: the lane's ranges, normalized, disjoint;
    added to with :meth:`add`, looked up with :meth:`holder`.
    """

    entries: dict[int, Entry | None]
    ranges: list[TrackedRange]
    #: No range holds an offset above this (an upper bound of the ranges' last offsets): a
    #: marker past it needs no lookup at all.
    horizon: int = field(init=False)
    #: The range the last v1 START of this fold went into: the next one may join it.
    run: TrackedRange | None = field(init=False, default=None)
    #: The range that held the last offset looked up: markers of one batch come in offset
    #: order, so the next one is usually in it too.
    hint: TrackedRange | None = field(init=False, default=None)
    #: ``ranges`` sorted by first offset as they were when sorted, with the running maximum
    #: of their last offsets (None: sort again before the next lookup). Once in ``ranges``, a
    #: range's open bits only shrink (but a run's, which :meth:`grown` accounts for), so the
    #: spans sorted stay supersets of the spans now; a range that left ``ranges`` holds nothing.
    _sorted: list[TrackedRange] | None = field(init=False, default=None)
    _firsts: list[int] = field(init=False, default_factory=list)
    _reach: list[int] = field(init=False, default_factory=list)
    #: Ranges emptied (:meth:`drop`) but still in ``ranges``.
    _dropped: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.horizon = max((t.last_offset for t in self.ranges), default=-1)

    def add(self, tracked: TrackedRange) -> None:
        """Put a new range (normalized, no open offset shared) into the lane."""
        self.ranges.append(tracked)
        self.horizon = max(self.horizon, tracked.last_offset)
        found = self._sorted
        if found is not None and (not found or tracked.base_offset >= self._firsts[-1]):
            # Above every range sorted (a RANGE_START of the next batch): the order holds.
            found.append(tracked)
            self._firsts.append(tracked.base_offset)
            self._reach.append(max(self._reach[-1] if self._reach else -1, tracked.last_offset))
        else:
            self._sorted = None

    def drop(self, tracked: TrackedRange) -> None:
        """``tracked`` has no open offset left: it leaves the lane.

        It stays in ``ranges`` (holding nothing, it changes no lookup) until the fold ends
        (:meth:`compact`): removing it from the list at once cost a scan of the lane's ranges,
        with an equality test of each, per emptied range.
        """
        self._dropped += 1

    def compact(self) -> None:
        """Take the ranges emptied since the last call out of ``ranges``."""
        if self._dropped:
            self.ranges[:] = [t for t in self.ranges if t.open_bits]
            self._dropped = 0
            self._sorted = None

    def overlapping(self, first: int, last: int) -> list[TrackedRange]:
        """The ranges that may hold an offset in ``first..last`` (a superset, by first offset).

        A range marker used to look at every range of the lane: quadratic in a lane that keeps
        thousands of ranges with a few open offsets each (markers fuzz soak: 58 % of ingest).
        """
        if first > self.horizon or not self.ranges:
            return []
        found = self._sorted_ranges()
        i = bisect.bisect_right(self._firsts, last) - 1
        reach = self._reach
        out: list[TrackedRange] = []
        while i >= 0 and reach[i] >= first:
            tracked = found[i]
            if tracked.open_bits:
                out.append(tracked)
            i -= 1
        out.reverse()
        return out

    def _sorted_ranges(self) -> list[TrackedRange]:
        found = self._sorted
        if found is None:
            found = self._sorted = sorted(self.ranges, key=_first_offset)
            self._firsts = [t.base_offset for t in found]
            reach, top = [], -1
            for tracked in found:
                top = max(top, tracked.last_offset)
                reach.append(top)
            self._reach = reach
        return found

    def grown(self, tracked: TrackedRange) -> None:
        """``tracked`` (in the lane) got open offsets above every range's."""
        self.horizon = tracked.last_offset
        found = self._sorted
        if found and found[-1] is tracked:
            self._reach[-1] = max(self._reach[-1], tracked.last_offset)
        else:
            self._sorted = None

    def holder(self, offset: int) -> TrackedRange | None:
        """The range holding ``offset``, if any.

        A look at the last range found, then a binary search: a flush of many runs of v1
        STARTs makes a range each, and a scan of the lane's ranges per marker made the ACKs
        that follow them quadratic (54 us per marker over a thousand ranges, out of order).
        """
        if offset > self.horizon:
            return None
        hint = self.hint
        if hint is not None and hint.holds(offset):
            return hint
        found = self._sorted_ranges()
        i = bisect.bisect_right(self._firsts, offset) - 1
        while i >= 0 and self._reach[i] >= offset:
            tracked = found[i]
            if tracked.holds(offset):
                self.hint = tracked
                return tracked
            i -= 1
        return None


def _first_offset(tracked: TrackedRange) -> int:
    return tracked.base_offset


def lane_of(marker: AnyMarker) -> LaneKey:
    return (marker.group, marker.origin_topic, marker.origin_partition)


def touched(marker: AnyMarker) -> tuple[int, int]:
    """The span of origin offsets ``marker`` can change: ``(first, last)``."""
    if isinstance(marker, RangeMarker):
        return marker.first_offset, marker.last_offset
    return marker.origin_offset, marker.origin_offset


def fold_lane(
    state: LaneState, markers: Sequence[FoldInput], policy_for: PolicyLookup
) -> list[tuple[int, str]]:
    """Apply ``markers`` (in order) to ``state`` in place; return ``(index, anomaly)`` pairs.

    ``state`` must hold every entry and range that the markers' spans (:func:`touched`) reach.
    A v1 START and the ACK that settles it (:func:`settled_starts`) fold to nothing without an
    entry in between where the store holds nothing for their offset, the common case of a
    consumer that acks within the coalescing window.
    """
    anomalies: list[tuple[int, str]] = []
    settles = settled_starts(markers)
    skipped: set[int] = set()
    for index, item in enumerate(markers):
        marker = item.marker
        if type(marker) is RangeMarker:
            why = _fold_range(state, marker, item, policy_for)
        else:
            if settles:
                if index in skipped:
                    continue
                ack = settles.get(index)
                if ack is not None and _holds_nothing(state, cast(Marker, marker).origin_offset):
                    # START then ACK of the same attempt on nothing: no entry before, none after.
                    skipped.add(ack)
                    continue
            why = _fold_single(state, cast(Marker, marker), item, policy_for)
        if why is not None:
            anomalies.append((index, why))
    state.compact()
    return anomalies


def settled_starts(markers: Sequence[FoldInput]) -> dict[int, int]:
    """``{index of a v1 START: index of its ACK}``, for each START whose offset's next marker
    in ``markers`` (one lane's, in order) is an ACK of the same attempt.

    Such a pair leaves exactly what an ACK alone on the state before the START would, when
    that state holds no entry and no range for the offset (the fold checks that when it
    reaches the START): the START makes an entry, the ACK removes it, neither is an anomaly.
    A range marker can reach any offset between the two, so a lane with range markers in the
    flush folds marker by marker (``{}``).
    """
    started: dict[int, int] = {}  # offset -> index of a START not followed yet for it
    settles: dict[int, int] = {}
    start, ack = MarkerKind.START, MarkerKind.ACK
    for index, item in enumerate(markers):
        marker = item.marker
        if type(marker) is RangeMarker:
            return {}
        single = cast(Marker, marker)
        offset = single.origin_offset
        kind = single.kind
        before = started.pop(offset, None)
        if (
            before is not None
            and kind is ack
            and single.attempt == cast(Marker, markers[before].marker).attempt
        ):
            settles[before] = index
        if kind is start:
            started[offset] = index
    return settles


def _holds_nothing(state: LaneState, offset: int) -> bool:
    if state.entries.get(offset) is not None:
        return False
    return not state.ranges or state.holder(offset) is None


@dataclass(slots=True)
class LaneChanges:
    """What folding a flush's markers into one lane changed: what a store must write.

    Every store (SQL, in memory) applies markers through :func:`fold_lane_changes`, so they
    write the same things for the same markers.
    """

    #: ``(index of the marker, why it was not applied)``
    anomalies: list[tuple[int, str]] = field(default_factory=list)
    #: entries new or changed: ``(as it was or None, as it is now)``
    entries_written: list[tuple[Entry | None, Entry]] = field(default_factory=list)
    #: entries the fold removed, as they were
    entries_deleted: list[Entry] = field(default_factory=list)
    #: every range the markers could reach, as it was; then every range of the lane after
    ranges_before: list[TrackedRange] = field(default_factory=list)
    ranges_after: list[TrackedRange] = field(default_factory=list)
    #: ranges new or changed, and the keys of those that are gone
    ranges_written: list[TrackedRange] = field(default_factory=list)
    ranges_deleted: list[RangeKey] = field(default_factory=list)
    #: the earliest due time among what was written (None: nothing due was written)
    earliest_due_ms: int | None = None


def fold_lane_changes(
    entries: Mapping[int, Entry],
    ranges: Sequence[TrackedRange],
    markers: Sequence[FoldInput],
    policy_for: PolicyLookup,
) -> LaneChanges:
    """Fold ``markers`` (of one lane) into the lane's ``entries`` (by origin offset) and
    ``ranges`` as the store holds them, and say what changed. The store passes everything the
    markers' spans reach (:func:`touched`); the arguments are not modified."""
    state = LaneState(dict(entries), [replace(t) for t in ranges])
    changes = LaneChanges(anomalies=fold_lane(state, markers, policy_for))
    earliest: int | None = None
    for offset, entry in state.entries.items():
        before = entries.get(offset)
        if entry is None:
            if before is not None:
                changes.entries_deleted.append(before)
        elif entry != before:
            changes.entries_written.append((before, entry))
            if entry.due_at_ms is not None and (earliest is None or entry.due_at_ms < earliest):
                earliest = entry.due_at_ms
    before_ranges = {t.key: t for t in ranges}
    after_ranges = {t.key: t for t in state.ranges}
    changes.ranges_before = list(ranges)
    changes.ranges_after = list(state.ranges)
    changes.ranges_deleted = [key for key in before_ranges if key not in after_ranges]
    for key, new in after_ranges.items():
        if before_ranges.get(key) != new:
            changes.ranges_written.append(new)
            if earliest is None or new.due_at_ms < earliest:
                earliest = new.due_at_ms
    changes.earliest_due_ms = earliest
    return changes


def _take_from_range(state: LaneState, tracked: TrackedRange, offset: int) -> Entry:
    """Split ``offset`` out of ``tracked`` into a per-message entry (divergence)."""
    entry = tracked.entry_at(offset)
    tracked.open_bits &= ~(1 << (offset - tracked.base_offset))
    if tracked.open_bits:
        tracked.normalize()
    else:
        state.drop(tracked)
    return entry


def _fold_single(
    state: LaneState, marker: Marker, item: FoldInput, policy_for: PolicyLookup
) -> str | None:
    offset = marker.origin_offset
    entry = state.entries.get(offset)
    if entry is None:
        if offset > state.horizon and _first_delivery_start(marker):
            _start_in_run(state, marker, item, policy_for)
            return None
        tracked = state.holder(offset)
        if tracked is not None:
            entry = _take_from_range(state, tracked, offset)
    after, why = apply_marker(entry, marker, item.ref_ms, item.markers_partition, policy_for)
    if after is not None or offset in state.entries or entry is not None:
        state.entries[offset] = after
    return why


def _first_delivery_start(marker: Marker) -> bool:
    """A v1 START of a first delivery (attempt 1, the record is its own origin): the entry it
    makes is exactly what a range stands for at its offset (``TrackedRange.entry_at``)."""
    return (
        marker.kind is MarkerKind.START
        and marker.attempt == 1
        and marker.offset == marker.origin_offset
        and marker.partition == marker.origin_partition
        and marker.topic == marker.origin_topic
    )


def _start_in_run(
    state: LaneState, marker: Marker, item: FoldInput, policy_for: PolicyLookup
) -> None:
    """A v1 START of a first delivery on an offset past every range: kept in a range.

    A v1 consumer STARTs its batch one message at a time, but the markers of one batch share
    their timestamp (one produce batch: the broker's time with ``LogAppendTime``, the
    producer's millisecond otherwise), their lease and their consumer, so the entries they
    make differ only by offset: exactly what one range stands for. The START joins the range
    the START before it went into when everything but the offset is equal, and starts a new
    range otherwise. Nothing the tracker does depends on the representation (the property
    tests of ``tests/unit/test_range_model.py``), but the store then writes, claims and
    redelivers a run of v1 STARTs as one row, as it does a v2 RANGE_START: per batch, not
    per message. Only STARTs past every range (``state.horizon``) join, so none needs a look
    through the lane's ranges and the bits of a run only grow upwards (it stays normalized).
    """
    offset = marker.origin_offset
    ref = item.ref_ms
    due = ref + (marker.timeout_ms or policy_for(marker.origin_topic).processing_timeout_ms)
    run = state.run
    if (
        run is not None
        and run.open_bits  # still in the lane (a range leaves it only when emptied)
        and run.due_at_ms == due
        and run.first_seen_ms == ref
        and run.updated_ms == ref
        and run.consumer == marker.consumer
        and run.markers_partition == item.markers_partition
        and run.claim_token is None
        and offset - run.base_offset < MAX_RANGE_WIDTH
    ):
        run.open_bits |= 1 << (offset - run.base_offset)
        state.grown(run)
    else:
        run = TrackedRange(
            marker.group,
            marker.origin_topic,
            marker.origin_partition,
            item.markers_partition,
            offset,
            1,
            due,
            ref,
            ref,
            marker.consumer,
        )
        state.add(run)
        state.run = run


def _fold_range(
    state: LaneState, marker: RangeMarker, item: FoldInput, policy_for: PolicyLookup
) -> str | None:
    base = marker.first_offset
    last = marker.last_offset
    covered = marker.covered
    kind = marker.kind
    ref = item.ref_ms
    # Offsets with a per-message entry diverged before: they follow the v1 rules one by one.
    for offset, entry in _entries_within(state.entries, base, last):
        if not (covered >> (offset - base)) & 1:
            continue
        covered &= ~(1 << (offset - base))
        single = _as_single(marker, offset)
        after, _why = apply_marker(entry, single, ref, item.markers_partition, policy_for)
        state.entries[offset] = after
    if kind is RangeKind.RANGE_START:
        _start(state, marker, covered, item, policy_for)
        return None
    for tracked in state.overlapping(base, last):
        hit = tracked.aligned(covered, base)
        if not hit:
            continue
        covered &= ~tracked.to_frame(hit, base)
        if kind is RangeKind.RANGE_SETTLE:
            tracked.open_bits &= ~hit
        elif hit == tracked.open_bits:  # RANGE_EXTEND of every open offset: one new deadline
            tracked.due_at_ms = ref + marker.timeout_ms
            tracked.updated_ms = ref
            continue
        else:  # a partial extension splits the range
            tracked.open_bits &= ~hit
            state.add(tracked.piece(hit, due_at_ms=ref + marker.timeout_ms, updated_ms=ref))
        if tracked.open_bits:
            tracked.normalize()
        else:
            state.drop(tracked)
    # What is left was covered by the marker but had no entry at all (v1 reports each).
    missing = covered.bit_count()
    if missing:
        what = "ACK" if kind is RangeKind.RANGE_SETTLE else "EXTEND"
        return (
            f"{kind.name}: {missing} of {marker.covered.bit_count()} offsets had no START "
            f"({what} late, duplicate, or for an expired lease)"
        )
    return None


def _entries_within(
    entries: dict[int, Entry | None], first: int, last: int
) -> list[tuple[int, Entry]]:
    """The live entries of offsets ``first..last``: by looking up each offset or by looking
    at each entry, whichever is fewer (a lane's flush may hold thousands of open entries, and
    each range marker looked at all of them)."""
    if last - first < len(entries):
        get = entries.get
        return [(o, e) for o in range(first, last + 1) if (e := get(o)) is not None]
    return [(o, e) for o, e in entries.items() if e is not None and first <= o <= last]


def _start(
    state: LaneState,
    marker: RangeMarker,
    covered: int,
    item: FoldInput,
    policy_for: PolicyLookup,
) -> None:
    """A RANGE_START over ``covered`` offsets that have no per-message entry."""
    base = marker.first_offset
    ref = item.ref_ms
    due = ref + (marker.timeout_ms or policy_for(marker.topic).processing_timeout_ms)
    for tracked in state.overlapping(base, marker.last_offset):
        hit = tracked.aligned(covered, base)
        if not hit:
            continue
        # v1 START on an entry in flight keeps its first-seen time: those offsets move to a
        # range of their own that keeps it.
        covered &= ~tracked.to_frame(hit, base)
        tracked.open_bits &= ~hit
        moved = TrackedRange(
            tracked.group_id,
            tracked.origin_topic,
            tracked.origin_partition,
            item.markers_partition,
            tracked.base_offset,
            hit,
            due,
            tracked.first_seen_ms,
            ref,
            marker.consumer,
        )
        moved.normalize()
        state.add(moved)
        if tracked.open_bits:
            tracked.normalize()
        else:
            state.drop(tracked)
    if covered:
        fresh = TrackedRange(
            marker.group,
            marker.topic,
            marker.partition,
            item.markers_partition,
            base,
            covered,
            due,
            ref,
            ref,
            marker.consumer,
        )
        fresh.normalize()
        state.add(fresh)


def _as_single(marker: RangeMarker, offset: int) -> Marker:
    """The v1 marker a range marker stands for at ``offset``."""
    message = MessageId(marker.topic, marker.partition, offset)
    if marker.kind is RangeKind.RANGE_START:
        return Marker.start(
            marker.group, message, timeout_ms=marker.timeout_ms, consumer=marker.consumer
        )
    if marker.kind is RangeKind.RANGE_SETTLE:
        return Marker.ack(marker.group, message)
    return Marker.extend(marker.group, message, timeout_ms=marker.timeout_ms)


def expand(state: LaneState) -> dict[int, Entry]:
    """Every entry ``state`` stands for, per message (what v1 markers would have made)."""
    out = {offset: entry for offset, entry in state.entries.items() if entry is not None}
    for tracked in state.ranges:
        for offset in tracked.offsets():
            if offset in out:
                raise AssertionError(f"offset {offset} is both an entry and in a range")
            out[offset] = tracked.entry_at(offset)
    return out


__all__ = [
    "FoldInput",
    "LaneMarker",
    "LaneState",
    "expand",
    "fold_lane",
    "lane_of",
    "settled_starts",
    "touched",
]
