"""The entry state machine that markers drive (pure: no broker, no database)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tracker.domain.entries import Decision, Entry, State, apply_marker, plan_due
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy
from tracker.ids import MessageId
from tracker.protocol import Marker

pytestmark = pytest.mark.unit

ORIGIN = MessageId("orders", 2, 10)
COPY = MessageId("orders", 0, 99)
POLICY = ResolvedPolicy(
    processing_timeout_ms=30_000,
    backoff=BackoffPolicy(initial=1, multiplier=2, max=60, jitter=0),
    keep_payload_after_ms=3_600_000,
)


def policy(_: str) -> ResolvedPolicy:
    return POLICY


def fold(*steps: tuple[Marker, int], entry: Entry | None = None) -> tuple[Entry | None, list[str]]:
    anomalies = []
    for marker, ref in steps:
        entry, anomaly = apply_marker(entry, marker, ref, 3, policy)
        if anomaly:
            anomalies.append(anomaly)
    return entry, anomalies


def test_start_creates_an_in_flight_entry_with_the_lease_from_the_marker_time() -> None:
    entry, anomalies = fold((Marker.start("g", ORIGIN, timeout_ms=5000, consumer="c1"), 1000))
    assert anomalies == []
    assert entry is not None
    assert (entry.state, entry.attempt, entry.due_at_ms, entry.consumer) == (
        State.IN_FLIGHT,
        1,
        6000,
        "c1",
    )
    assert entry.key == ("g", "orders", 2, 10)
    assert (entry.first_seen_ms, entry.markers_partition) == (1000, 3)


def test_start_without_a_lease_uses_the_policy() -> None:
    entry, _ = fold((Marker.start("g", ORIGIN), 1000))
    assert entry is not None
    assert entry.due_at_ms == 31_000


def test_start_then_ack_leaves_nothing() -> None:
    entry, anomalies = fold((Marker.start("g", ORIGIN), 1), (Marker.ack("g", ORIGIN), 2))
    assert entry is None
    assert anomalies == []


def test_ack_without_start_is_an_anomaly() -> None:
    entry, anomalies = fold((Marker.ack("g", ORIGIN), 1))
    assert entry is None
    assert anomalies == ["ACK without START (late, duplicate, or for an expired lease)"]


def test_a_late_marker_of_an_older_attempt_changes_nothing() -> None:
    start2 = Marker.start("g", COPY, attempt=2, origin=ORIGIN, timeout_ms=1000)
    entry, anomalies = fold((start2, 100), (Marker.ack("g", ORIGIN), 150))
    assert entry is not None
    assert entry.attempt == 2
    assert anomalies == ["stale ACK: attempt 1, entry is at attempt 2"]


def test_extend_moves_the_deadline_from_the_extend_time() -> None:
    entry, _ = fold(
        (Marker.start("g", ORIGIN, timeout_ms=1000), 0),
        (Marker.extend("g", ORIGIN, timeout_ms=9000), 500),
    )
    assert entry is not None
    assert entry.due_at_ms == 9500


def test_extend_of_a_delayed_entry_is_refused() -> None:
    entry, anomalies = fold(
        (Marker.start("g", ORIGIN), 0),
        (Marker.delay("g", ORIGIN, delay_ms=100), 1),
        (Marker.extend("g", ORIGIN, timeout_ms=9000), 2),
    )
    assert entry is not None
    assert (entry.state, entry.due_at_ms) == (State.DELAYED, 101)
    assert anomalies == ["EXTEND of a delayed entry at attempt 1"]


def test_delay_with_policy_backoff_grows_with_the_attempt() -> None:
    first, _ = fold((Marker.delay("g", ORIGIN), 0))
    third, _ = fold((Marker.delay("g", COPY, attempt=3, origin=ORIGIN), 0))
    assert first is not None
    assert third is not None
    assert (first.due_at_ms, third.due_at_ms) == (1000, 4000)


def test_deferred_delay_keeps_the_last_error_and_is_republished_with_the_same_attempt() -> None:
    entry, _ = fold(
        (Marker.delay("g", ORIGIN, delay_ms=60_000, reason="deliver-at", deferred=True), 0)
    )
    assert entry is not None
    assert entry.deferred
    assert entry.reason == ""
    assert plan_due(entry, max_attempts=1).decision is Decision.REDELIVER
    assert plan_due(entry, max_attempts=1).attempt == 1


def test_long_delays_keep_a_payload_copy() -> None:
    short, _ = fold((Marker.delay("g", ORIGIN, delay_ms=60_000), 0))
    long, _ = fold((Marker.delay("g", ORIGIN, delay_ms=7_200_000), 0))
    assert short is not None
    assert long is not None
    assert (short.keep_payload, long.keep_payload) == (False, True)


def test_reject_is_final_for_its_attempt() -> None:
    entry, anomalies = fold(
        (Marker.start("g", ORIGIN), 0),
        (Marker.reject("g", ORIGIN, reason="bad"), 5),
        (Marker.ack("g", ORIGIN), 6),
    )
    assert entry is not None
    assert (entry.state, entry.reason, entry.due_at_ms) == (State.REJECTED, "bad", 5)
    assert anomalies == ["ACK after REJECT of attempt 1"]
    plan = plan_due(entry, max_attempts=5)
    assert (plan.decision, plan.reason) == (Decision.DEAD_LETTER, "rejected by the consumer: bad")


def test_a_new_attempt_replaces_the_entry_but_keeps_first_seen() -> None:
    entry, _ = fold(
        (Marker.start("g", ORIGIN), 100),
        (Marker.delay("g", ORIGIN, delay_ms=10, reason="boom"), 200),
        (Marker.start("g", COPY, attempt=2, origin=ORIGIN, timeout_ms=50), 300),
    )
    assert entry is not None
    assert (entry.attempt, entry.state, entry.first_seen_ms) == (2, State.IN_FLIGHT, 100)
    assert (entry.copy_topic, entry.copy_partition, entry.copy_offset) == tuple(COPY)
    assert entry.reason == "boom", "the last error is kept for the dead-letter headers"


@pytest.mark.parametrize(
    ("state", "attempt", "expected"),
    [
        (State.IN_FLIGHT, 1, (Decision.REDELIVER, 2)),
        (State.IN_FLIGHT, 3, (Decision.DEAD_LETTER, 3)),
        (State.DELAYED, 2, (Decision.REDELIVER, 3)),
        (State.DELAYED, 3, (Decision.DEAD_LETTER, 3)),
    ],
)
def test_plan_due_counts_attempts(
    state: State, attempt: int, expected: tuple[Decision, int]
) -> None:
    entry, _ = fold((Marker.start("g", ORIGIN), 0))
    assert entry is not None
    plan = plan_due(replace(entry, state=state, attempt=attempt), max_attempts=3)
    assert (plan.decision, plan.attempt) == expected
