"""Build a redelivery round's copies: read the payloads, queue a copy or dead letter each.

Steps 2 and 3 of a round (``tracker.engine.redeliver``): each claimed entry's payload is the
copy kept in the store for a long delay, else the original record read back from Kafka (one
batched read for the round); then the entry's plan (redeliver or dead-letter) decides the
record queued to the producer. Nothing here waits for the broker's acknowledgements: the
round is recorded once they arrive (``tracker.engine.round_outcome``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from aiokafka.errors import KafkaError

from tracker.domain.entries import Entry, EntryKey, Plan, plan_due
from tracker.domain.policy import TopicPolicy
from tracker.engine.copies import CopyBatches
from tracker.engine.copy_records import first_seen_ms, outgoing_record
from tracker.engine.round_outcome import RETRY_AFTER_MS
from tracker.errors import KmqError
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.metrics import Metrics
from tracker.ports import OriginalsSource
from tracker.store.port import StoredPayload, TrackerStore

#: The redelivery loop's logger: these lines are its lines (operators filter on it).
log = logging.getLogger("tracker.engine.redeliver")


async def read_payloads(
    store: TrackerStore,
    originals: OriginalsSource,
    entries: list[Entry],
    also: list[MessageId] | None = None,
) -> tuple[
    dict[EntryKey, OriginalRecord | Missing | None],
    dict[MessageId, OriginalRecord | Missing],
    OriginalsUnavailable | None,
]:
    """Each entry's payload (None where the broker could not be read right now), the
    originals at the positions ``also`` (in the same read; left out where not read), and why
    the broker could not be read."""
    also = also or []
    if not entries and not also:
        return {}, {}, None
    kept = await store.load_payloads([e.key for e in entries if e.keep_payload]) if entries else {}
    out: dict[EntryKey, OriginalRecord | Missing | None] = {}
    need: list[Entry] = []
    for entry in entries:
        stored: StoredPayload | None = kept.get(entry.key)
        if stored is not None:
            out[entry.key] = OriginalRecord(
                stored.key, stored.value, stored.headers, stored.timestamp_ms
            )
        else:
            need.append(entry)
    unavailable: OriginalsUnavailable | None = None
    found: dict[MessageId, OriginalRecord | Missing] = {}
    if need or also:
        positions = [MessageId(e.copy_topic, e.copy_partition, e.copy_offset) for e in need]
        try:
            found = await originals.fetch([*positions, *also])
        except OriginalsUnavailable as exc:
            unavailable = exc
        for entry, position in zip(need, positions, strict=True):
            out[entry.key] = found.get(position)
    return out, found, unavailable


async def queue_copies(
    entries: list[Entry],
    payloads: dict[EntryKey, OriginalRecord | Missing | None],
    batches: CopyBatches,
    retry: list[tuple[EntryKey, int]],
    now_ms: int,
    *,
    policy_for: Callable[[str], TopicPolicy],
    ensure_topic: Callable[[str, str], Awaitable[None]] | None,
    metrics: Metrics,
) -> tuple[list[tuple[Entry, Plan, str, str, int]], list[tuple[EntryKey, str]], list[Entry]]:
    """Queue each entry's copy or dead letter to ``batches``; returns (queued, lost, lost
    entries). A missing original makes its entry lost; entries that cannot be acted on now
    (payload unreadable, topic not producible) go to ``retry``.
    """
    sends: list[tuple[Entry, Plan, str, str, int]] = []
    lost: list[tuple[EntryKey, str]] = []
    lost_entries: list[Entry] = []
    for claimed in entries:
        original = payloads[claimed.key]
        if original is None:
            retry.append((claimed.key, now_ms + RETRY_AFTER_MS))
            continue
        if isinstance(original, Missing):
            copy = f"{claimed.copy_topic}/{claimed.copy_partition}/{claimed.copy_offset}"
            reason = f"original {copy} unreadable: {original.reason}"
            lost.append((claimed.key, reason))
            lost_entries.append(claimed)
            continue
        first_seen = first_seen_ms(claimed, original)
        entry = (  # copying an Entry costs more than the rest of this loop: only if needed
            claimed
            if first_seen == claimed.first_seen_ms
            else replace(claimed, first_seen_ms=first_seen)
        )
        plan = plan_due(entry, policy_for(entry.origin_topic).max_attempts)
        target, record_headers, detail = outgoing_record(
            entry, plan, original, policy_for(entry.origin_topic), now_ms
        )
        try:
            if ensure_topic is not None and target != entry.origin_topic:
                await ensure_topic(target, entry.origin_topic)
            ticket = await batches.add(target, original.key, original.value, record_headers)
        except (KafkaError, KmqError) as exc:
            log.warning("cannot produce to %s now: %r", target, exc)
            metrics.redelivery_errors.labels("produce").inc()
            retry.append((entry.key, now_ms + RETRY_AFTER_MS))
            continue
        sends.append((entry, plan, target, detail, ticket))
    return sends, lost, lost_entries
