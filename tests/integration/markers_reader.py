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
    # A position the broker calls out of range (a fresh partition whose log is still being
    # set up) is read again from the start rather than skipped to the end, which aiokafka's
    # default reset ("latest") would do without a word; the records are keyed by offset, so a
    # second read of a partition adds nothing twice.
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        partitions = await topic_partition_ids(bootstrap, topic, within=within.total_seconds())
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: dict[tuple[int, int], MarkerRecord] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within.total_seconds()
        while len(out) < at_least and loop.time() < deadline:
            _take(out, await consumer.getmany(timeout_ms=200))
        end: dict[Any, int] = await consumer.end_offsets(tps)
        while True:
            positions = [await consumer.position(tp) for tp in tps]
            if all(position >= end[tp] for position, tp in zip(positions, tps, strict=True)):
                break
            if loop.time() > deadline + 5:
                raise AssertionError(
                    f"read {len(out)} markers (wanted {at_least}); positions "
                    f"{dict(zip(partitions, positions, strict=True))} short of end offsets "
                    f"{ {tp.partition: offset for tp, offset in end.items()} }"
                )
            _take(out, await consumer.getmany(timeout_ms=200))
        return [out[at] for at in sorted(out)]
    finally:
        await consumer.stop()


def _take(out: dict[tuple[int, int], MarkerRecord], batch: dict[Any, list[Any]]) -> None:
    for records in batch.values():
        for r in records:
            out[r.partition, r.offset] = MarkerRecord(
                r.partition, r.offset, r.timestamp, r.key, decode_marker(r.value)
            )


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
