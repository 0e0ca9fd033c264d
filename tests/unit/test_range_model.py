"""Range markers and tracked ranges against the per-message reference model (pure, no I/O).

The reference is v1 itself: every range marker is, by definition (docs/protocol.md), one v1
marker per covered offset, and :func:`apply_marker` folds those message by message. The range
fold must stand for exactly the same entries after every marker: same state, attempt, deadline
or due time, consumer, times, reason; hence the same redelivery and dead-letter decisions.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.range_model import (
    GROUP,
    MARKERS_PARTITION,
    PARTITION,
    TOPIC,
    as_v1,
    markers_strategy,
    policy,
    range_markers,
    reference,
    reference_step,
    single_markers,
    steps_with_times,
)

from tracker.domain.entries import Entry, State, entry_key, plan_due
from tracker.domain.ranges import LaneMarker, LaneState, expand, fold_lane
from tracker.domain.tracked_range import TrackedRange
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker
from tracker.protocol_v2 import RangeKind, RangeMarker

pytestmark = pytest.mark.unit


def check_state(state: LaneState) -> None:
    """The representation's own invariants: normalized, disjoint ranges; no empty range."""
    seen: set[int] = set()
    for tracked in state.ranges:
        assert tracked.open_bits & 1, "a range must start at its lowest open offset"
        for offset in tracked.offsets():
            assert offset not in seen, f"offset {offset} is in two ranges"
            assert state.entries.get(offset) is None, f"offset {offset} is entry and range"
            seen.add(offset)
    assert len({t.key for t in state.ranges}) == len(state.ranges)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(markers_strategy)
def test_ranges_stand_for_exactly_the_per_message_entries(
    drawn: list[tuple[AnyMarker, int]],
) -> None:
    steps = steps_with_times(drawn)
    state = LaneState({}, [])
    for i, (marker, ref) in enumerate(steps):
        fold_lane(state, [LaneMarker(marker, ref, MARKERS_PARTITION)], policy)
        check_state(state)
        assert expand(state) == reference(steps[: i + 1]), f"after step {i}: {marker}"


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(markers_strategy)
def test_one_fold_of_many_markers_equals_one_by_one(drawn: list[tuple[AnyMarker, int]]) -> None:
    """The store folds a whole flush at once: the result must not depend on the batching."""
    steps = steps_with_times(drawn)
    state = LaneState({}, [])
    fold_lane(state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in steps], policy)
    check_state(state)
    assert expand(state) == reference(steps)


@st.composite
def v1_flushes(draw: st.DrawFn) -> list[tuple[AnyMarker, int]]:
    """v1 markers in which many STARTs are followed, some markers later, by their ACK (and
    now and then a range marker in between)."""
    kinds: st.SearchStrategy[AnyMarker] = single_markers()
    mixed = draw(st.booleans())
    if mixed:
        kinds = st.one_of(single_markers(), single_markers(), range_markers())
    drawn: list[tuple[AnyMarker, int]] = draw(
        st.lists(st.tuples(kinds, st.integers(0, 50)), max_size=30)
    )
    for i in reversed(range(len(drawn))):
        marker = drawn[i][0]
        if isinstance(marker, Marker) and marker.kind.name == "START" and draw(st.booleans()):
            ack = Marker.ack(GROUP, marker.message, attempt=marker.attempt, origin=marker.origin)
            at = draw(st.integers(i + 1, len(drawn)))
            drawn.insert(at, (ack, draw(st.integers(0, 50))))
            if mixed and draw(st.booleans()):  # a range marker between the two, over them
                between = draw(st.integers(i + 1, at))
                drawn.insert(between, (draw(range_over(marker.origin_offset)), 0))
    return drawn


@st.composite
def range_over(draw: st.DrawFn, offset: int) -> RangeMarker:
    """A range marker of any kind whose span covers ``offset``."""
    first = draw(st.integers(max(0, offset - 8), offset))
    last = draw(st.integers(offset, offset + 8))
    kind = draw(st.sampled_from(RangeKind))
    timeout = 60_000 if kind is RangeKind.RANGE_EXTEND else 0
    return RangeMarker(kind, GROUP, TOPIC, PARTITION, first, last, 0, timeout, "c3")


