"""Building and producing marker workloads (bench helpers; real v1 markers and v2 ranges)."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer

from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import AnyMarker, Marker, encode_any, encode_marker
from tracker.protocol_v2 import RangeMarker

GROUP = "bench"
CONSUMER = "bench-worker:1"


def start(topic: str, partition: int, offset: int, timeout_ms: int) -> Marker:
    return Marker.start(
        GROUP, MessageId(topic, partition, offset), timeout_ms=timeout_ms, consumer=CONSUMER
    )


def ack(topic: str, partition: int, offset: int) -> Marker:
    return Marker.ack(GROUP, MessageId(topic, partition, offset))


def range_start(topic: str, partition: int, first: int, last: int, timeout_ms: int) -> RangeMarker:
    return RangeMarker.start(
        GROUP, topic, partition, first, last, timeout_ms=timeout_ms, consumer=CONSUMER
    )


def range_settle(
    topic: str, partition: int, first: int, last: int, exceptions: int = 0
) -> RangeMarker:
    return RangeMarker.settle(GROUP, topic, partition, first, last, exceptions=exceptions)


def delay(topic: str, partition: int, offset: int, delay_ms: int) -> Marker:
    return Marker.delay(GROUP, MessageId(topic, partition, offset), delay_ms=delay_ms)


async def produce_markers(
    producer: Any, markers_topic: str, markers: Iterable[AnyMarker], partitions: int
) -> int:
    """Produce markers with the batch API, each to its origin's markers partition, in order."""
    by_partition: dict[int, list[tuple[bytes, bytes]]] = defaultdict(list)
    count = 0
    for marker in markers:
        p = markers_partition(marker.origin_topic, marker.origin_partition, partitions)
        key = marker_key(marker.origin_topic, marker.origin_partition)
        by_partition[p].append((key, encode_any(marker)))
        count += 1
    await produce_raw(producer, markers_topic, by_partition)
    return count


def refused_value(rng: random.Random, valid: bytes) -> bytes:
    """A value the tracker must park: random bytes, a truncated or re-versioned marker, or
    trailing bytes after a valid one (the reliability fuzz covers every kind; these are the
    common ones, for a rate measurement)."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 64))
    if kind == 1:
        return valid[: rng.randrange(1, len(valid))]
    if kind == 2:
        return bytes([99]) + valid[1:]
    return valid + b"\x00"


async def produce_with_garbage(
    producer: Any, markers_topic: str, markers: Iterable[Marker], partitions: int, seed: int
) -> int:
    """Like :func:`produce_markers`, with one refused value after each marker (50 % garbage)."""
    rng = random.Random(seed)
    by_partition: dict[int, list[tuple[bytes | None, bytes]]] = defaultdict(list)
    count = 0
    for marker in markers:
        p = markers_partition(marker.origin_topic, marker.origin_partition, partitions)
        key = marker_key(marker.origin_topic, marker.origin_partition)
        value = encode_marker(marker)
        by_partition[p].append((key, value))
        by_partition[p].append((key, refused_value(rng, value)))
        count += 2
    await produce_raw(producer, markers_topic, by_partition)
    return count


async def produce_raw(
    producer: Any, topic: str, by_partition: dict[int, list[tuple[bytes | None, bytes]]] | Any
) -> None:
    futures = []
    for partition, items in by_partition.items():
        batch = producer.create_batch()
        for key, value in items:
            if batch.append(key=key, value=value, timestamp=None) is None:
                batch.close()
                futures.append(await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                batch.append(key=key, value=value, timestamp=None)
        batch.close()
        futures.append(await producer.send_batch(batch, topic, partition=partition))
    await asyncio.gather(*futures)


async def fill_queue(
    bootstrap: str, topic: str, partitions: int, per_partition: int, size: int = 100
) -> None:
    """``per_partition`` records of ``size`` bytes in each partition (offsets 0..n-1)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        value = b"q" * size
        step = 20_000
        for low in range(0, per_partition, step):
            n = min(step, per_partition - low)
            await produce_raw(producer, topic, {p: [(None, value)] * n for p in range(partitions)})
    finally:
        await producer.stop()


def chunked(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
