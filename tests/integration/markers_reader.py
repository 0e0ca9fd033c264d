"""Read back what landed on a markers topic (test helper, real broker)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from support.broker import topic_partition_ids

from tracker.protocol import AnyMarker, Marker, decode_marker


@dataclass(frozen=True)
class MarkerRecord:
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    marker: AnyMarker  #: a v1 Marker or a v2 RangeMarker

    @property
    def single(self) -> Marker:
        """The marker, which the test expects to be a per-message (v1) one."""
        assert isinstance(self.marker, Marker), f"expected a v1 marker, got {self.marker}"
        return self.marker


async def read_markers(
    bootstrap: str,
    topic: str,
    *,
    at_least: int,
    within: timedelta = timedelta(seconds=20),
) -> list[MarkerRecord]:
    """Read the markers topic from the beginning until ``at_least`` markers arrived.

    Waits on the condition with a deadline; then reads whatever else is already there up to
    the end offsets, so the caller also sees markers that should *not* be there.
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = await topic_partition_ids(bootstrap, topic, within=within.total_seconds())
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[MarkerRecord] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within.total_seconds()
        while len(out) < at_least and loop.time() < deadline:
            batch: dict[Any, list[Any]] = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                out.extend(
                    MarkerRecord(r.partition, r.offset, r.timestamp, r.key, decode_marker(r.value))
                    for r in records
                )
        end: dict[Any, int] = await consumer.end_offsets(tps)
        while loop.time() < deadline + 5:
            positions = [await consumer.position(tp) for tp in tps]
            if all(position >= end[tp] for position, tp in zip(positions, tps, strict=True)):
                break
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                out.extend(
                    MarkerRecord(r.partition, r.offset, r.timestamp, r.key, decode_marker(r.value))
                    for r in records
                )
        return sorted(out, key=lambda r: (r.partition, r.offset))
    finally:
        await consumer.stop()


async def committed_offset(bootstrap: str, group: str, topic: str, partition: int) -> int | None:
    """The group's committed offset, read as a group member would (``committed()``)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        offset: int | None = await consumer.committed(TopicPartition(topic, partition))
        return offset
    finally:
        await consumer.stop()
