"""A redelivery round's claimed ranges: planned, copied and tallied a range at a time.

A range claimed by a round (``TrackerStore.claim_due_ranges``) stands for first deliveries of
one lane that one consumer STARTed together and never settled: the same group, topic,
partition, attempt, due time and first sighting for every offset in it. So the plan
(redeliver as attempt 2, or dead-letter) is made once per range, the headers every copy
shares are built once, and the outcome is counted once; what is left per offset is what
differs (the record read back, its origin header, its ticket in the batch) and the offsets
that diverge: an original that is gone (lost), one that cannot be read now or a send that
failed (put back), a marker still in the coalescing window, a topic that allows one delivery
(dead letters are rows of their own). Only those are named per message: by their entry key
(put back, waiting), or as :class:`~tracker.domain.entries.Entry` values where the round's
per-message path takes them (lost, dead-lettered). This is the share-group idea (KIP-932's
``SharePartition``): state per batch, split per offset only on divergence.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from aiokafka.errors import KafkaError

from tracker import headers as h
from tracker.domain.entries import Decision, Entry, EntryKey, Plan, plan_due
from tracker.domain.policy import TopicPolicy
from tracker.domain.tracked_range import TrackedRange
from tracker.engine.copies import CopyBatches
from tracker.engine.copy_records import copy_headers, earliest_sighting
from tracker.engine.redelivery_rounds import RangeCopies
from tracker.engine.round_outcome import RETRY_AFTER_MS
from tracker.errors import KmqError
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord
from tracker.metrics import Metrics

#: The redelivery loop's logger: these lines are its lines (operators filter on it).
log = logging.getLogger("tracker.engine.redeliver")


def offset_keys(tracked_range: TrackedRange) -> list[EntryKey]:
    """The entry key of every open offset of ``tracked_range``."""
    lane = (tracked_range.group_id, tracked_range.origin_topic, tracked_range.origin_partition)
    return [(*lane, offset) for offset in tracked_range.offsets()]


def hold_back(
    ranges: list[TrackedRange],
    range_keys: list[list[EntryKey]],
    waiting: set[EntryKey],
    not_before_ms: int,
    later: list[tuple[EntryKey, int]],
) -> list[TrackedRange]:
    """``ranges`` without their offsets in ``waiting`` (markers still in the coalescing
    window decide them), which go to ``later``, due again at ``not_before_ms`` at the
    earliest. ``range_keys``: each range's :func:`offset_keys`."""
    kept: list[TrackedRange] = []
    for tracked_range, keys in zip(ranges, range_keys, strict=True):
        rest = tracked_range.open_bits
        for key in keys:
            if key in waiting:
                later.append((key, max(tracked_range.due_at_ms, not_before_ms)))
                rest &= ~(1 << (key[3] - tracked_range.base_offset))
        if rest:
            kept.append(tracked_range.piece(rest))
    return kept


def split_by_plan(
    ranges: list[TrackedRange], policy_for: Callable[[str], TopicPolicy]
) -> tuple[list[tuple[TrackedRange, Plan]], list[Entry]]:
    """Ranges whose offsets are redelivered (copied as a range), and the offsets of the others
    as entries: a topic that allows one delivery dead-letters them, one by one (each dead
    letter is a row of its own)."""
    copied: list[tuple[TrackedRange, Plan]] = []
    diverged: list[Entry] = []
    for tracked_range in ranges:
        first = tracked_range.entry_at(tracked_range.base_offset)
        plan = plan_due(first, policy_for(tracked_range.origin_topic).max_attempts)
        if plan.decision is Decision.REDELIVER:
            copied.append((tracked_range, plan))
        else:
            diverged += [tracked_range.entry_at(offset) for offset in tracked_range.offsets()]
    return copied, diverged


def range_positions(ranges: list[tuple[TrackedRange, Plan]]) -> list[MessageId]:
    """Where each offset's original is: the range's origin partition (first deliveries)."""
    return [
        MessageId(t.origin_topic, t.origin_partition, offset)
        for t, _ in ranges
        for offset in t.offsets()
    ]


async def queue_range_copies(
    ranges: list[tuple[TrackedRange, Plan]],
    found: Mapping[MessageId, OriginalRecord | Missing],
    batches: CopyBatches,
    retry: list[tuple[EntryKey, int]],
    now_ms: int,
    *,
    policy_for: Callable[[str], TopicPolicy],
    ensure_topic: Callable[[str, str], Awaitable[None]] | None,
    metrics: Metrics,
) -> tuple[list[RangeCopies], list[tuple[EntryKey, str]], list[Entry]]:
    """Queue a copy of each offset of ``ranges`` (all planned to be redelivered:
    :func:`split_by_plan`) whose original is in ``found``; returns (queued, lost, lost
    entries). As ``queue_copies`` does per entry: a missing original makes its offset lost,
    one not read (absent from ``found``) or not producible now goes to ``retry``."""
    sends: list[RangeCopies] = []
    lost: list[tuple[EntryKey, str]] = []
    lost_entries: list[Entry] = []
    later = now_ms + RETRY_AFTER_MS
    for tracked_range, plan in ranges:
        group, topic, partition = (
            tracked_range.group_id,
            tracked_range.origin_topic,
            tracked_range.origin_partition,
        )
        target = policy_for(topic).retry_for(topic)
        if ensure_topic is not None and target != topic:
            try:
                await ensure_topic(target, topic)
            except (KafkaError, KmqError) as exc:
                log.warning("cannot produce to %s now: %r", target, exc)
                metrics.redelivery_errors.labels("produce").inc()
                retry += [(key, later) for key in offset_keys(tracked_range)]
                continue
        group_bytes = group.encode()
        attempt = (h.ATTEMPT, str(plan.attempt).encode())
        first_seen = tracked_range.first_seen_ms
        prefix = f"{topic}/{partition}/"
        offsets: list[int] = []
        tickets: list[int] = []
        for offset in tracked_range.offsets():
            original = found.get(MessageId(topic, partition, offset))
            if original is None:
                retry.append(((group, topic, partition, offset), later))
                continue
            if isinstance(original, Missing):
                reason = f"original {prefix}{offset} unreadable: {original.reason}"
                lost.append(((group, topic, partition, offset), reason))
                lost_entries.append(tracked_range.entry_at(offset))
                continue
            record_headers = copy_headers(
                original.headers,
                f"{prefix}{offset}",
                group_bytes,
                earliest_sighting(first_seen, original),
                attempt,
            )
            try:
                ticket = await batches.add(target, original.key, original.value, record_headers)
            except (KafkaError, KmqError) as exc:
                log.warning("cannot produce to %s now: %r", target, exc)
                metrics.redelivery_errors.labels("produce").inc()
                retry.append(((group, topic, partition, offset), later))
                continue
            offsets.append(offset)
            tickets.append(ticket)
        if offsets:
            detail = f"attempt {plan.attempt} -> {target}"
            sends.append(RangeCopies(tracked_range, target, detail, offsets, tickets))
    return sends, lost, lost_entries
