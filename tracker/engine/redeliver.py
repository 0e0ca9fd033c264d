"""Redelivery: republish due entries as copies, or dead-letter them.

The loop sleeps until the earliest due time among the partitions this replica owns (woken
early when ingest writes a nearer one, or when ownership changes), then runs rounds:

1. claim a batch of due entries (fenced by the partition epoch, pushed ``claim_lease`` ahead);
2. get each one's payload: the copy kept in the store for long delays, else the original
   record read back from Kafka (batched per partition); a missing original is *lost*;
3. produce copies (attempt + 1, or the same attempt for a delayed message) with origin and
   group headers, or DLQ records with the dead-letter headers; wait for the broker's acks;
4. record the outcome in one transaction.

A crash between 3 and 4 republishes the batch again after the claim lease (at-least-once);
the copies carry origin and attempt so consumers can drop the duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from aiokafka.errors import KafkaError
from prometheus_client import Counter

from tracker import headers as h
from tracker.clock import Clock, to_millis
from tracker.engine.copies import CopyBatches
from tracker.engine.entries import Decision, Entry, EntryKey, Plan, State, plan_due
from tracker.engine.wakeup import wait_any
from tracker.errors import KmqError
from tracker.ids import MessageId
from tracker.kafka.originals import Missing, OriginalRecord, OriginalsUnavailable
from tracker.metrics import Metrics
from tracker.settings import TopicPolicy
from tracker.store import Store, StoreUnavailable
from tracker.store.manager import DeadLetterRecord, StoredPayload

log = logging.getLogger(__name__)

RETRY_AFTER_MS = 5_000  #: when a round cannot act on an entry (broker trouble), try again then
WAIT_FOR_PENDING_MS = 100  #: look again at an entry with unapplied markers this much later
NOT_READY_RECHECK = 0.05  #: seconds between looks at due entries that are not actionable yet


class OriginalsSource(Protocol):
    async def fetch(
        self, positions: Sequence[MessageId]
    ) -> dict[MessageId, OriginalRecord | Missing]: ...


@dataclass(frozen=True, slots=True)
class TrackerEvent:
    """Something the tracker did, for observers (the demo, logs)."""

    kind: str  #: redelivered | dead_lettered | lost
    entry: Entry
    detail: str


class Redeliverer:
    def __init__(
        self,
        *,
        store: Store,
        producer: Any,
        originals: OriginalsSource,
        markers_topic: str,
        owned_epochs: Callable[[], dict[int, int]],
        safe_until: Callable[[], dict[int, int]],
        pending_keys: Callable[[Iterable[EntryKey]], set[EntryKey]],
        policy_for: Callable[[str], TopicPolicy],
        clock: Clock,
        metrics: Metrics,
        batch: int,
        claim_lease_ms: int,
        max_idle: float,
        on_event: Callable[[TrackerEvent], Awaitable[None] | None] | None = None,
        ensure_topic: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        self._store = store
        self._producer = producer
        self._originals = originals
        self._markers_topic = markers_topic
        self._owned_epochs = owned_epochs
        self._safe_until = safe_until
        self._pending_keys = pending_keys
        self._policy_for = policy_for
        self._clock = clock
        self._metrics = metrics
        self._batch = batch
        self._lease_ms = claim_lease_ms
        self._max_idle = max_idle
        self._on_event = on_event
        self._ensure_topic = ensure_topic
        self._wake = asyncio.Event()
        self._target_ms: int | None = None
        self.last_error: str | None = None

    # -- waking --------------------------------------------------------------------------

    def notify_due(self, due_ms: int) -> None:
        """Ingest wrote an entry due at ``due_ms``: wake up if that is earlier than planned."""
        if self._target_ms is None or due_ms < self._target_ms:
            self._wake.set()

    def notify_safe(self, safe_ms: int) -> None:
        """Ingest read further: entries due up to ``safe_ms`` may be actionable now.

        Wakes the loop if it is waiting for an entry due by then, rather than letting it find
        out at its next recheck (``NOT_READY_RECHECK``).
        """
        if self._target_ms is not None and self._target_ms <= safe_ms:
            self._wake.set()

    def notify_ownership(self) -> None:
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        backoff = 0.5
        while not stopping.is_set():
            try:
                if await self.run_round() > 0:
                    backoff = 0.5
                    continue  # there may be more due right now
                await self._sleep_until_due(stopping)
                backoff = 0.5
            except StoreUnavailable as exc:
                self.last_error = f"store: {exc}"
                log.warning("redelivery paused, store unavailable: %s", exc)
                await _wait(stopping, backoff)
                backoff = min(backoff * 2, 10.0)

    async def _sleep_until_due(self, stopping: asyncio.Event) -> None:
        owned = self._owned_epochs()
        self._wake.clear()
        next_due = await self._store.next_due_ms(owned) if owned else None
        now_ms = to_millis(self._clock.now())
        self._target_ms = next_due
        if next_due is None:
            delay = self._max_idle
        else:
            # Something due now but not yet actionable (ingest still catching up, or markers
            # for it in the coalescing window): look again shortly.
            delay = max(NOT_READY_RECHECK, (next_due - now_ms) / 1000)
        delay = min(delay, self._max_idle)
        await wait_any(self._wake, stopping, timeout=delay)
        self._target_ms = None

    async def run_round(self) -> int:
        """Claim and handle one batch of due entries; returns how many were acted on."""
        epochs = self._owned_epochs()
        if not epochs:
            return 0
        started = time.perf_counter()
        now_ms = to_millis(self._clock.now())
        due_by = {p: min(now_ms, safe) for p, safe in self._safe_until().items()}
        token = uuid.uuid4().hex
        claimed, fenced = await self._store.claim_due(
            self._markers_topic,
            epochs=epochs,
            due_by=due_by,
            now_ms=now_ms,
            limit=self._batch,
            lease_ms=self._lease_ms,
            token=token,
        )
        if fenced:
            log.warning("redelivery fenced out of markers partitions %s", sorted(fenced))
        if not claimed:
            return 0
        # An entry with markers still in the coalescing window (an ACK, say) is decided by
        # them: leave it until they are applied.
        waiting = self._pending_keys(e.key for e in claimed)
        entries = [e for e in claimed if e.key not in waiting]
        later = [
            (e.key, max(e.due_at_ms or now_ms, now_ms + WAIT_FOR_PENDING_MS))
            for e in claimed
            if e.key in waiting
        ]
        for entry in entries:
            if entry.due_at_ms is not None:
                self._metrics.redelivery_lateness.observe(max(0, now_ms - entry.due_at_ms) / 1000)
        await self._handle(entries, token, later, {e.markers_partition for e in claimed})
        self._metrics.redelivery_seconds.observe(time.perf_counter() - started)
        return len(entries)

    async def _payloads(
        self, entries: list[Entry]
    ) -> dict[tuple[str, str, int, int], OriginalRecord | Missing | None]:
        """Each entry's payload; None where the broker could not be read right now."""
        kept = await self._store.load_payloads([e.key for e in entries if e.keep_payload])
        out: dict[tuple[str, str, int, int], OriginalRecord | Missing | None] = {}
        need: list[Entry] = []
        for entry in entries:
            stored: StoredPayload | None = kept.get(entry.key)
            if stored is not None:
                out[entry.key] = OriginalRecord(
                    stored.key, stored.value, stored.headers, stored.timestamp_ms
                )
            else:
                need.append(entry)
        if need:
            positions = [MessageId(e.copy_topic, e.copy_partition, e.copy_offset) for e in need]
            try:
                found = await self._originals.fetch(positions)
            except OriginalsUnavailable as exc:
                self.last_error = f"broker: {exc}"
                log.warning("cannot read originals now, retrying later: %s", exc)
                found = {}
            for entry, position in zip(need, positions, strict=True):
                out[entry.key] = found.get(position)
        return out

    async def _handle(
        self,
        entries: list[Entry],
        token: str,
        later: list[tuple[EntryKey, int]],
        partitions: set[int],
    ) -> None:
        now_ms = to_millis(self._clock.now())
        payloads = await self._payloads(entries) if entries else {}
        batches = CopyBatches(self._producer)
        retry: list[tuple[EntryKey, int]] = list(later)
        sends, lost, lost_entries = await self._queue_copies(
            entries, payloads, batches, retry, now_ms
        )

        done: list[tuple[str, str, int, int]] = []
        dead: list[DeadLetterRecord] = []
        events: list[TrackerEvent] = []
        # Counted once the round is recorded: a scrape never sees a redelivery counted while
        # its entry still reads as in flight.
        counted: list[Counter] = []
        await batches.send()
        failed: dict[str, BaseException] = {}
        for entry, plan, target, detail, ticket in sends:
            result = batches.result(ticket)
            if isinstance(result, BaseException):
                failed.setdefault(target, result)
                retry.append((entry.key, now_ms + RETRY_AFTER_MS))
                continue
            if plan.decision is Decision.REDELIVER:
                done.append(entry.key)
                # A delayed message's first copy is its first delivery, not a redelivery:
                # counted apart, so that delayed traffic does not read as consumers failing.
                first_delivery = entry.state is State.DELAYED and entry.deferred
                counter = (
                    self._metrics.delayed_delivered
                    if first_delivery
                    else self._metrics.redeliveries
                )
                counted.append(counter.labels(entry.origin_topic))
                events.append(TrackerEvent("redelivered", entry, detail))
            else:
                dead.append(
                    DeadLetterRecord(
                        entry=entry,
                        dlq_topic=target,
                        dlq_partition=result.partition,
                        dlq_offset=result.offset,
                        reason=plan.reason,
                        dead_lettered_ms=now_ms,
                        message_key=payloads_key(payloads, entry),
                    )
                )
                counted.append(self._metrics.dead_lettered.labels(entry.origin_topic))
                events.append(TrackerEvent("dead_lettered", entry, detail))
        for target, error in failed.items():  # one line per topic, not one per record
            log.warning("producing to %s failed (retried later): %r", target, error)
        events += self._report_lost(lost_entries, lost, counted)
        await self._store.finish_redelivery(
            token,
            markers_topic=self._markers_topic,
            partitions=partitions,
            done=done,
            dead=dead,
            lost=lost,
            retry=retry,
            now_ms=now_ms,
        )
        for counter in counted:
            counter.inc()
        await self._emit(events)

    async def _queue_copies(
        self,
        entries: list[Entry],
        payloads: dict[EntryKey, OriginalRecord | Missing | None],
        batches: CopyBatches,
        retry: list[tuple[EntryKey, int]],
        now_ms: int,
    ) -> tuple[list[tuple[Entry, Plan, str, str, int]], list[tuple[EntryKey, str]], list[Entry]]:
        """Queue each entry's copy or dead letter; returns (queued, lost, lost entries).

        Entries that cannot be acted on now go to ``retry``.
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
            first_seen = _first_seen(claimed, original)
            entry = (  # copying an Entry costs more than the rest of this loop: only if needed
                claimed
                if first_seen == claimed.first_seen_ms
                else replace(claimed, first_seen_ms=first_seen)
            )
            plan = plan_due(entry, self._policy_for(entry.origin_topic).max_attempts)
            target, record_headers, detail = self._outgoing(entry, plan, original, now_ms)
            try:
                if self._ensure_topic is not None and target != entry.origin_topic:
                    await self._ensure_topic(target, entry.origin_topic)
                ticket = await batches.add(target, original.key, original.value, record_headers)
            except (KafkaError, KmqError) as exc:
                log.warning("cannot produce to %s now: %r", target, exc)
                retry.append((entry.key, now_ms + RETRY_AFTER_MS))
                continue
            sends.append((entry, plan, target, detail, ticket))
        return sends, lost, lost_entries

    def _report_lost(
        self, entries: Sequence[Entry], lost: Sequence[tuple[EntryKey, str]], counted: list[Counter]
    ) -> list[TrackerEvent]:
        """Log each lost message (an ERROR: an operator must know) and count it once recorded."""
        events: list[TrackerEvent] = []
        for entry, (_, reason) in zip(entries, lost, strict=True):
            counted.append(self._metrics.lost.labels(entry.origin_topic))
            origin = f"{entry.origin_topic}/{entry.origin_partition}/{entry.origin_offset}"
            log.error(
                "message %s of group %s lost: %s",
                origin,
                entry.group_id,
                reason,
                extra={"message_id": origin, "group": entry.group_id, "topic": entry.origin_topic},
            )
            events.append(TrackerEvent("lost", entry, reason))
        return events

    def _outgoing(
        self, entry: Entry, plan: Plan, original: OriginalRecord, now_ms: int
    ) -> tuple[str, list[tuple[str, bytes | None]], str]:
        """Target topic, headers and a description of the record to produce for ``entry``."""
        policy = self._policy_for(entry.origin_topic)
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

    async def _emit(self, events: Sequence[TrackerEvent]) -> None:
        if self._on_event is None:
            return
        for event in events:
            result = self._on_event(event)
            if result is not None:
                await result


def _first_seen(entry: Entry, original: OriginalRecord) -> int:
    """The earliest sighting: the entry's, or the one a copy carries from earlier attempts."""
    for name, value in original.headers:
        if name == h.FIRST_SEEN and value and value.isdigit():
            return min(entry.first_seen_ms, int(value))
    return entry.first_seen_ms


def payloads_key(
    payloads: dict[tuple[str, str, int, int], OriginalRecord | Missing | None], entry: Entry
) -> bytes | None:
    original = payloads.get(entry.key)
    return original.key if isinstance(original, OriginalRecord) else None


async def _wait(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
