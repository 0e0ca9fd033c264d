"""Tracked entries and the state machine that markers drive.

One entry per logical message and consumer group, keyed by ``(group, origin)``. Acknowledged
messages have no entry. This module is pure: no I/O, no clock; the store feeds it the entry as
it is in the database and writes back what comes out, and the ingest loop uses the same fold
in memory to coalesce markers (a START and its ACK fold into "no entry").
"""

from __future__ import annotations

import enum
from dataclasses import replace

from tracker.domain.policy import PolicyLookup
from tracker.domain.value_records import value_record
from tracker.protocol import Marker, MarkerKind

EntryKey = tuple[str, str, int, int]  # group, origin topic, origin partition, origin offset


class State(enum.StrEnum):
    IN_FLIGHT = "in_flight"  #: a consumer holds it; redeliver at the deadline
    DELAYED = "delayed"  #: republish when due (retry with backoff, or a delayed message)
    REJECTED = "rejected"  #: dead-letter as soon as possible
    LOST = "lost"  #: the original could not be read when due; kept for operators


#: Prefix of the reason the admin API records when an operator dead-letters a message.
OPERATOR_PREFIX = "dead-lettered by "

ACTIVE_STATES = (State.IN_FLIGHT, State.DELAYED, State.REJECTED)


@value_record
class Entry:
    """The tracker's state about one logical message for one consumer group."""

    group_id: str
    origin_topic: str
    origin_partition: int
    origin_offset: int
    markers_partition: int
    state: State
    attempt: int
    copy_topic: str  #: the record to read back when republishing (the latest copy)
    copy_partition: int
    copy_offset: int
    due_at_ms: int | None  #: deadline (in flight) or due time (delayed); None once lost
    first_seen_ms: int
    updated_ms: int
    deferred: bool = False  #: a delayed message seen early: republish without an attempt
    consumer: str = ""
    reason: str = ""  #: the consumer's last error text, or why it was rejected or lost
    keep_payload: bool = False  #: the store must keep a copy of the payload (long delay)
    claim_token: str | None = None  #: set while a replica republishes it

    @property
    def key(self) -> EntryKey:
        return (self.group_id, self.origin_topic, self.origin_partition, self.origin_offset)

    def being_republished(self, now_ms: int) -> bool:
        """A redelivery round holds it now: claimed, and the claim's lease not yet run out
        (a claim pushes the due time to the lease's end; past it, any replica may claim it
        again, so an operator may act on it too)."""
        return (
            self.claim_token is not None and self.due_at_ms is not None and self.due_at_ms > now_ms
        )


def entry_key(marker: Marker) -> EntryKey:
    return (marker.group, marker.origin_topic, marker.origin_partition, marker.origin_offset)


def apply_marker(
    entry: Entry | None,
    marker: Marker,
    ref_ms: int,
    markers_partition: int,
    policy_for: PolicyLookup,
) -> tuple[Entry | None, str | None]:
    """The entry after ``marker``, and an anomaly description if the marker was not applied.

    ``ref_ms`` is the marker record's timestamp (clamped by the caller to be no later than the
    tracker's clock): every duration in the marker counts from it. Rules (docs/protocol.md):

    * A marker for an older attempt than the entry's is stale: ignored, reported.
    * START creates or replaces the entry (in flight, deadline = ref + lease).
    * ACK removes it; DELAY makes it delayed; REJECT marks it for the DLQ.
    * EXTEND moves the deadline of an in-flight entry of the same attempt.
    * After REJECT, markers of the same attempt do not undo it.
    """
    n = marker.attempt
    kind = marker.kind
    if entry is not None:
        if entry.attempt > n:
            return entry, f"stale {kind.name}: attempt {n}, entry is at attempt {entry.attempt}"
        if entry.state is State.REJECTED and entry.attempt == n:
            return entry, f"{kind.name} after REJECT of attempt {n}"
    if kind is MarkerKind.ACK:
        if entry is None:
            return None, "ACK without START (late, duplicate, or for an expired lease)"
        return None, None
    if kind is MarkerKind.EXTEND:
        if entry is None:
            return None, "EXTEND without START"
        if entry.state is not State.IN_FLIGHT or entry.attempt != n:
            return entry, f"EXTEND of a {entry.state.value} entry at attempt {entry.attempt}"
        return replace(entry, due_at_ms=ref_ms + marker.timeout_ms, updated_ms=ref_ms), None

    # Build the new entry once (no dataclasses.replace): this runs for every marker that
    # reaches the store, and copying frozen dataclasses dominated the flush profile.
    policy = policy_for(marker.origin_topic)
    if entry is not None:
        first_seen, consumer, reason, keep = (
            entry.first_seen_ms,
            entry.consumer,
            entry.reason,
            entry.keep_payload,
        )
    else:
        first_seen, consumer, reason, keep = ref_ms, "", "", False
    state = State.IN_FLIGHT
    deferred = False
    if kind is MarkerKind.START:
        due = ref_ms + (marker.timeout_ms or policy.processing_timeout_ms)
        consumer = marker.consumer
    elif kind is MarkerKind.DELAY:
        if marker.policy_delay:
            seed = f"{marker.group}/{marker.origin}/{n}".encode()
            delay = policy.backoff.delay_ms(n, seed)
        else:
            delay = marker.delay_ms
        state = State.DELAYED
        due = ref_ms + delay
        deferred = marker.deferred
        if not marker.deferred:
            reason = marker.reason
        keep = keep or delay > policy.keep_payload_after_ms
    else:  # REJECT
        state = State.REJECTED
        due = ref_ms
        reason = marker.reason
    return (
        Entry(
            marker.group,
            marker.origin_topic,
            marker.origin_partition,
            marker.origin_offset,
            markers_partition,
            state,
            n,
            marker.topic,
            marker.partition,
            marker.offset,
            due,
            first_seen,
            ref_ms,
            deferred,
            consumer,
            reason,
            keep,
        ),
        None,
    )


class Decision(enum.Enum):
    REDELIVER = "redeliver"
    DEAD_LETTER = "dead_letter"


@value_record
class Plan:
    """What the redelivery loop does with one due entry."""

    decision: Decision
    attempt: int  #: attempt number of the copy (REDELIVER) or attempts made (DEAD_LETTER)
    reason: str = ""  #: why it is dead-lettered


def plan_due(entry: Entry, max_attempts: int) -> Plan:
    """Redeliver or dead-letter a due entry (the topic allows ``max_attempts`` deliveries)."""
    if entry.state is State.REJECTED:
        if entry.reason.startswith(OPERATOR_PREFIX):
            why = entry.reason  # dead-lettered from the admin API: it says by whom and why
        elif entry.reason:
            why = f"rejected by the consumer: {entry.reason}"
        else:
            why = "rejected"
        return Plan(Decision.DEAD_LETTER, entry.attempt, why)
    if entry.state is State.DELAYED and entry.deferred:
        return Plan(Decision.REDELIVER, entry.attempt)  # a delayed message: its first delivery
    if entry.attempt >= max_attempts:
        why = "processing timeout" if entry.state is State.IN_FLIGHT else "retried"
        return Plan(
            Decision.DEAD_LETTER,
            entry.attempt,
            f"max attempts reached ({entry.attempt} of {max_attempts}; last: {why})",
        )
    return Plan(Decision.REDELIVER, entry.attempt + 1)
