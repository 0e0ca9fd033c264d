"""What a redelivery round did, once the broker answered for its copies.

Each queued copy is now acknowledged or failed: an acknowledged copy is a redelivery (or a
delayed message's first delivery), an acknowledged dead letter is recorded with where it
landed, a failed send is put back to be tried again, and a lost original is reported. This
turns a :class:`~tracker.engine.redelivery_rounds.QueuedRound` into what the store records and
what metrics and observers are told: counted only once the round is recorded, so that a
scrape never sees a redelivery counted while its entry still reads as in flight.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from prometheus_client import Counter

from tracker.domain.entries import Decision, EntryKey, State
from tracker.engine.copy_records import payloads_key
from tracker.engine.redelivery_rounds import QueuedRound, TrackerEvent
from tracker.metrics import Metrics
from tracker.store.port import DeadLetterRecord

#: The redelivery loop's logger: these lines are its lines (operators filter on it).
log = logging.getLogger("tracker.engine.redeliver")

RETRY_AFTER_MS = 5_000  #: when a round cannot act on an entry (broker trouble), try again then


@dataclass(slots=True)
class RoundTally:
    """A round's outcome: what to record, what to count (per counter and topic), what to tell."""

    done: list[EntryKey] = field(default_factory=list)
    dead: list[DeadLetterRecord] = field(default_factory=list)
    events: list[TrackerEvent] = field(default_factory=list)
    counted: collections.Counter[tuple[Counter, str]] = field(default_factory=collections.Counter)


def tally_round(queued: QueuedRound, metrics: Metrics, *, observed: bool) -> RoundTally:
    """The outcome of ``queued`` once its copies were acknowledged or failed.

    Failed sends are appended to ``queued.retry`` (due again ``RETRY_AFTER_MS`` later) and
    logged once per topic. ``observed``: build :class:`TrackerEvent` values for an observer.
    """
    tally = RoundTally()
    now_ms, retry, counted = queued.now_ms, queued.retry, tally.counted
    failed: dict[str, BaseException] = {}
    for entry, plan, target, detail, ticket in queued.sends:
        result = queued.batches.result(ticket)
        if isinstance(result, BaseException):
            failed.setdefault(target, result)
            retry.append((entry.key, now_ms + RETRY_AFTER_MS))
            continue
        if plan.decision is Decision.REDELIVER:
            tally.done.append(entry.key)
            # A delayed message's first copy is its first delivery, not a redelivery:
            # counted apart, so that delayed traffic does not read as consumers failing.
            first_delivery = entry.state is State.DELAYED and entry.deferred
            counter = metrics.delayed_delivered if first_delivery else metrics.redeliveries
            counted[counter, entry.origin_topic] += 1
            if observed:
                tally.events.append(TrackerEvent("redelivered", entry, detail))
        else:
            tally.dead.append(
                DeadLetterRecord(
                    entry=entry,
                    dlq_topic=target,
                    dlq_partition=result.partition,
                    dlq_offset=result.offset,
                    reason=plan.reason,
                    dead_lettered_ms=now_ms,
                    message_key=payloads_key(queued.payloads, entry),
                )
            )
            counted[metrics.dead_lettered, entry.origin_topic] += 1
            if observed:
                tally.events.append(TrackerEvent("dead_lettered", entry, detail))
    for sent in queued.range_sends:  # a range at a time: one count, keys only per offset
        tracked_range, target = sent.tracked_range, sent.target
        group, topic, partition = (
            tracked_range.group_id,
            tracked_range.origin_topic,
            tracked_range.origin_partition,
        )
        copied = 0
        for offset, ticket in zip(sent.offsets, sent.tickets, strict=True):
            error = queued.batches.failure(ticket)
            if error is not None:
                failed.setdefault(target, error)
                retry.append(((group, topic, partition, offset), now_ms + RETRY_AFTER_MS))
                continue
            tally.done.append((group, topic, partition, offset))
            copied += 1
            if observed:
                entry = tracked_range.entry_at(offset)
                tally.events.append(TrackerEvent("redelivered", entry, sent.detail))
        if copied:
            counted[metrics.redeliveries, topic] += copied
    for target, error in failed.items():  # one line per topic, not one per record
        log.warning("producing to %s failed (retried later): %r", target, error)
        metrics.redelivery_errors.labels("produce").inc()
    for entry, (_, reason) in zip(queued.lost_entries, queued.lost, strict=True):
        # An ERROR per lost message: an operator must know.
        counted[metrics.lost, entry.origin_topic] += 1
        origin = f"{entry.origin_topic}/{entry.origin_partition}/{entry.origin_offset}"
        log.error(
            "message %s of group %s lost: %s",
            origin,
            entry.group_id,
            reason,
            extra={"message_id": origin, "group": entry.group_id, "topic": entry.origin_topic},
        )
        tally.events.append(TrackerEvent("lost", entry, reason))
    return tally
