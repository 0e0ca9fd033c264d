"""Marker ingest: markers topic -> in-memory coalescing -> one store transaction per flush.

The tracker replicas consume the markers topic as one consumer group; a replica acts only on
the markers partitions it is assigned, after claiming them in the store (epoch bump).

Offsets: the store records, in the same transaction as the state it applies, the first markers
offset of each partition that is *not* applied yet. That is where a replica resumes after a
crash or a rebalance (it seeks there on assignment), so markers are applied exactly once to the
store. Markers still waiting in the coalescing window are not applied and not counted as
applied: after a crash they are simply read again. Kafka offsets are committed too, after each
flush and only up to the applied position, so that consumer-lag monitoring works as usual.

This module is the loop: when to claim, fetch, park and flush, under one lock shared with the
rebalance callbacks. What each step does is in its own module: which partitions are owned
(``markers_ownership``), what is read of each (``partition_reading``), what is refused
(``marker_verdicts``), what a flush applies and commits (``marker_flush``), how far reading
has caught up (``fetch_responses``), whether the store and the broker answer (``ingest_health``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from tracker.clock import Clock
from tracker.domain.entries import EntryKey
from tracker.domain.policy import PolicyLookup
from tracker.engine.coalescing_index import CoalescingIndex
from tracker.engine.fetch_responses import BROKER_SILENCE_MS, FetchResponses
from tracker.engine.ingest_health import IngestHealth
from tracker.engine.marker_flush import MarkerFlush
from tracker.engine.marker_verdicts import MarkerCheck, MarkerSorter
from tracker.engine.markers_ownership import MarkersOwnership
from tracker.engine.parking import InvalidMarkerParker
from tracker.engine.parking_in_flight import ParkingInFlight
from tracker.engine.partition_reading import PartitionReading, PendingBatch, SortedRecords
from tracker.engine.signals import IngestListener, NoListener
from tracker.metrics import Metrics
from tracker.store import Fenced, StoreUnavailable
from tracker.store.port import TrackerStore

log = logging.getLogger(__name__)

#: Longest time between two flushes of what left the coalescing window (``poll_once``).
FLUSH_INTERVAL = 0.2

#: a queued marker's kind, for the per-kind count of markers ingested
_KIND = attrgetter("marker.kind")


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
        #: refused records being parked while the loop goes on (each flush waits for them)
        self._parking = ParkingInFlight(parker, metrics)
        self._topic = markers_topic
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
        self._health = IngestHealth(metrics)
        self._ownership = MarkersOwnership(
            consumer=consumer,
            store=store,
            markers_topic=markers_topic,
            replica_id=replica_id,
            clock=clock,
            metrics=metrics,
            waiting=self._waiting,
            listener=self._listener,
            health=self._health,
        )
        self._flusher = MarkerFlush(
            consumer=consumer,
            store=store,
            parker=parker,
            parking=self._parking,
            markers_topic=markers_topic,
            policy_for=policy_for,
            clock=clock,
            metrics=metrics,
            coalesce_window=coalesce_window,
            reach=self._flush_interval,
            waiting=self._waiting,
            ownership=self._ownership,
            listener=self._listener,
            health=self._health,
        )
        self._lock = asyncio.Lock()  #: serializes polls with rebalance callbacks
        #: the flush running while the loop fetches and decodes the next markers (one at a
        #: time: a flush must see what the one before it wrote)
        self._flushing: asyncio.Task[None] | None = None

    @property
    def _owned(self) -> dict[int, PartitionReading]:
        """The partitions owned, with what is read of each (ownership keeps them)."""
        return self._ownership.owned

    # -- health (readiness asks these) ---------------------------------------------------

    @property
    def store_ok(self) -> bool:
        """Whether the store answered the last claim or flush."""
        return self._health.store_ok

    @property
    def broker_ok(self) -> bool:
        """Whether the broker answered, as the loop last saw it (see ``broker_answering``)."""
        return self._health.broker_ok

    @property
    def last_error(self) -> str | None:
        return self._health.last_error

    # -- ownership (called by the rebalance listener) ----------------------------------

    def owned_epochs(self) -> dict[int, int]:
        return self._ownership.owned_epochs()

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
                self._health.store_failed(exc)
            self._ownership.assigned(partitions)
            await self._ownership.claim_unclaimed()

    async def _revoke(self, partitions: set[int]) -> None:
        async with self._lock:
            mine = self._ownership.revoked(partitions)
            if not mine:
                return
            try:
                await self._flushed()
                await self._flusher.flush(force=True, only=mine)
            except (StoreUnavailable, Fenced, KafkaError) as exc:
                # Not applied (the store, or parking refused markers, failed): the next owner
                # reads these markers again from the store offset.
                log.warning("could not flush revoked partitions %s: %s", sorted(mine), exc)
            await self._ownership.release(mine)
            self._parking.forget(mine)  # not parked yet: their next owner reads and parks them

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Poll, park bad markers, flush due ones; until ``stopping`` is set, then drain."""
        backoff = 0.1
        while not stopping.is_set():
            try:
                await self.poll_once(wait=self._poll_wait)
                backoff = 0.1
            except StoreUnavailable as exc:
                self._health.store_failed(exc)
                # Backpressure: stop reading markers until the store takes writes again.
                await _wait(stopping, backoff)
                backoff = min(backoff * 2, 5.0)
            except KafkaError as exc:
                self._health.broker_seen(False)
                self._health.last_error = f"broker: {exc!r}"
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
            await self._ownership.claim_unclaimed()
            if self._ownership.only_unclaimed():
                return 0
            if not self._health.store_ok:
                await self._flushed()
                await self._flusher.flush(force=False)  # raises while the store is still down
            if self._ownership.pending_count() >= self._max_pending:
                await self._flushed()
                await self._flusher.flush(force=True)
        fetched: dict[Any, list[Any]] = await self._consumer.getmany(
            timeout_ms=int(wait * 1000), max_records=self._max_records
        )
        if fetched:
            self._health.broker_seen(True)
        count = 0
        async with self._lock:
            sorted_out: list[SortedRecords] = []
            for tp, records in fetched.items():
                state = self._owned.get(tp.partition)
                if state is None or not records:
                    continue  # fenced or revoked meanwhile: the owner reads them
                count += len(records)
                sorted_out.append(await self._sort(tp.partition, state, records))
            # Parked while the loop goes on; the flush that moves the applied offsets past
            # these records waits for it (tracker.engine.parking_in_flight).
            self._parking.start([item for batch in sorted_out for item in batch.rejected])
            for batch in sorted_out:
                self._accept(batch)
            await self._note_caught_up()
            if self._window <= 0:
                await self._flushed()
                await self._flusher.flush(force=True)
            elif self._flushing is None and time.monotonic() >= self._next_flush:
                # Flushes start at most every FLUSH_INTERVAL: each takes what left the window
                # since the last one. Polls come every few ms under load (and every fetch
                # wait when idle); a flush per poll cut the window into slivers, and a START
                # and its ACK read by two polls in a row were applied apart instead of
                # cancelling out in memory.
                self._next_flush = time.monotonic() + self._flush_interval
                self._flushing = asyncio.get_running_loop().create_task(
                    self._flusher.flush(force=False), name="kmq-ingest-flush"
                )
        self._metrics.pending_markers.set(self._ownership.pending_count())
        return count

    async def _flushed(self) -> None:
        """Wait for the background flush, if one runs; raise what it raised."""
        task, self._flushing = self._flushing, None
        if task is not None:
            await task

    async def _sort(
        self, partition: int, state: PartitionReading, records: list[Any]
    ) -> SortedRecords:
        """Decode and check one partition's records: what to apply, what to refuse."""
        arrived = time.monotonic()
        accepted, rejected = await self._sorter.sort(partition, records)
        return SortedRecords(partition, state, records, arrived, accepted, rejected)

    def _accept(self, batch: SortedRecords) -> None:
        """Queue a partition's valid markers for the coalescing window, as one batch."""
        if batch.accepted:
            kinds = Counter(map(_KIND, batch.accepted))
            for kind, count in kinds.items():
                self._metrics.markers_ingested.labels(kind.name).inc(count)
            pending = PendingBatch(batch.arrived, batch.accepted)
            batch.state.pending.append(pending)
            batch.state.pending_markers += len(batch.accepted)
            self._waiting.add(pending)
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
        if not answering and self._health.broker_ok:
            log.warning("no fetch response from the broker for %.0f s", BROKER_SILENCE_MS / 1000)
            self._health.last_error = "broker: no fetch response"
        self._health.broker_seen(answering)

    def broker_answering(self) -> bool:
        """Whether fetch responses for our partitions still arrive (readiness asks this)."""
        return self._fetches.broker_answering(self._owned, otherwise=self._health.broker_ok)

    async def drain(self) -> None:
        """Apply everything read so far (shutdown, tests). Errors are logged, not raised."""
        async with self._lock:
            try:
                await self._flushed()
                await self._flusher.flush(force=True)
            except (StoreUnavailable, KafkaError) as exc:
                log.warning("could not apply pending markers at shutdown (re-read later): %s", exc)

    async def release_all(self) -> None:
        async with self._lock:
            with contextlib.suppress(StoreUnavailable, KafkaError):
                await self._flushed()  # what it did not apply is read again by the next owner
            await self._ownership.release_all()
            await self._parking.close()  # what it parks is read again by the next owner


async def _wait(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
