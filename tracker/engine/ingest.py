"""Marker ingest: markers topic -> in-memory coalescing -> one store transaction per flush.

The tracker replicas consume the markers topic as one consumer group; a replica acts only on
the markers partitions it is assigned, after claiming them in the store (epoch bump).

Offsets: the store records, in the same transaction as the state it applies, the first markers
offset of each partition that is *not* applied yet. That is where a replica resumes after a
crash or a rebalance (it seeks there on assignment), so markers are applied exactly once to the
store. Markers still waiting in the coalescing window are not applied and not counted as
applied: after a crash they are simply read again. Kafka offsets are committed too, after each
flush and only up to the applied position, so that consumer-lag monitoring works as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from tracker.clock import Clock, to_millis
from tracker.domain.entries import EntryKey
from tracker.domain.policy import PolicyLookup
from tracker.engine.coalescing_index import CoalescingIndex
from tracker.engine.fetch_responses import BROKER_SILENCE_MS, MAX_ENDS, FetchResponses
from tracker.engine.marker_verdicts import MarkerCheck, MarkerSorter
from tracker.engine.parking import InvalidMarkerParker, Rejected
from tracker.engine.signals import IngestListener, NoListener
from tracker.metrics import Metrics
from tracker.store import Fenced, StoreUnavailable
from tracker.store.port import PartitionProgress, PendingMarker, TrackerStore

log = logging.getLogger(__name__)

#: Longest time between two flushes of what left the coalescing window (``poll_once``).
FLUSH_INTERVAL = 0.2


@dataclass(slots=True)
class _Partition:
    """What a replica knows about one markers partition it owns."""

    epoch: int
    pending: deque[tuple[float, PendingMarker]] = field(default_factory=deque)
    seen_next: int | None = None  #: offset after the last record read
    applied_next: int | None = None  #: offset recorded in the store by the last flush
    #: tracker-clock time at which we had read everything the broker had (None: not yet)
    caught_up_ms: int | None = None
    #: (high watermark, wall-clock ms of the fetch response that reported it), oldest first:
    #: the broker's end at moments we have not read up to yet
    ends: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_ENDS))


@dataclass(frozen=True, slots=True)
class _Sorted:
    """One partition's fetched records, sorted into markers to apply and records to refuse."""

    partition: int
    state: _Partition
    records: list[Any]
    accepted: list[tuple[float, PendingMarker]]
    rejected: list[Rejected]


