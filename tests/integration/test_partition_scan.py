"""Reading a partition on from a known position to its end, on the broker
(:meth:`tracker.kafka.scan.PartitionScanner.read_to_end`, the message views' markers tail)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiokafka import TopicPartition

from tracker.kafka.scan import PartitionScanner

from .api_support import produce

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def scanner(kafka_bootstrap: str) -> AsyncIterator[PartitionScanner]:
    scanner = PartitionScanner(kafka_bootstrap, timeout=15.0)
    try:
        yield scanner
    finally:
        await scanner.stop()


async def test_read_to_end_passes_what_follows_a_position_and_says_where_the_end_is(
    kafka_bootstrap: str, topic_factory: TopicFactory, scanner: PartitionScanner
) -> None:
    topic = await topic_factory(partitions=1, prefix="scan")
    tp = TopicPartition(topic, 0)
    await produce(kafka_bootstrap, topic, [(b"k", b"v%d" % i, []) for i in range(3)])
    seen: list[Any] = []

    assert await scanner.read_to_end(tp, 0, seen.append) == 3
    assert [(r.offset, r.value) for r in seen] == [(0, b"v0"), (1, b"v1"), (2, b"v2")]

    await produce(kafka_bootstrap, topic, [(b"k", b"v3", []), (b"k", b"v4", [])])
    seen.clear()
    assert await scanner.read_to_end(tp, 3, seen.append) == 5
    assert [r.offset for r in seen] == [3, 4]  # not the record before, read to answer at once

    seen.clear()
    assert await scanner.read_to_end(tp, 5, seen.append) == 5  # nothing new
    assert seen == []
    # A position past the end: the partition restarted (its topic was created again).
    assert await scanner.read_to_end(tp, 9, seen.append) == 5
    assert seen == []
    # The scanner is free again for other reads.
    assert (await scanner.bounds([tp]))[tp] == (0, 5)
