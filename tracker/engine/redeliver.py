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
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from aiokafka.errors import KafkaError
from prometheus_client import Counter

from tracker.clock import Clock, to_millis
from tracker.domain.entries import Decision, Entry, EntryKey, Plan, State, plan_due
from tracker.domain.policy import TopicPolicy
from tracker.engine.copies import CopyBatches
from tracker.engine.copy_records import first_seen_ms, outgoing_record, payloads_key
from tracker.engine.redelivery_rounds import ClaimedRound, QueuedRound, TrackerEvent, reap_rounds
from tracker.engine.signals import IngestProgress
from tracker.engine.wakeup import wait_any
from tracker.errors import KmqError
from tracker.ids import MessageId
from tracker.kafka.originals import Missing, OriginalRecord, OriginalsUnavailable
from tracker.metrics import Metrics
from tracker.ports import OriginalsSource
from tracker.store import StoreUnavailable
from tracker.store.port import DeadLetterRecord, StoredPayload, TrackerStore

log = logging.getLogger(__name__)

RETRY_AFTER_MS = 5_000  #: when a round cannot act on an entry (broker trouble), try again then
WAIT_FOR_PENDING_MS = 100  #: look again at an entry with unapplied markers this much later
NOT_READY_RECHECK = 0.05  #: seconds between looks at due entries that are not actionable yet
ROUNDS_IN_FLIGHT = 3  #: rounds claimed and not yet recorded, at most (``Redeliverer.run``)


