"""Range markers and tracked ranges against the per-message reference model (pure, no I/O).

The reference is v1 itself: every range marker is, by definition (docs/protocol.md), one v1
marker per covered offset, and :func:`apply_marker` folds those message by message. The range
fold must stand for exactly the same entries after every marker: same state, attempt, deadline
or due time, consumer, times, reason; hence the same redelivery and dead-letter decisions.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from support.range_model import (
    GROUP,
    MARKERS_PARTITION,
    PARTITION,
    TOPIC,
    markers_strategy,
    policy,
    reference,
    steps_with_times,
)

from tracker.domain.entries import State, entry_key, plan_due
from tracker.domain.ranges import LaneMarker, LaneState, expand, fold_lane
from tracker.domain.tracked_range import TrackedRange
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker
from tracker.protocol_v2 import RangeMarker

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
