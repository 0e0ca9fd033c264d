"""Payload copies for delays that would outlive the topic's retention.

Kafka deletes records after ``retention.ms``. A message delayed (or retried) for longer than
that would be gone when due, so ingest flags such entries and this side task copies their
payload (key, value, headers, timestamp) into the store while the original still exists. If
the original is already gone, the entry is recorded as lost right away, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tracker.clock import Clock, to_millis
from tracker.engine.wakeup import wait_any
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalsUnavailable
from tracker.metrics import Metrics
from tracker.ports import OriginalsSource
from tracker.store import StoreUnavailable
from tracker.store.port import StoredPayload, TrackerStore

log = logging.getLogger(__name__)


class PayloadKeeper:
    def __init__(
        self,
        *,
        store: TrackerStore,
        originals: OriginalsSource,
        owned_partitions: Callable[[], list[int]],
        clock: Clock,
        metrics: Metrics,
        interval: float = 5.0,
        batch: int = 500,
    ) -> None:
        self._store = store
        self._originals = originals
        self._owned = owned_partitions
        self._clock = clock
        self._metrics = metrics
        self._interval = interval
        self._batch = batch
        self._wake = asyncio.Event()

    def notify(self) -> None:
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                copied = await self.run_once()
            except (StoreUnavailable, OriginalsUnavailable) as exc:
                log.warning("payload keeper paused: %s", exc)
                copied = 0
            if copied >= self._batch:
                continue
            self._wake.clear()
            await wait_any(self._wake, stopping, timeout=self._interval)

    async def run_once(self) -> int:
        """Copy the payloads of up to one batch of flagged entries; returns how many."""
        owned = self._owned()
        entries = await self._store.entries_needing_payload(owned, self._batch)
        if not entries:
            return 0
        positions = [MessageId(e.copy_topic, e.copy_partition, e.copy_offset) for e in entries]
        found = await self._originals.fetch(positions)
        keep: list[tuple[tuple[str, str, int, int], StoredPayload]] = []
        lost: list[tuple[tuple[str, str, int, int], str]] = []
        for entry, position in zip(entries, positions, strict=True):
            original = found.get(position)
            if original is None:
                continue
            if isinstance(original, Missing):
                lost.append(
                    (
                        entry.key,
                        f"original {position} gone before its payload was kept: " + original.reason,
                    )
                )
                self._metrics.lost.labels(entry.origin_topic).inc()
                origin = f"{entry.origin_topic}/{entry.origin_partition}/{entry.origin_offset}"
                log.error(
                    "message %s of group %s lost: %s",
                    origin,
                    entry.group_id,
                    lost[-1][1],
                    extra={"message_id": origin, "group": entry.group_id},
                )
            else:
                keep.append(
                    (
                        entry.key,
                        StoredPayload(
                            original.key, original.value, original.headers, original.timestamp_ms
                        ),
                    )
                )
        if keep:
            await self._store.store_payloads(keep)
        if lost:
            await self._store.mark_lost(lost, to_millis(self._clock.now()))
        return len(entries)