def reference_anomalies(
    entries: dict[int, Entry], steps: list[tuple[AnyMarker, int]]
) -> list[tuple[int, str | None]]:
    """The anomalies of ``steps`` applied one by one to ``entries`` (modified), as v1 says:
    a v1 marker's own; for a range SETTLE or EXTEND, that an offset it covers had no entry
    (``None``: the fold words it per range)."""
    out: list[tuple[int, str | None]] = []
    for index, (marker, ref) in enumerate(steps):
        if isinstance(marker, RangeMarker):
            missing = any(entries.get(m.offset) is None for m in marker.messages())
            for single in as_v1(marker):
                reference_step(entries, single, ref)
            if missing and marker.kind is not RangeKind.RANGE_START:
                out.append((index, None))
            continue
        why = reference_step(entries, marker, ref)
        if why is not None:
            out.append((index, why))
    return out


#: what the lane holds before the flush: a few markers, so that many offsets hold nothing
few_markers = st.lists(
    st.tuples(st.one_of(range_markers(), single_markers()), st.integers(0, 50)), max_size=8
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(few_markers, v1_flushes())
def test_a_flush_of_v1_markers_folds_as_one_by_one(
    before: list[tuple[AnyMarker, int]], drawn: list[tuple[AnyMarker, int]]
) -> None:
    """A flush of v1 markers on a lane that already holds entries and ranges: the fold
    settles a START and its ACK without making an entry (``settled_starts``) where the lane
    holds nothing for the offset; what it leaves and every anomaly it reports must be v1's,
    marker by marker."""
    steps = steps_with_times(before + drawn)
    prefix, flush = steps[: len(before)], steps[len(before) :]
    state = LaneState({}, [])
    for marker, ref in prefix:
        fold_lane(state, [LaneMarker(marker, ref, MARKERS_PARTITION)], policy)
    anomalies = fold_lane(
        state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in flush], policy
    )
    check_state(state)
    assert expand(state) == reference(steps)
    ranges = {i for i, (m, _) in enumerate(flush) if isinstance(m, RangeMarker)}
    got = [(i, None if i in ranges else why) for i, why in anomalies]
    assert got == reference_anomalies(reference(prefix), flush)


def test_a_start_and_its_ack_on_nothing_make_no_entry() -> None:
    """The common case of an acked v1 workload costs no entry per message."""
    steps: list[AnyMarker] = []
    for offset in range(100, 110):
        message = MessageId(TOPIC, PARTITION, offset)
        steps += [Marker.start(GROUP, message, consumer="c1"), Marker.ack(GROUP, message)]
    state = LaneState({}, [])
    anomalies = fold_lane(
        state, [LaneMarker(m, 1000 + i, MARKERS_PARTITION) for i, m in enumerate(steps)], policy
    )
    assert (state.entries, state.ranges, anomalies) == ({}, [], [])


def _v1_starts(
    offsets: range | list[int], ref_of: dict[int, int] | None = None
) -> list[tuple[AnyMarker, int]]:
    return [
        (
            Marker.start(GROUP, MessageId(TOPIC, PARTITION, o), timeout_ms=2_000, consumer="c1"),
            (ref_of or {}).get(o, 1000),
        )
        for o in offsets
    ]


def test_v1_starts_of_one_batch_are_kept_as_one_range() -> None:
    """A v1 consumer STARTs its batch message by message, but the markers share their
    timestamp, lease and consumer: the store keeps them as one range (one row, one claim),
    standing for exactly the entries the STARTs make one by one."""
    steps = _v1_starts(range(100, 600))
    state = LaneState({}, [])
    fold_lane(state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in steps], policy)
    check_state(state)
    assert state.entries == {}
    [run] = state.ranges
    assert (run.base_offset, run.last_offset, run.open_count) == (100, 599, 500)
    assert expand(state) == reference(steps)


def test_a_v1_start_that_differs_begins_a_new_range_and_late_ones_stay_entries() -> None:
    """A new range where the timestamp (or lease, or consumer) changes; a START below the
    lane's ranges (out of order) or of a redelivered copy is a per-message entry, as before."""
    steps = _v1_starts([10, 11, 12, 13, 14, 15], {13: 1001, 14: 1001, 15: 1001})
    steps += _v1_starts([5])  # below the ranges: folded one by one
    copy = Marker.start(
        GROUP, MessageId(TOPIC, 0, 900), attempt=2, origin=MessageId(TOPIC, PARTITION, 20)
    )
    steps.append((copy, 1002))
    state = LaneState({}, [])
    fold_lane(state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in steps], policy)
    check_state(state)
    assert [(t.base_offset, t.open_count, t.first_seen_ms) for t in state.ranges] == [
        (10, 3, 1000),
        (13, 3, 1001),
    ]
    assert sorted(state.entries) == [5, 20]
    assert expand(state) == reference(steps)