class Redeliverer:
    def __init__(
        self,
        *,
        store: TrackerStore,
        producer: Any,
        originals: OriginalsSource,
        markers_topic: str,
        progress: IngestProgress,
        policy_for: Callable[[str], TopicPolicy],
        clock: Clock,
        metrics: Metrics,
        batch: int,
        claim_lease_ms: int,
        max_idle: float,
        on_event: Callable[[TrackerEvent], Awaitable[None] | None] | None = None,
        ensure_topic: Callable[[str, str], Awaitable[None]] | None = None,
        depth: int = ROUNDS_IN_FLIGHT,
    ) -> None:
        if depth < 2:
            raise ValueError("depth: at least 2 rounds (one recording, one being built)")
        self._store = store
        self._producer = producer
        self._originals = originals
        self._markers_topic = markers_topic
        self._owned_epochs = progress.owned_epochs
        self._safe_until = progress.safe_until
        self._pending_keys = progress.pending_keys
        self._policy_for = policy_for
        self._clock = clock
        self._metrics = metrics
        self._batch = batch
        self._lease_ms = claim_lease_ms
        self._max_idle = max_idle
        self._on_event = on_event
        self._ensure_topic = ensure_topic
        self._depth = depth
        self._phase = {
            name: metrics.redelivery_phase.labels(name)
            for name in ("claim", "read", "produce", "ack", "record")
        }
        self._wake = asyncio.Event()
        #: while the loop sleeps: per markers partition, its earliest due time, and when the
        #: loop's timer runs out (ms)
        self._targets: dict[int, int] | None = None
        self._wake_at_ms: int | None = None
        self.last_error: str | None = None

    # -- waking --------------------------------------------------------------------------

    def notify_due(self, due_ms: int) -> None:
        """Ingest wrote an entry due at ``due_ms``: wake up if that is earlier than planned."""
        wake_at = self._wake_at_ms
        if wake_at is None or due_ms < wake_at:
            self._wake.set()

    def notify_safe(self, safe_ms: int) -> None:
        """Ingest read further: entries due up to ``safe_ms`` may be actionable now.

        Wakes the loop if a partition it waits for has become actionable, rather than letting
        it find out at its next recheck (``NOT_READY_RECHECK``). Checked per partition: a
        wake-up for another partition's progress made the loop claim, find nothing it may
        act on, and hold the store (and the next real claim) up for nothing.
        """
        targets = self._targets
        if not targets or min(targets.values()) > safe_ms:
            return
        if self._actionable(targets):
            self._wake.set()

    def _actionable(self, targets: dict[int, int]) -> bool:
        """Whether any partition's earliest due entry may be acted on now."""
        now_ms = to_millis(self._clock.now())
        safe = self._safe_until()
        return any(due <= now_ms and due <= safe.get(p, -1) for p, due in targets.items())

    def notify_ownership(self) -> None:
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Run rounds until ``stopping``, overlapped; then finish what is under way.

        Two tasks: the *claimer* claims a batch as soon as entries are actionable, and the
        *producer* reads the claimed rounds' originals and queues their copies, in claim
        order; each round is then recorded in the background once the broker acknowledged
        its copies. So an entry that becomes actionable while a round is being produced or
        recorded is claimed at once, not after that round (one round after another made an
        entry wait for the round before it: most of the lateness after a deadline), and in a
        burst the next batch is claimed and read while the copies of the one before are
        acknowledged and recorded. At most ``depth`` rounds are claimed and not yet
        recorded.
        """
        slots = asyncio.Semaphore(self._depth)
        claimed_rounds: asyncio.Queue[ClaimedRound | None] = asyncio.Queue()
        recording: set[asyncio.Task[int]] = set()
        claimer = asyncio.create_task(
            self._claim_loop(stopping, slots, claimed_rounds), name="kmq-redelivery-claim"
        )
        try:
            while True:
                claimed = await claimed_rounds.get()
                if claimed is None:
                    break
                reap_rounds(recording)  # raises what a finished record raised (not the store)
                try:
                    queued = await self._produce(claimed)
                except StoreUnavailable as exc:  # reading kept payloads: give the round back
                    log.warning("redelivery round not produced, store unavailable: %s", exc)
                    await self._release(claimed, after_ms=RETRY_AFTER_MS)
                    slots.release()
                    continue
                task = asyncio.create_task(
                    self._record_round(queued, slots), name="kmq-redelivery-record"
                )
                recording.add(task)
            await claimer  # raises what the claimer raised
            # Stopping: every claimed round was produced; let their records finish.
            if recording:
                await asyncio.wait(recording)
            reap_rounds(recording)
        except BaseException:
            # Cancelled (or failed): stop at once. Rounds not recorded come back after their
            # claim lease, as after a crash.
            claimer.cancel()
            for task in recording:
                task.cancel()
            raise

    async def _claim_loop(
        self,
        stopping: asyncio.Event,
        slots: asyncio.Semaphore,
        claimed_rounds: asyncio.Queue[ClaimedRound | None],
    ) -> None:
        """Claim rounds for the producer while there are free slots; sleep when none is due."""
        backoff = 0.5
        try:
            while not stopping.is_set():
                try:
                    await self._claim_next(stopping, slots, claimed_rounds)
                    backoff = 0.5
                except StoreUnavailable as exc:  # claiming, or looking for the next due entry
                    self.last_error = f"store: {exc}"
                    self._metrics.redelivery_errors.labels("claim").inc()
                    log.warning("redelivery paused, store unavailable: %s", exc)
                    await _wait(stopping, backoff)
                    backoff = min(backoff * 2, 10.0)
        finally:
            claimed_rounds.put_nowait(None)

    async def _claim_next(
        self,
        stopping: asyncio.Event,
        slots: asyncio.Semaphore,
        claimed_rounds: asyncio.Queue[ClaimedRound | None],
    ) -> None:
        """Claim one round (once a slot is free) and hand it on; then sleep if nothing more
        is actionable now."""
        await slots.acquire()
        try:
            claimed = None if stopping.is_set() else await self._claim()
        except BaseException:
            slots.release()
            raise
        if claimed is None:
            slots.release()
        else:
            claimed_rounds.put_nowait(claimed)
        if stopping.is_set():
            return
        if claimed is None or not claimed.full:
            # Everything actionable was taken: wait for the next due entry rather than claim
            # again at once (an empty claim holds SQLite's writer). After an empty claim, not
            # less than NOT_READY_RECHECK: ``safe_until`` may still list a partition the store
            # has fenced us out of (ingest learns that at its next flush).
            await self._sleep_until_due(stopping, claimed_nothing=claimed is None)

    async def _record_round(self, queued: QueuedRound, slots: asyncio.Semaphore) -> int:
        """Record a produced round in the background; a store that stays away is logged (the
        round's entries come back when their claim lease runs out)."""
        try:
            return await self._record(queued)
        except StoreUnavailable as exc:
            self.last_error = f"store: {exc}"
            self._metrics.redelivery_errors.labels("record").inc()
            log.warning(
                "a redelivery round could not be recorded (its %d entries are republished "
                "when their claim lease runs out): %s",
                queued.acted,
                exc,
            )
            return 0
        finally:
            slots.release()

    async def _sleep_until_due(
        self, stopping: asyncio.Event, *, claimed_nothing: bool = False
    ) -> None:
        """Return once an entry may be acted on (or a while has passed, or we stop).

        An entry may be acted on once it is due *and* ingest has read its markers partition
        up to then (``safe_until``, which trails the clock by ``ack_grace`` at least): waking
        at the due time alone, the loop claimed before it was allowed to act, found nothing,
        and slept again. So each partition's timer aims at the moment its horizon should
        reach its earliest due entry, and ingest's progress (``notify_safe``) wakes the loop
        as soon as a partition it waits for is actionable.
        """
        owned = self._owned_epochs()
        self._wake.clear()
        targets = await self._store.next_due_by_partition(owned) if owned else {}
        if targets and not claimed_nothing and self._actionable(targets):
            return  # it fell due while the last round ran: claim it now
        now_ms = to_millis(self._clock.now())
        safe = self._safe_until()
        waits = [max(due - now_ms, due - safe[p]) / 1000 for p, due in targets.items() if p in safe]
        # A partition still catching up (not in ``safe``) is announced by notify_safe;
        # rechecked shortly in any case.
        delay = min(waits, default=self._max_idle if not targets else NOT_READY_RECHECK)
        delay = min(max(NOT_READY_RECHECK, delay), self._max_idle)
        self._targets = targets
        self._wake_at_ms = now_ms + int(delay * 1000)
        try:
            await wait_any(self._wake, stopping, timeout=delay)
        finally:
            self._targets = None
            self._wake_at_ms = None

    async def run_round(self) -> int:
        """Claim, produce and record one batch of due entries; returns how many were acted on.

        One round on its own, start to end (``run`` overlaps them).
        """
        claimed = await self._claim()
        if claimed is None:
            return 0
        return await self._record(await self._produce(claimed))

    async def _claim(self) -> ClaimedRound | None:
        """Claim a batch of due entries (fenced by the partitions' epochs); None if none."""
        epochs = self._owned_epochs()
        if not epochs:
            return None
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
        self._phase["claim"].observe(time.perf_counter() - started)
        if fenced:
            log.warning("redelivery fenced out of markers partitions %s", sorted(fenced))
            self._metrics.fenced.inc()
        if not claimed:
            return None
        # An entry with markers still in the coalescing window (an ACK, say) is decided by
        # them: leave it until they are applied.
        waiting = self._pending_keys(e.key for e in claimed)
        entries = [e for e in claimed if e.key not in waiting] if waiting else claimed
        later = [
            (e.key, max(e.due_at_ms or now_ms, now_ms + WAIT_FOR_PENDING_MS))
            for e in claimed
            if e.key in waiting
        ]
        lateness = self._metrics.redelivery_lateness
        for entry in entries:
            if entry.due_at_ms is not None:
                lateness.observe(max(0, now_ms - entry.due_at_ms) / 1000)
        return ClaimedRound(
            token=token,
            started=started,
            epochs={p: e for p, e in epochs.items() if p not in fenced},
            entries=entries,
            later=later,
            partitions={e.markers_partition for e in claimed},
            full=len(claimed) >= self._batch,
        )

    async def _produce(self, claimed: ClaimedRound) -> QueuedRound:
        """Read the round's payloads, build its copies and queue them to the producer.

        Entries of a markers partition this replica lost since the claim are not produced
        (fencing: the partition's new owner republishes them); they are given back.
        """
        now_ms = to_millis(self._clock.now())
        retry: list[tuple[EntryKey, int]] = list(claimed.later)
        entries = claimed.entries
        owned = self._owned_epochs()
        moved = {p for p, epoch in claimed.epochs.items() if owned.get(p) != epoch}
        if moved:
            retry += [(e.key, now_ms) for e in entries if e.markers_partition in moved]
            entries = [e for e in entries if e.markers_partition not in moved]
            log.info("markers partitions %s changed owner during a round", sorted(moved))
        started = time.perf_counter()
        payloads = await self._payloads(entries) if entries else {}
        built = time.perf_counter()
        self._phase["read"].observe(built - started)
        batches = CopyBatches(self._producer)
        sends, lost, lost_entries = await self._queue_copies(
            entries, payloads, batches, retry, now_ms
        )
        await batches.queue()
        self._phase["produce"].observe(time.perf_counter() - built)
        return QueuedRound(
            claimed, now_ms, payloads, batches, sends, lost, lost_entries, retry, len(entries)
        )

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
                self._metrics.redelivery_errors.labels("read").inc()
                log.warning("cannot read originals now, retrying later: %s", exc)
                found = {}
            for entry, position in zip(need, positions, strict=True):
                out[entry.key] = found.get(position)
        return out

    async def _record(self, queued: QueuedRound) -> int:
        """Wait for the round's copies to be acknowledged, then record the round."""
        started = time.perf_counter()
        await queued.batches.wait()
        acked = time.perf_counter()
        self._phase["ack"].observe(acked - started)
        claimed, now_ms, retry = queued.claimed, queued.now_ms, queued.retry
        done: list[tuple[str, str, int, int]] = []
        dead: list[DeadLetterRecord] = []
        events: list[TrackerEvent] = []
        # Counted once the round is recorded: a scrape never sees a redelivery counted while
        # its entry still reads as in flight. One increment per counter and topic.
        counted: collections.Counter[tuple[Counter, str]] = collections.Counter()
        failed: dict[str, BaseException] = {}
        for entry, plan, target, detail, ticket in queued.sends:
            result = queued.batches.result(ticket)
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
                counted[counter, entry.origin_topic] += 1
                if self._on_event is not None:
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
                        message_key=payloads_key(queued.payloads, entry),
                    )
                )
                counted[self._metrics.dead_lettered, entry.origin_topic] += 1
                if self._on_event is not None:
                    events.append(TrackerEvent("dead_lettered", entry, detail))
        for target, error in failed.items():  # one line per topic, not one per record
            log.warning("producing to %s failed (retried later): %r", target, error)
            self._metrics.redelivery_errors.labels("produce").inc()
        events += self._report_lost(queued.lost_entries, queued.lost, counted)
        await self._finish(
            claimed, done=done, dead=dead, lost=queued.lost, retry=retry, now_ms=now_ms
        )
        if retry:  # entries put back: due again soon, maybe before the claimer's next look
            self.notify_due(min(due for _, due in retry))
        self._phase["record"].observe(time.perf_counter() - acked)
        for (counter, topic), count in counted.items():
            counter.labels(topic).inc(count)
        self._metrics.redelivery_seconds.observe(time.perf_counter() - claimed.started)
        await self._emit(events)
        return queued.acted

    async def _finish(
        self,
        claimed: ClaimedRound,
        *,
        done: list[EntryKey],
        dead: list[DeadLetterRecord],
        lost: list[tuple[EntryKey, str]],
        retry: list[tuple[EntryKey, int]],
        now_ms: int,
    ) -> None:
        """Record a round; through a short store outage, keep trying while the claim holds.

        The copies are out: a round not recorded is republished once its claim lease runs
        out (duplicates that consumers drop by origin and attempt). Retrying for up to half
        the lease spares them that after a brief outage.
        """
        # Counted from the claim: past half the lease the entries may be claimed again.
        give_up = claimed.started + self._lease_ms / 2000
        pause = 0.1
        while True:
            try:
                await self._record_outcome(
                    claimed, done=done, dead=dead, lost=lost, retry=retry, now_ms=now_ms
                )
            except StoreUnavailable as exc:
                if time.perf_counter() + pause > give_up:
                    raise
                self.last_error = f"store: {exc}"
                self._metrics.redelivery_errors.labels("record").inc()
                log.warning("recording a redelivery round failed, retrying: %s", exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
            else:
                return

    async def _release(self, claimed: ClaimedRound, *, after_ms: int = 0) -> None:
        """Give a claimed round back untouched: its entries are due again (``after_ms``)."""
        now_ms = to_millis(self._clock.now())
        retry = [*claimed.later, *((e.key, now_ms + after_ms) for e in claimed.entries)]
        try:
            await self._record_outcome(
                claimed, done=[], dead=[], lost=[], retry=retry, now_ms=now_ms
            )
        except StoreUnavailable as exc:  # they come back when the claim lease runs out
            log.warning("could not give back %d claimed entries: %s", len(retry), exc)

    async def _record_outcome(
        self,
        claimed: ClaimedRound,
        *,
        done: list[EntryKey],
        dead: list[DeadLetterRecord],
        lost: list[tuple[EntryKey, str]],
        retry: list[tuple[EntryKey, int]],
        now_ms: int,
    ) -> None:
        """One ``finish_redelivery`` for the entries of ``claimed`` (its token, partitions)."""
        await self._store.finish_redelivery(
            claimed.token,
            markers_topic=self._markers_topic,
            partitions=claimed.partitions,
            done=done,
            dead=dead,
            lost=lost,
            retry=retry,
            now_ms=now_ms,
        )

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
            first_seen = first_seen_ms(claimed, original)
            entry = (  # copying an Entry costs more than the rest of this loop: only if needed
                claimed
                if first_seen == claimed.first_seen_ms
                else replace(claimed, first_seen_ms=first_seen)
            )
            plan = plan_due(entry, self._policy_for(entry.origin_topic).max_attempts)
            target, record_headers, detail = outgoing_record(
                entry, plan, original, self._policy_for(entry.origin_topic), now_ms
            )
            try:
                if self._ensure_topic is not None and target != entry.origin_topic:
                    await self._ensure_topic(target, entry.origin_topic)
                ticket = await batches.add(target, original.key, original.value, record_headers)
            except (KafkaError, KmqError) as exc:
                log.warning("cannot produce to %s now: %r", target, exc)
                self._metrics.redelivery_errors.labels("produce").inc()
                retry.append((entry.key, now_ms + RETRY_AFTER_MS))
                continue
            sends.append((entry, plan, target, detail, ticket))
        return sends, lost, lost_entries

    def _report_lost(
        self,
        entries: Sequence[Entry],
        lost: Sequence[tuple[EntryKey, str]],
        counted: collections.Counter[tuple[Counter, str]],
    ) -> list[TrackerEvent]:
        """Log each lost message (an ERROR: an operator must know) and count it once recorded."""
        events: list[TrackerEvent] = []
        for entry, (_, reason) in zip(entries, lost, strict=True):
            counted[self._metrics.lost, entry.origin_topic] += 1
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

    async def _emit(self, events: Sequence[TrackerEvent]) -> None:
        if self._on_event is None:
            return
        for event in events:
            result = self._on_event(event)
            if result is not None:
                await result


async def _wait(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
