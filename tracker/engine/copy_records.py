"""What a due entry becomes on the wire: the record a redelivery round produces for it.

A copy goes to the topic's retry topic (by default the topic itself) with the original's key,
value and headers, plus the kmq identity headers (origin, group, first sighting) and its
attempt; a dead letter goes to the topic's DLQ with the dead-letter headers instead of the
attempt. Every header name is ``tracker.headers``'; what each means is in docs/protocol.md.
"""

from __future__ import annotations

from tracker import headers as h
from tracker.domain.entries import Decision, Entry, EntryKey, Plan
from tracker.domain.policy import TopicPolicy
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord


def outgoing_record(
    entry: Entry, plan: Plan, original: OriginalRecord, policy: TopicPolicy, now_ms: int
) -> tuple[str, list[tuple[str, bytes | None]], str]:
    """Target topic, headers and a description of the record to produce for ``entry``."""
    origin = MessageId(entry.origin_topic, entry.origin_partition, entry.origin_offset)
    base = h.without_kmq_headers(original.headers)
    identity = [
        (h.ORIGIN, str(origin).encode()),
        (h.GROUP, entry.group_id.encode()),
        (h.FIRST_SEEN, str(entry.first_seen_ms).encode()),
    ]
    if plan.decision is Decision.REDELIVER:
        target = policy.retry_for(entry.origin_topic)
        attempt = [(h.ATTEMPT, str(plan.attempt).encode())]
        what = "delayed message due" if entry.deferred else f"attempt {plan.attempt}"
        return target, [*base, *identity, *attempt], f"{what} -> {target}"
    target = policy.dlq_for(entry.origin_topic)
    source = f"{entry.copy_topic}/{entry.copy_partition}/{entry.copy_offset}"
    dlq = [
        (h.DLQ_REASON, plan.reason.encode()),
        (h.DLQ_ATTEMPTS, str(plan.attempt).encode()),
        (h.DLQ_FIRST_SEEN, str(entry.first_seen_ms).encode()),
        (h.DLQ_AT, str(now_ms).encode()),
        (h.DLQ_LAST_ERROR, entry.reason.encode("utf-8", "replace")),
        (h.DLQ_SOURCE, source.encode()),
    ]
    return target, [*base, *identity, *dlq], f"{plan.reason} -> {target}"


def first_seen_ms(entry: Entry, original: OriginalRecord) -> int:
    """The earliest sighting: the entry's, or the one a copy carries from earlier attempts."""
    for name, value in original.headers:
        if name == h.FIRST_SEEN and value and value.isdigit():
            return min(entry.first_seen_ms, int(value))
    return entry.first_seen_ms


def payloads_key(
    payloads: dict[EntryKey, OriginalRecord | Missing | None], entry: Entry
) -> bytes | None:
    """The key of ``entry``'s original, as its dead-letter row keeps it (None if unread)."""
    original = payloads.get(entry.key)
    return original.key if isinstance(original, OriginalRecord) else None
