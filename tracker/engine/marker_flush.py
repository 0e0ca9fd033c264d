"""A flush: what left the coalescing window, applied to the store in one transaction.

The transaction applies the markers and records, per partition, the first markers offset not
applied yet, under the partition's epoch (a fenced replica's flush applies nothing). Only after
it are the markers taken out of the window and the Kafka offsets committed up to that
position. What a flush does is apart from ``tracker.engine.ingest``, which decides when one
runs (in the background of the next fetch, on revoke, at shutdown).
"""

from __future__ import annotations

import logging
import time
from itertools import islice
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from tracker.clock import Clock, to_millis
from tracker.domain.policy import PolicyLookup
from tracker.engine.coalescing_index import CoalescingIndex
from tracker.engine.flush_cut import cut
from tracker.engine.ingest_health import IngestHealth
from tracker.engine.markers_ownership import MarkersOwnership
from tracker.engine.parking import InvalidMarkerParker
from tracker.engine.parking_in_flight import ParkingInFlight
from tracker.engine.signals import IngestListener
from tracker.metrics import Metrics
from tracker.store import Fenced
from tracker.store.port import PartitionProgress, PendingMarker, TrackerStore

#: Ingest's logger: these lines are its lines (operators filter on it).
log = logging.getLogger("tracker.engine.ingest")


class MarkerFlush:
    """Applies the owned partitions' markers that left the coalescing window to the store."""

    def __init__(
        self,
        *,
        consumer: Any,
        store: TrackerStore,
        parker: InvalidMarkerParker,
        parking: ParkingInFlight,
        markers_topic: str,
        policy_for: PolicyLookup,
        clock: Clock,
        metrics: Metrics,
        coalesce_window: float,
        reach: float,
        waiting: CoalescingIndex,
        ownership: MarkersOwnership,
        listener: IngestListener,
        health: IngestHealth,
    ) -> None:
        self._consumer = consumer
        self._store = store
        self._parker = parker
        self._parking = parking
        self._topic = markers_topic
        self._policy_for = policy_for
        self._clock = clock
        self._metrics = metrics
        self._window = coalesce_window
        #: how far past the window's cut a flush may take batches to keep pairs together
        self._reach = reach
        self._waiting = waiting
        self._ownership = ownership
        self._listener = listener
        self._health = health

    async def flush(self, *, force: bool, only: set[int] | None = None) -> None:
        """Apply the markers that left the coalescing window (all of them if ``force``),
        cut so that a START and its SETTLE go together (``tracker.engine.flush_cut``)."""
        cutoff = time.monotonic() - self._window
        batch: list[PendingMarker] = []
        progress: dict[int, PartitionProgress] = {}
        taken: dict[int, int] = {}
        for partition, state in self._ownership.owned.items():
            if only is not None and partition not in only:
                continue
            # whole polled batches (all of a batch arrived at once), cut between pairs
            n = len(state.pending) if force else cut(state.pending, cutoff, self._reach)
            for queued in islice(state.pending, 0, n):
                batch.extend(queued.markers)
            if n < len(state.pending):
                next_offset = state.pending[n].markers[0].markers_offset
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
        # The offsets recorded below move past refused records only once they are parked;
        # a parking that failed raises here, and nothing is applied.
        await self._parking.settle()
        started = time.perf_counter()
        try:
            result = await self._store.apply(
                self._topic, progress, batch, self._policy_for, to_millis(self._clock.now())
            )
        except Fenced as exc:
            self._ownership.fenced(exc.partitions)
            # Nothing was applied; the partitions that are still ours retry next time.
            return
        self._health.store_ok = True
        self._metrics.flush_seconds.observe(time.perf_counter() - started)
        self._metrics.markers_coalesced.inc(max(0, len(batch) - result.upserted - result.deleted))
        for partition, n in taken.items():
            state = self._ownership.owned[partition]
            for _ in range(n):
                done = state.pending.popleft()
                state.pending_markers -= len(done.markers)
                self._waiting.remove(done)
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