def test_acks_after_a_run_of_v1_starts_settle_its_offsets_one_by_one() -> None:
    """The ACKs of another flush find their offsets in the run's range: each leaves it."""
    starts = _v1_starts(range(8))
    state = LaneState({}, [])
    fold_lane(state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in starts], policy)
    acks: list[tuple[AnyMarker, int]] = [
        (Marker.ack(GROUP, MessageId(TOPIC, PARTITION, o)), 1500) for o in (0, 1, 5)
    ]
    state = LaneState({}, [replace(t) for t in state.ranges])  # as the next flush loads it
    anomalies = fold_lane(
        state,
        [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in acks],
        policy,
    )
    check_state(state)
    assert anomalies == []
    assert [list(t.offsets()) for t in state.ranges] == [[2, 3, 4, 6, 7]]
    assert expand(state) == reference(starts + acks)


@settings(max_examples=50, deadline=None)
@given(st.randoms(use_true_random=False))
def test_markers_in_any_order_find_their_offsets_among_many_runs(rng: random.Random) -> None:
    """Runs of v1 STARTs with a timestamp each (forty ranges), then ACKs, EXTENDs and a
    range START over some of them in any order: every marker finds its offset's range."""
    starts = _v1_starts(range(200), {o: 1000 + o // 5 for o in range(200)})
    state = LaneState({}, [])
    fold_lane(state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in starts], policy)
    assert len(state.ranges) == 40
    later: list[tuple[AnyMarker, int]] = []
    for offset in rng.sample(range(200), 120):
        message = MessageId(TOPIC, PARTITION, offset)
        kind = rng.choice(["ack", "ack", "extend"])
        marker = (
            Marker.ack(GROUP, message)
            if kind == "ack"
            else Marker.extend(GROUP, message, timeout_ms=9_000)
        )
        later.append((marker, 5000))
    first = rng.randrange(0, 190)
    later.insert(
        rng.randrange(len(later)),
        (RangeMarker.start(GROUP, TOPIC, PARTITION, first, first + 9, consumer="c2"), 5000),
    )
    state = LaneState({}, [replace(t) for t in state.ranges])
    fold_lane(state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in later], policy)
    check_state(state)
    assert expand(state) == reference(starts + later)


def test_a_start_and_its_ack_of_an_older_attempt_are_both_stale() -> None:
    origin = MessageId(TOPIC, PARTITION, 7)
    copy = MessageId(TOPIC, 0, 900)
    retried = Marker.start(GROUP, copy, attempt=2, origin=origin, consumer="c1")
    state = LaneState({}, [])
    fold_lane(state, [LaneMarker(retried, 1000, MARKERS_PARTITION)], policy)
    steps = [Marker.start(GROUP, origin, consumer="c2"), Marker.ack(GROUP, origin)]
    anomalies = fold_lane(
        state, [LaneMarker(m, 2000 + i, MARKERS_PARTITION) for i, m in enumerate(steps)], policy
    )
    assert [index for index, _ in anomalies] == [0, 1]
    assert all(why.startswith("stale") for _, why in anomalies)
    entry = state.entries[7]
    assert entry is not None
    assert (entry.attempt, entry.consumer) == (2, "c1")


def test_a_batch_started_and_settled_leaves_nothing() -> None:
    start = RangeMarker.start(GROUP, TOPIC, PARTITION, 100, 599, consumer="c1")
    settle = RangeMarker.settle(GROUP, TOPIC, PARTITION, 100, 599)
    state = LaneState({}, [])
    anomalies = fold_lane(
        state,
        [LaneMarker(start, 1000, MARKERS_PARTITION), LaneMarker(settle, 1001, MARKERS_PARTITION)],
        policy,
    )
    assert (state.ranges, state.entries, anomalies) == ([], {}, [])


def test_a_retried_offset_leaves_the_range_and_the_rest_settles() -> None:
    start = RangeMarker.start(GROUP, TOPIC, PARTITION, 0, 9, timeout_ms=5000)
    delay = Marker.delay(GROUP, MessageId(TOPIC, PARTITION, 4), delay_ms=100, reason="later")
    settle = RangeMarker.settle(GROUP, TOPIC, PARTITION, 0, 9, exceptions=1 << 4)
    state = LaneState({}, [])
    steps: list[AnyMarker] = [start, delay, settle]
    fold_lane(
        state, [LaneMarker(m, 1000 + i, MARKERS_PARTITION) for i, m in enumerate(steps)], policy
    )
    assert state.ranges == []
    entry = state.entries[4]
    assert entry is not None
    assert (entry.state, entry.due_at_ms, entry.reason) == (State.DELAYED, 1101, "later")


