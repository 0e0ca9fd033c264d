"""Which markers partitions this replica owns: claimed in the store, forgotten when lost.

Kafka assigns the partitions, but a replica acts on one only after claiming it in the store
(the epoch bump that fences the previous owner) and seeking to the offset the store recorded
as applied. A partition whose claim could not reach the store stays paused and unclaimed until
a later poll claims it. This bookkeeping is apart from ``tracker.engine.ingest``, which holds
the lock and runs the flushes around it: it says what is owned, the loop says when.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiokafka import TopicPartition

from tracker.clock import Clock, to_millis
from tracker.engine.coalescing_index import CoalescingIndex
from tracker.engine.ingest_health import IngestHealth
from tracker.engine.partition_reading import PartitionReading
from tracker.engine.signals import IngestListener
from tracker.metrics import Metrics
from tracker.store import StoreUnavailable
from tracker.store.port import TrackerStore

#: Ingest's logger: these lines are its lines (operators filter on it).
log = logging.getLogger("tracker.engine.ingest")


class MarkersOwnership:
    """The markers partitions this replica is assigned, and those it has claimed (owns)."""

    def __init__(
        self,
        *,
        consumer: Any,
        store: TrackerStore,
        markers_topic: str,
        replica_id: str,
        clock: Clock,
        metrics: Metrics,
        waiting: CoalescingIndex,
        listener: IngestListener,
        health: IngestHealth,
    ) -> None:
        self._consumer = consumer
        self._store = store
        self._topic = markers_topic
        self._replica = replica_id
        self._clock = clock
        self._metrics = metrics
        self._waiting = waiting
        self._listener = listener
        self._health = health
        #: the partitions claimed, with what is read of each (only ever changed in place)
        self.owned: dict[int, PartitionReading] = {}
        self._unclaimed: set[int] = set()  #: assigned, but the store could not be reached

    def owned_epochs(self) -> dict[int, int]:
        return {p: state.epoch for p, state in self.owned.items()}

    def pending_count(self) -> int:
        """How many markers of the owned partitions wait in the coalescing window."""
        return sum(s.pending_markers for s in self.owned.values())

    def only_unclaimed(self) -> bool:
        """Whether partitions wait for a claim while none is owned (nothing to read yet)."""
        return bool(self._unclaimed) and not self.owned

    def assigned(self, partitions: set[int]) -> None:
        """Kafka assigned ``partitions``: claimed by the next :meth:`claim_unclaimed`."""
        self._unclaimed |= partitions

    def revoked(self, partitions: set[int]) -> set[int]:
        """Kafka revoked ``partitions``: those of them owned, to flush and :meth:`release`."""
        self._unclaimed -= partitions
        return partitions & set(self.owned)

    async def claim_unclaimed(self) -> None:
        """Claim the assigned partitions not claimed yet: epoch bump, seek, resume.

        A partition is read only from where the store has it applied, so that each marker is
        applied once. If the store cannot be reached, the partitions stay paused (nothing is
        read that could not be applied) and the next call claims them.
        """
        if not self._unclaimed:
            return
        wanted = sorted(self._unclaimed)
        tps = [TopicPartition(self._topic, p) for p in wanted]
        try:
            claims = await self._store.claim_partitions(
                self._topic, wanted, self._replica, to_millis(self._clock.now())
            )
        except StoreUnavailable as exc:
            self._health.store_failed(exc)
            self._consumer.pause(*tps)
            return
        self._health.store_ok = True
        for partition, claim in claims.items():
            tp = TopicPartition(self._topic, partition)
            self.forget(partition)
            self.owned[partition] = PartitionReading(claim.epoch, applied_next=claim.next_offset)
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
        self._metrics.owned_partitions.set(len(self.owned))
        self._listener.ownership_changed()

    def forget(self, partition: int) -> None:
        """Drop a partition and the markers read of it (not applied: its owner reads them)."""
        state = self.owned.pop(partition, None)
        if state is None:
            return
        with contextlib.suppress(KeyError):
            self._metrics.markers_lag.remove(str(partition))
        for pending in state.pending:
            self._waiting.remove(pending)

    def fenced(self, partitions: set[int]) -> None:
        """Another replica claimed ``partitions`` (the store refused our epoch): stop reading."""
        log.warning("fenced out of markers partitions %s: another replica owns them", partitions)
        self._metrics.fenced.inc()
        for p in partitions:
            self.forget(p)
        tps = [TopicPartition(self._topic, p) for p in partitions]
        self._consumer.pause(*tps)
        self._metrics.owned_partitions.set(len(self.owned))
        self._listener.ownership_changed()

    async def release(self, partitions: set[int]) -> None:
        """Give up owned ``partitions`` (revoked): forgotten here, released in the store."""
        epochs = {p: self.owned[p].epoch for p in partitions}
        for p in partitions:
            self.forget(p)
        try:
            await self._store.release_partitions(self._topic, epochs)
        except StoreUnavailable as exc:
            log.warning("could not release partitions %s: %s", sorted(partitions), exc)
        self._metrics.owned_partitions.set(len(self.owned))
        self._listener.ownership_changed()

    async def release_all(self) -> None:
        """Give up every owned partition in the store (shutdown)."""
        epochs = self.owned_epochs()
        for p in list(self.owned):
            self.forget(p)
        if epochs:
            try:
                await self._store.release_partitions(self._topic, epochs)
            except StoreUnavailable as exc:
                log.warning("could not release partitions at shutdown: %s", exc)
