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
    if plan.decision is Decision.REDELIVER:
        target = policy.retry_for(entry.origin_topic)
        headers = copy_headers(
            original.headers,
            str(origin),
            entry.group_id.encode(),
            entry.first_seen_ms,
            (h.ATTEMPT, str(plan.attempt).encode()),
        )
        what = "delayed message due" if entry.deferred else f"attempt {plan.attempt}"
        return target, headers, f"{what} -> {target}"
    base = h.without_kmq_headers(original.headers)
    identity = [
        (h.ORIGIN, str(origin).encode()),
        (h.GROUP, entry.group_id.encode()),
        (h.FIRST_SEEN, str(entry.first_seen_ms).encode()),
    ]
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


def copy_headers(
    original_headers: tuple[tuple[str, bytes | None], ...],
    origin: str,
    group: bytes,
    first_seen_ms: int,
    attempt: tuple[str, bytes],
) -> list[tuple[str, bytes | None]]:
    """A copy's headers: the original's own (kmq's left out), then origin, group, first
    sighting and ``attempt`` (the ``ATTEMPT`` header). ``group`` and ``attempt`` come built:
    a claimed range builds them once for all its copies."""
    return [
        *h.without_kmq_headers(original_headers),
        (h.ORIGIN, origin.encode()),
        (h.GROUP, group),
        (h.FIRST_SEEN, str(first_seen_ms).encode()),
        attempt,
    ]


def first_seen_ms(entry: Entry, original: OriginalRecord) -> int:
    """The earliest sighting: the entry's, or the one a copy carries from earlier attempts."""
    return earliest_sighting(entry.first_seen_ms, original)


def earliest_sighting(first_seen: int, original: OriginalRecord) -> int:
    """``first_seen``, or the earlier sighting that ``original`` carries as a copy."""
    for name, value in original.headers:
        if name == h.FIRST_SEEN and value and value.isdigit():
            return min(first_seen, int(value))
    return first_seen


def payloads_key(
    payloads: dict[EntryKey, OriginalRecord | Missing | None], entry: Entry
) -> bytes | None:
    """The key of ``entry``'s original, as its dead-letter row keeps it (None if unread)."""
    original = payloads.get(entry.key)
    return original.key if isinstance(original, OriginalRecord) else None
