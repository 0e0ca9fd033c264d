"""Parking refused markers on the invalid-markers topic, for inspection.

A marker the tracker cannot use (malformed, unknown topic, or valid but not applicable such
as a stale or unmatched one) is never silently skipped: it is counted, logged with its
position, and its raw bytes are produced to the invalid-markers topic with headers saying
where it came from and why it was refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from tracker.protocol import encode_marker
from tracker.store.manager import PendingMarker

log = logging.getLogger(__name__)

INVALID_REASON = "kmq-invalid-reason"
INVALID_CATEGORY = "kmq-invalid-category"
INVALID_SOURCE = "kmq-invalid-source"


@dataclass(frozen=True, slots=True)
class Rejected:
    record: Any  #: the markers record as consumed
    reason: str
    category: str  #: malformed | unknown_topic | anomaly


#: Refused markers logged one line each per window; the rest of the window is summed up.
LOG_EACH_PER_WINDOW = 10
LOG_WINDOW_S = 60.0


class _LogBudget:
    """At most ``limit`` individual log lines per window, so garbage cannot flood the log.

    A producer gone wrong can write thousands of bad markers a second; logging each one costs
    more than parking it and buries everything else. Every refused marker is still counted in
    ``kmq_markers_invalid_total`` and parked with its reason; the log shows the first few of each
    window and one summary line per batch for the rest.
    """

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float]) -> None:
        self._limit = limit
        self._window_s = window_s
        self._clock = clock
        self._window_start = -window_s
        self._used = 0

    def take(self) -> bool:
        now = self._clock()
        if now - self._window_start >= self._window_s:
            self._window_start, self._used = now, 0
        if self._used >= self._limit:
            return False
        self._used += 1
        return True


class InvalidMarkerParker:
    def __init__(
        self,
        producer: Any,
        invalid_topic: str,
        markers_topic: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._producer = producer
        self._topic = invalid_topic
        self._markers_topic = markers_topic
        self._log_budget = _LogBudget(LOG_EACH_PER_WINDOW, LOG_WINDOW_S, clock)
        self._next_partition = 0

    def _headers(self, category: str, reason: str, partition: int, offset: int) -> list[Any]:
        return [
            (INVALID_CATEGORY, category.encode()),
            (INVALID_REASON, reason.encode("utf-8", "replace")[:2048]),
            (INVALID_SOURCE, f"{self._markers_topic}/{partition}/{offset}".encode()),
        ]

    def _log(self, rejected: Sequence[Rejected]) -> None:
        unlogged: Counter[str] = Counter()
        for item in rejected:
            record = item.record
            if self._log_budget.take():
                log.warning(
                    "invalid marker at %s/%s/%s (%s): %s",
                    self._markers_topic,
                    record.partition,
                    record.offset,
                    item.category,
                    item.reason,
                )
            else:
                unlogged[item.category] += 1
        if unlogged:
            log.warning(
                "%d more invalid markers on %s (%s); all parked on %s",
                sum(unlogged.values()),
                self._markers_topic,
                ", ".join(f"{n} {category}" for category, n in sorted(unlogged.items())),
                self._topic,
            )

    async def _partition(self) -> int:
        """Spread parked batches over the invalid topic's partitions, one batch at a time."""
        partitions = sorted(await self._producer.partitions_for(self._topic))
        self._next_partition += 1
        return int(partitions[self._next_partition % len(partitions)])

    async def park(self, rejected: Sequence[Rejected]) -> None:
        """Produce the raw records and wait for the broker; raises ``KafkaError`` if it fails.

        The records go out as whole batches (one per ``max_batch_size``) rather than one
        ``send`` each: a markers batch that is half garbage must not be slowed down by it.
        """
        if not rejected:
            return
        self._log(rejected)
        partition = await self._partition()
        futures = []
        batch = self._producer.create_batch()
        for item in rejected:
            record = item.record
            headers = self._headers(item.category, item.reason, record.partition, record.offset)
            value, key = record.value, record.key
            if value is None and key is None:
                # Kafka clients refuse a record with neither key nor value: park an empty
                # value and say that it was a tombstone.
                value = b""
                headers = [*headers, (INVALID_CATEGORY + "-tombstone", b"1")]
            if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                batch.close()
                futures.append(
                    await self._producer.send_batch(batch, self._topic, partition=partition)
                )
                batch = self._producer.create_batch()
                # The first record of an empty batch is always taken, whatever its size.
                batch.append(key=key, value=value, timestamp=None, headers=headers)
        batch.close()  # complete: sent without lingering
        futures.append(await self._producer.send_batch(batch, self._topic, partition=partition))
        await asyncio.gather(*futures)

    async def park_anomalies(self, anomalies: Sequence[tuple[PendingMarker, str]]) -> None:
        """Best effort: these markers are valid and already accounted for in the store."""
        try:
            futures = [
                await self._producer.send(
                    self._topic,
                    value=encode_marker(pending.marker),
                    headers=self._headers(
                        "anomaly", why, pending.markers_partition, pending.markers_offset
                    ),
                )
                for pending, why in anomalies
            ]
            await asyncio.gather(*futures)
        except KafkaError as exc:
            log.warning("could not park %d marker anomalies: %r", len(anomalies), exc)