class MarkerIngest:
    """Consumes the markers topic and applies it to the store."""

    def __init__(
        self,
        *,
        consumer: Any,
        store: TrackerStore,
        parker: InvalidMarkerParker,
        markers_topic: str,
        replica_id: str,
        policy_for: PolicyLookup,
        clock: Clock,
        metrics: Metrics,
        coalesce_window: float,
        ack_grace_ms: int,
        max_records: int,
        max_pending: int,
        check_marker: MarkerCheck | None = None,
        listener: IngestListener | None = None,
        poll_wait: float = 0.2,
    ) -> None:
        self._consumer = consumer
        self._store = store
        self._parker = parker
        self._topic = markers_topic
        self._replica = replica_id
        self._policy_for = policy_for
        self._clock = clock
        self._metrics = metrics
        self._window = coalesce_window
        self._grace_ms = ack_grace_ms
        self._waiting = CoalescingIndex()  #: the markers in the coalescing window, by entry
        self._max_records = max_records
        self._max_pending = max_pending
        #: Longest wait of one poll for markers. The safe horizon moves only when a poll
        #: returns (``_note_caught_up``), and an empty fetch response is news too: the end of
        #: the log has not moved. Waiting longer than the consumer's ``fetch_max_wait_ms``
        #: held that news back: with no marker for a while, the horizon advanced once per
        #: poll wait (200 ms), and due entries waited for it.
        self._poll_wait = poll_wait
        self._next_flush = 0.0  #: monotonic time before which no new flush starts
        self._flush_interval = min(FLUSH_INTERVAL, self._window / 2)
        self._sorter = MarkerSorter(
            consumer=consumer, markers_topic=markers_topic, clock=clock, check=check_marker
        )
        self._fetches = FetchResponses(
            consumer=consumer, markers_topic=markers_topic, clock=clock, metrics=metrics
        )
        self._listener: IngestListener = listener or NoListener()
        self._owned: dict[int, _Partition] = {}
        self._unclaimed: set[int] = set()  #: assigned, but the store could not be reached
        self._lock = asyncio.Lock()  #: serializes polls with rebalance callbacks
        #: the flush running while the loop fetches and decodes the next markers (one at a
        #: time: a flush must see what the one before it wrote)
        self._flushing: asyncio.Task[None] | None = None
        self.store_ok = True
        self.broker_ok = False
        self._broker_lost_at: float | None = None  #: monotonic time the broker went quiet
        self.last_error: str | None = None

    # -- ownership (called by the rebalance listener) ----------------------------------

    def owned_epochs(self) -> dict[int, int]:
        return {p: state.epoch for p, state in self._owned.items()}

    def safe_until(self) -> dict[int, int]:
        """Per owned partition: entries due up to this time may be acted on.

        Every marker written before it has been read (we had caught up with the broker then,
        less ``ack_grace`` for markers still on their way), so an ACK or EXTEND that beat the
        deadline cannot be missed. Partitions still replaying their backlog are absent.
        """
        return {
            p: state.caught_up_ms - self._grace_ms
            for p, state in self._owned.items()
            if state.caught_up_ms is not None
        }

    def pending_keys(self, keys: Iterable[EntryKey]) -> set[EntryKey]:
        """The keys among ``keys`` that have markers waiting in the coalescing window."""
        return self._waiting.pending_keys(keys)

    def listener(self) -> ConsumerRebalanceListener:
        ingest = self

        class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            async def on_partitions_revoked(self, revoked: set[Any]) -> None:
                await ingest._revoke({tp.partition for tp in revoked if tp.topic == ingest._topic})

            async def on_partitions_assigned(self, assigned: set[Any]) -> None:
                await ingest._assign({tp.partition for tp in assigned if tp.topic == ingest._topic})

        return _Listener()

    async def _assign(self, partitions: set[int]) -> None:
        async with self._lock:
            try:
                await self._flushed()
            except StoreUnavailable as exc:  # its markers stay pending: flushed again later
                self._store_failed(exc)
            self._unclaimed |= partitions
            await self._claim_unclaimed()

    async def _claim_unclaimed(self) -> None:
        if not self._unclaimed:
            return
        wanted = sorted(self._unclaimed)
        tps = [TopicPartition(self._topic, p) for p in wanted]
        try:
            claims = await self._store.claim_partitions(
                self._topic, wanted, self._replica, to_millis(self._clock.now())
            )
        except StoreUnavailable as exc:
            self._store_failed(exc)
            self._consumer.pause(*tps)
            return
        self.store_ok = True
        for partition, claim in claims.items():
            tp = TopicPartition(self._topic, partition)
            self._forget(partition)
            self._owned[partition] = _Partition(claim.epoch, applied_next=claim.next_offset)
            if claim.next_offset is not None:
                self._consumer.seek(tp, claim.next_offset)
            log.info(
                "owning markers partition %s (epoch %s, resuming at %s)",
                partition,
                claim.epoch,
                claim.next_offset if claim.next_offset is not None else "committed offset",
            )
        self._unclaimed.clear()
        self._consumer.resume(*tps)
        self._metrics.owned_partitions.set(len(self._owned))
        self._listener.ownership_changed()

    async def _revoke(self, partitions: set[int]) -> None:
        async with self._lock:
            self._unclaimed -= partitions
            mine = partitions & set(self._owned)
            if not mine:
                return
            try:
                await self._flushed()
                await self._flush(force=True, only=mine)
            except (StoreUnavailable, Fenced) as exc:
                # Not applied: the next owner reads these markers again from the store offset.
                log.warning("could not flush revoked partitions %s: %s", sorted(mine), exc)
            epochs = {p: self._owned[p].epoch for p in mine}
            for p in mine:
                self._forget(p)
            try:
                await self._store.release_partitions(self._topic, epochs)
            except StoreUnavailable as exc:
                log.warning("could not release partitions %s: %s", sorted(mine), exc)
            self._metrics.owned_partitions.set(len(self._owned))
            self._listener.ownership_changed()

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Poll, park bad markers, flush due ones; until ``stopping`` is set, then drain."""
        backoff = 0.1
        while not stopping.is_set():
            try:
                await self.poll_once(wait=self._poll_wait)
                backoff = 0.1
            except StoreUnavailable as exc:
                self._store_failed(exc)
                # Backpressure: stop reading markers until the store takes writes again.
                await _wait(stopping, backoff)
                backoff = min(backoff * 2, 5.0)
            except KafkaError as exc:
                self._broker_seen(False)
                self.last_error = f"broker: {exc!r}"
                log.warning("markers consumer error: %r", exc)
                await _wait(stopping, backoff)
                backoff = min(backoff * 2, 5.0)
        await self.drain()

    async def poll_once(self, wait: float = 0.0) -> int:
        """One iteration: claim what is unclaimed, fetch, flush. Returns markers fetched.

        The flush of what left the coalescing window runs in the background while the next
        markers are fetched, decoded and checked (with a zero window it is applied before
        this returns); its failure surfaces here, on the next call.
        """
        if self._flushing is not None and self._flushing.done():
            await self._flushed()  # raises what the background flush raised
        async with self._lock:
            await self._claim_unclaimed()
            if self._unclaimed and not self._owned:
                return 0
            if not self.store_ok:
                await self._flushed()
                await self._flush(force=False)  # raises while the store is still down
            if self._pending_count() >= self._max_pending:
                await self._flushed()
                await self._flush(force=True)
        fetched: dict[Any, list[Any]] = await self._consumer.getmany(
            timeout_ms=int(wait * 1000), max_records=self._max_records
        )
        if fetched:
            self._broker_seen(True)
        count = 0
        async with self._lock:
            sorted_out: list[_Sorted] = []
            for tp, records in fetched.items():
                state = self._owned.get(tp.partition)
                if state is None or not records:
                    continue  # fenced or revoked meanwhile: the owner reads them
                count += len(records)
                sorted_out.append(await self._sort(tp.partition, state, records))
            await self._park([item for batch in sorted_out for item in batch.rejected], sorted_out)
            for batch in sorted_out:
                self._accept(batch)
            await self._note_caught_up()
            if self._window <= 0:
                await self._flushed()
                await self._flush(force=True)
            elif self._flushing is None and time.monotonic() >= self._next_flush:
                # Flushes start at most every FLUSH_INTERVAL: each takes what left the window
                # since the last one. Polls come every few ms under load (and every fetch
                # wait when idle); a flush per poll cut the window into slivers, and a START
                # and its ACK read by two polls in a row were applied apart instead of
                # cancelling out in memory.
                self._next_flush = time.monotonic() + self._flush_interval
                self._flushing = asyncio.get_running_loop().create_task(
                    self._flush(force=False), name="kmq-ingest-flush"
                )
        self._metrics.pending_markers.set(self._pending_count())
        return count

    async def _flushed(self) -> None:
        """Wait for the background flush, if one runs; raise what it raised."""
        task, self._flushing = self._flushing, None
        if task is not None:
            await task

    async def _sort(self, partition: int, state: _Partition, records: list[Any]) -> _Sorted:
        """Decode and check one partition's records: what to apply, what to refuse."""
        accepted, rejected = await self._sorter.sort(partition, records)
        return _Sorted(partition, state, records, accepted, rejected)

    async def _park(self, rejected: list[Rejected], fetched: list[_Sorted]) -> None:
        """Park every refused record of one poll in one round trip, before any is applied.

        Parked before the applied offsets can move past them, so none is ever dropped: if
        parking fails, nothing of this poll was taken and every partition is read again.
        """
        if not rejected:
            return
        try:
            await self._parker.park(rejected)
        except KafkaError:
            for batch in fetched:
                self._consumer.seek(
                    TopicPartition(self._topic, batch.partition), batch.records[0].offset
                )
            raise
        categories = Counter(item.category for item in rejected)
        for category, n in categories.items():
            self._metrics.markers_invalid.labels(category).inc(n)

    def _accept(self, batch: _Sorted) -> None:
        """Queue a partition's valid markers for the coalescing window."""
        kinds: Counter[str] = Counter()
        for _, pending in batch.accepted:
            kinds[pending.marker.kind.name] += 1
            self._waiting.hold(pending.marker, 1)
        for kind, count in kinds.items():
            self._metrics.markers_ingested.labels(kind).inc(count)
        batch.state.pending.extend(batch.accepted)
        batch.state.seen_next = batch.records[-1].offset + 1

    async def _note_caught_up(self) -> None:
        """Record, per partition, when we last had read everything the broker had.

        What the fetch responses tell (``tracker.engine.fetch_responses``): a safe horizon
        that moved is told to the listener, a broker that stopped answering is noted.
        """
        advanced = await self._fetches.note_caught_up(self._owned)
        if advanced is not None:
            self._listener.caught_up(advanced - self._grace_ms)  # what safe_until now allows
        answering = self.broker_answering()
        if not answering and self.broker_ok:
            log.warning("no fetch response from the broker for %.0f s", BROKER_SILENCE_MS / 1000)
            self.last_error = "broker: no fetch response"
        self._broker_seen(answering)

    def _broker_seen(self, answering: bool) -> None:
        """Whether the broker answers now: one log line when it is back, and the gauge.

        The line that it went away is written where that is noticed (with why); in between,
        nothing is repeated (aiokafka's own lines are limited in ``tracker.logs``), so an
        outage reads as two lines of ours: gone, and back after how long.
        """
        if not answering and self.broker_ok:
            self._broker_lost_at = time.monotonic()
        elif answering and not self.broker_ok and self._broker_lost_at is not None:
            away = time.monotonic() - self._broker_lost_at
            log.info("broker answering again after %.0f s", away)
            self._broker_lost_at = None
        self.broker_ok = answering
        self._metrics.broker_reachable.set(1 if answering else 0)

    def broker_answering(self) -> bool:
        """Whether fetch responses for our partitions still arrive (readiness asks this)."""
        return self._fetches.broker_answering(self._owned, otherwise=self.broker_ok)

    def _pending_count(self) -> int:
        return sum(len(s.pending) for s in self._owned.values())

    async def _flush(self, *, force: bool, only: set[int] | None = None) -> None:
        """Apply the markers that left the coalescing window (all of them if ``force``)."""
        cutoff = time.monotonic() - self._window
        batch: list[PendingMarker] = []
        progress: dict[int, PartitionProgress] = {}
        taken: dict[int, int] = {}
        for partition, state in self._owned.items():
            if only is not None and partition not in only:
                continue
            n = 0
            for arrived, pending in state.pending:
                if not force and arrived > cutoff:
                    break
                batch.append(pending)
                n += 1
            if n < len(state.pending):
                next_offset = state.pending[n][1].markers_offset
            elif state.seen_next is not None:
                next_offset = state.seen_next
            else:
                continue
            if next_offset == state.applied_next and n == 0:
                continue
            progress[partition] = PartitionProgress(state.epoch, next_offset)
            taken[partition] = n
        if not progress:
            return
        started = time.perf_counter()
        try:
            result = await self._store.apply(
                self._topic, progress, batch, self._policy_for, to_millis(self._clock.now())
            )
        except Fenced as exc:
            self._fenced(exc.partitions)
            # Nothing was applied; the partitions that are still ours retry next time.
            return
        self.store_ok = True
        self._metrics.flush_seconds.observe(time.perf_counter() - started)
        self._metrics.markers_coalesced.inc(max(0, len(batch) - result.upserted - result.deleted))
        for partition, n in taken.items():
            state = self._owned[partition]
            for _ in range(n):
                _, pending = state.pending.popleft()
                self._waiting.hold(pending.marker, -1)
            state.applied_next = progress[partition].next_offset
        await self._commit(progress)
        if result.anomalies:
            self._metrics.marker_anomalies.inc(len(result.anomalies))
            for pending, why in result.anomalies[:20]:
                log.info(
                    "marker %s/%s not applied: %s",
                    pending.markers_partition,
                    pending.markers_offset,
                    why,
                )
            await self._parker.park_anomalies(result.anomalies)
        if result.earliest_due_ms is not None:
            self._listener.due(result.earliest_due_ms)

    async def _commit(self, progress: dict[int, PartitionProgress]) -> None:
        offsets = {
            TopicPartition(self._topic, p): OffsetAndMetadata(pr.next_offset, "")
            for p, pr in progress.items()
        }
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:
            # Harmless: the store holds the authoritative position; this is for lag metrics.
            log.debug("markers offset commit failed: %r", exc)

    def _forget(self, partition: int) -> None:
        state = self._owned.pop(partition, None)
        if state is None:
            return
        with contextlib.suppress(KeyError):
            self._metrics.markers_lag.remove(str(partition))
        for _, pending in state.pending:
            self._waiting.hold(pending.marker, -1)

    def _fenced(self, partitions: set[int]) -> None:
        log.warning("fenced out of markers partitions %s: another replica owns them", partitions)
        self._metrics.fenced.inc()
        for p in partitions:
            self._forget(p)
        tps = [TopicPartition(self._topic, p) for p in partitions]
        self._consumer.pause(*tps)
        self._metrics.owned_partitions.set(len(self._owned))
        self._listener.ownership_changed()

    def _store_failed(self, exc: Exception) -> None:
        if self.store_ok:
            log.error("store unavailable, pausing marker ingest: %s", exc)
        self.store_ok = False
        self.last_error = f"store: {exc}"

    async def drain(self) -> None:
        """Apply everything read so far (shutdown, tests). Errors are logged, not raised."""
        async with self._lock:
            try:
                await self._flushed()
                await self._flush(force=True)
            except StoreUnavailable as exc:
                log.warning("could not apply pending markers at shutdown (re-read later): %s", exc)

    async def release_all(self) -> None:
        async with self._lock:
            with contextlib.suppress(StoreUnavailable, KafkaError):
                await self._flushed()  # what it did not apply is read again by the next owner
            epochs = self.owned_epochs()
            for p in list(self._owned):
                self._forget(p)
            if epochs:
                try:
                    await self._store.release_partitions(self._topic, epochs)
                except StoreUnavailable as exc:
                    log.warning("could not release partitions at shutdown: %s", exc)


async def _wait(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