def test_an_expired_range_redelivers_exactly_its_unsettled_offsets() -> None:
    start = RangeMarker.start(GROUP, TOPIC, PARTITION, 10, 19, timeout_ms=5000)
    settle = RangeMarker.settle(GROUP, TOPIC, PARTITION, 10, 19, exceptions=0b1000000101)
    state = LaneState({}, [])
    fold_lane(
        state,
        [LaneMarker(start, 1000, MARKERS_PARTITION), LaneMarker(settle, 2000, MARKERS_PARTITION)],
        policy,
    )
    [tracked] = state.ranges
    assert (tracked.base_offset, sorted(tracked.offsets()), tracked.due_at_ms) == (
        10,
        [10, 12, 19],
        6000,
    )
    plans = {o: plan_due(e, max_attempts=3) for o, e in expand(state).items()}
    assert {o: p.attempt for o, p in plans.items()} == {10: 2, 12: 2, 19: 2}


def test_a_partial_extend_splits_the_range() -> None:
    start = RangeMarker.start(GROUP, TOPIC, PARTITION, 0, 7, timeout_ms=1000)
    extend = RangeMarker.extend(GROUP, TOPIC, PARTITION, 2, 3, timeout_ms=60_000)
    state = LaneState({}, [])
    fold_lane(
        state,
        [LaneMarker(start, 0, MARKERS_PARTITION), LaneMarker(extend, 10, MARKERS_PARTITION)],
        policy,
    )
    due = {o: e.due_at_ms for o, e in expand(state).items()}
    assert due == {0: 1000, 1: 1000, 2: 60_010, 3: 60_010, 4: 1000, 5: 1000, 6: 1000, 7: 1000}
    assert all(not state.entries for _ in [0]), "no per-message entry for a split"


def test_a_late_settle_of_an_old_attempt_is_stale() -> None:
    """After redelivery the entry is at attempt 2: the batch's late SETTLE must not ack it."""
    copy_start = Marker.start(
        GROUP, MessageId(TOPIC, 0, 500), attempt=2, origin=MessageId(TOPIC, PARTITION, 3)
    )
    settle = RangeMarker.settle(GROUP, TOPIC, PARTITION, 0, 9)
    state = LaneState({}, [])
    fold_lane(
        state,
        [LaneMarker(copy_start, 0, MARKERS_PARTITION), LaneMarker(settle, 1, MARKERS_PARTITION)],
        policy,
    )
    entry = expand(state)[3]
    assert (entry.attempt, entry.state) == (2, State.IN_FLIGHT)


def test_range_rows_round_trip() -> None:
    tracked = TrackedRange(GROUP, TOPIC, PARTITION, 5, 1 << 40, 0b1011, 9, 1, 2, "c")
    assert TrackedRange.from_row(tracked.row()) == tracked
    assert entry_key(Marker.ack(GROUP, MessageId(TOPIC, PARTITION, 7))) == (GROUP, TOPIC, 2, 7)


def test_a_range_marker_looks_only_at_the_ranges_near_its_offsets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lane can keep thousands of ranges with a few open offsets each, and per-message
    entries among them (retries, offsets left open): a range marker must not look at every
    one of them (it did: the markers fuzz soak spent 58 % of ingest there, 2,005 valid
    markers/s instead of 21,441). Counted, not timed: ``aligned`` is the per-range look."""
    looks = 0
    aligned = TrackedRange.aligned

    def counted(self: TrackedRange, bits: int, base: int) -> int:
        nonlocal looks
        looks += 1
        return aligned(self, bits, base)

    monkeypatch.setattr(TrackedRange, "aligned", counted)
    batches = 2_000
    steps: list[tuple[AnyMarker, int]] = []
    for b in range(batches):
        first, last = 10 * b, 10 * b + 9
        ref = 1_000 + b
        steps.append(
            (RangeMarker.start(GROUP, TOPIC, PARTITION, first, last, timeout_ms=60_000), ref)
        )
        retried = MessageId(TOPIC, PARTITION, first + 5)
        steps.append((Marker.delay(GROUP, retried, delay_ms=50_000, reason="later"), ref))
        # Offset first+9 is left open: every batch leaves a range of one offset behind.
        steps.append(
            (RangeMarker.settle(GROUP, TOPIC, PARTITION, first, last, exceptions=0b1000100000), ref)
        )
    state = LaneState({}, [])
    fold_lane(state, [LaneMarker(m, ref, MARKERS_PARTITION) for m, ref in steps], policy)
    check_state(state)
    assert len(state.ranges) == batches
    assert sum(1 for e in state.entries.values() if e is not None) == batches
    assert looks <= 4 * batches  # a few per marker, not one per range of the lane
    assert expand(state) == reference(steps)
