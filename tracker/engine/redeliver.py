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
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tracker.clock import Clock, to_millis
from tracker.domain.entries import Entry, EntryKey
from tracker.domain.policy import TopicPolicy
from tracker.engine.claimed_ranges import (
    hold_back,
    offset_keys,
    queue_range_copies,
    range_positions,
    split_by_plan,
)
from tracker.engine.copies import CopyBatches
from tracker.engine.due_alarm import DueAlarm
from tracker.engine.read_ahead import ReadAhead
from tracker.engine.redelivery_rounds import ClaimedRound, QueuedRound, TrackerEvent, reap_rounds
from tracker.engine.round_copies import queue_copies, read_payloads
from tracker.engine.round_outcome import RETRY_AFTER_MS, tally_round
from tracker.engine.signals import IngestProgress
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord
from tracker.metrics import Metrics, observe_times
from tracker.ports import OriginalsSource
from tracker.store import StoreUnavailable
from tracker.store.port import DeadLetterRecord, TrackerStore

log = logging.getLogger(__name__)

WAIT_FOR_PENDING_MS = 100  #: look again at an entry with unapplied markers this much later
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
        read_ahead: ReadAhead | None = None,
    ) -> None:
        if depth < 2:
            raise ValueError("depth: at least 2 rounds (one recording, one being built)")
        self._store = store
        self._producer = producer
        #: rounds take what was read ahead (``read_ahead.originals`` wraps ``originals``)
        self._read_ahead = read_ahead
        self._originals: OriginalsSource = originals if read_ahead is None else read_ahead.originals
        self._markers_topic = markers_topic
        self._owned_epochs = progress.owned_epochs
        self._safe_until = progress.safe_until
        self._pending_keys = progress.pending_keys
        self._policy_for = policy_for
        self._clock = clock
        self._metrics = metrics
        self._batch = batch
        self._lease_ms = claim_lease_ms
        self._on_event = on_event
        self._ensure_topic = ensure_topic
        self._depth = depth
        self._phase = {
            name: metrics.redelivery_phase.labels(name)
            for name in ("claim", "read", "produce", "ack", "record")
        }
        self._alarm = DueAlarm(store=store, progress=progress, clock=clock, max_idle=max_idle)
        self.last_error: str | None = None

    # -- waking (see DueAlarm) -----------------------------------------------------------

    def notify_due(self, due_ms: int) -> None:
        """Ingest wrote an entry due at ``due_ms``: wake up if that is earlier than planned."""
        self._alarm.notify_due(due_ms)
        if self._read_ahead is not None:
            self._read_ahead.notify_due(due_ms)

    def notify_safe(self, safe_ms: int) -> None:
        """Ingest read further: entries due up to ``safe_ms`` may be actionable now."""
        self._alarm.notify_safe(safe_ms)

    def notify_ownership(self) -> None:
        """The replica's markers partitions changed: look again at once."""
        self._alarm.notify_ownership()
        if self._read_ahead is not None:
            self._read_ahead.notify_ownership()

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
        reader = (
            None
            if self._read_ahead is None
            else asyncio.create_task(
                self._read_ahead.run(stopping), name="kmq-redelivery-read-ahead"
            )
        )
        if reader is not None:  # a reader that failed ends the loop, which raises it below
            reader.add_done_callback(
                lambda task: (
                    None
                    if task.cancelled() or task.exception() is None
                    else claimed_rounds.put_nowait(None)
                )
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
            if reader is not None and reader.done():
                reader.result()  # the reader failed: raise it (the claimer is cancelled)
            await claimer  # raises what the claimer raised
            if reader is not None:
                await reader  # stops with ``stopping``
            # Stopping: every claimed round was produced; let their records finish.
            if recording:
                await asyncio.wait(recording)
            reap_rounds(recording)
        except BaseException:
            # Cancelled (or failed): stop at once. Rounds not recorded come back after their
            # claim lease, as after a crash.
            claimer.cancel()
            if reader is not None:
                reader.cancel()
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
            await self._alarm.sleep_until_due(stopping, claimed_nothing=claimed is None)

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
        claim = await self._store.claim_due_ranges(
            self._markers_topic,
            epochs=epochs,
            due_by=due_by,
            now_ms=now_ms,
            limit=self._batch,
            lease_ms=self._lease_ms,
            token=token,
        )
        self._phase["claim"].observe(time.perf_counter() - started)
        claimed, fenced = claim.entries, claim.fenced
        if fenced:
            log.warning("redelivery fenced out of markers partitions %s", sorted(fenced))
            self._metrics.fenced.inc()
        taken = len(claimed) + sum(t.open_count for t in claim.ranges)
        if self._read_ahead is not None:  # a whole batch: a backlog, which rounds read alone
            self._read_ahead.rounds_behind(taken >= self._batch)
        if not taken:
            return None
        # A message with markers still in the coalescing window (an ACK, say) is decided by
        # them: leave it until they are applied (a range's other offsets go on as a range).
        range_keys = [offset_keys(t) for t in claim.ranges]
        waiting = self._pending_keys(
            itertools.chain((e.key for e in claimed), itertools.chain.from_iterable(range_keys))
        )
        entries = [e for e in claimed if e.key not in waiting] if waiting else claimed
        later = [
            (e.key, max(e.due_at_ms or now_ms, now_ms + WAIT_FOR_PENDING_MS))
            for e in claimed
            if e.key in waiting
        ]
        ranges = claim.ranges
        if waiting:
            ranges = hold_back(
                claim.ranges, range_keys, waiting, now_ms + WAIT_FOR_PENDING_MS, later
            )
        lateness = self._metrics.redelivery_lateness
        for entry in entries:
            if entry.due_at_ms is not None:
                lateness.observe(max(0, now_ms - entry.due_at_ms) / 1000)
        for tracked_range in ranges:
            late = max(0, now_ms - tracked_range.due_at_ms) / 1000
            observe_times(lateness, late, tracked_range.open_count)
        return ClaimedRound(
            token=token,
            started=started,
            epochs={p: e for p, e in epochs.items() if p not in fenced},
            entries=entries,
            ranges=ranges,
            later=later,
            partitions={e.markers_partition for e in claimed}
            | {t.markers_partition for t in claim.ranges},
            full=taken >= self._batch,
        )

    async def _produce(self, claimed: ClaimedRound) -> QueuedRound:
        """Read the round's payloads, build its copies and queue them to the producer.

        Entries of a markers partition this replica lost since the claim are not produced
        (fencing: the partition's new owner republishes them); they are given back.
        """
        now_ms = to_millis(self._clock.now())
        retry: list[tuple[EntryKey, int]] = list(claimed.later)
        entries, ranges = claimed.entries, claimed.ranges
        owned = self._owned_epochs()
        moved = {p for p, epoch in claimed.epochs.items() if owned.get(p) != epoch}
        if moved:
            retry += [(e.key, now_ms) for e in entries if e.markers_partition in moved]
            entries = [e for e in entries if e.markers_partition not in moved]
            for tracked_range in ranges:
                if tracked_range.markers_partition in moved:
                    retry += [(key, now_ms) for key in offset_keys(tracked_range)]
            ranges = [t for t in ranges if t.markers_partition not in moved]
            log.info("markers partitions %s changed owner during a round", sorted(moved))
        copied, diverged = split_by_plan(ranges, self._policy_for)
        entries = [*entries, *diverged]
        started = time.perf_counter()
        payloads, found = await self._payloads(entries, range_positions(copied))
        built = time.perf_counter()
        self._phase["read"].observe(built - started)
        batches = CopyBatches(self._producer)
        sends, lost, lost_entries = await queue_copies(
            entries,
            payloads,
            batches,
            retry,
            now_ms,
            policy_for=self._policy_for,
            ensure_topic=self._ensure_topic,
            metrics=self._metrics,
        )
        range_sends, range_lost, range_lost_entries = await queue_range_copies(
            copied,
            found,
            batches,
            retry,
            now_ms,
            policy_for=self._policy_for,
            ensure_topic=self._ensure_topic,
            metrics=self._metrics,
        )
        await batches.queue()
        self._phase["produce"].observe(time.perf_counter() - built)
        acted = len(entries) + sum(t.open_count for t, _ in copied)
        return QueuedRound(
            claimed,
            now_ms,
            payloads,
            batches,
            sends,
            range_sends,
            [*lost, *range_lost],
            [*lost_entries, *range_lost_entries],
            retry,
            acted,
        )

    async def _payloads(
        self, entries: list[Entry], positions: list[MessageId]
    ) -> tuple[
        dict[EntryKey, OriginalRecord | Missing | None], dict[MessageId, OriginalRecord | Missing]
    ]:
        """Each entry's payload (None where the broker could not be read right now), and the
        originals at ``positions`` (left out where they could not be read)."""
        payloads, found, unavailable = await read_payloads(
            self._store, self._originals, entries, positions
        )
        if unavailable is not None:
            self.last_error = f"broker: {unavailable}"
            self._metrics.redelivery_errors.labels("read").inc()
            log.warning("cannot read originals now, retrying later: %s", unavailable)
        return payloads, found

    async def _record(self, queued: QueuedRound) -> int:
        """Wait for the round's copies to be acknowledged, then record the round."""
        started = time.perf_counter()
        await queued.batches.wait()
        acked = time.perf_counter()
        self._phase["ack"].observe(acked - started)
        claimed, now_ms, retry = queued.claimed, queued.now_ms, queued.retry
        tally = tally_round(queued, self._metrics, observed=self._on_event is not None)
        await self._finish(
            claimed, done=tally.done, dead=tally.dead, lost=queued.lost, retry=retry, now_ms=now_ms
        )
        if retry:  # entries put back: due again soon, maybe before the claimer's next look
            self.notify_due(min(due for _, due in retry))
        self._phase["record"].observe(time.perf_counter() - acked)
        for (counter, topic), count in tally.counted.items():
            counter.labels(topic).inc(count)
        self._metrics.redelivery_seconds.observe(time.perf_counter() - claimed.started)
        await self._emit(tally.events)
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
        for tracked_range in claimed.ranges:
            retry += [(key, now_ms + after_ms) for key in offset_keys(tracked_range)]
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
