"""A huge backlog: the tracker starts with ~100k (CI) / ~1M (soak) markers waiting.

Before any tracker runs, ``MESSAGES`` messages are produced and, for each, the markers a
consumer would have written long ago: START and EXTEND (1 s leases, so every deadline has
passed by the time the tracker starts) and, for 90 % of them, an ACK. Then the tracker starts
on that backlog. It must:

* apply everything, holding at most ``max_pending_markers`` (+ one fetch) in memory;
* not redeliver a single acked message, although every lease in the backlog has expired: an
  entry is acted on only once ingest has caught up with its markers partition (the ACK further
  down the backlog always wins);
* redeliver every unacked message exactly once (attempt 2; no consumer takes the copies here,
  so nothing makes a third).

Reported: ingest throughput (markers/s), time to the first and to the last copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from integration.engine_support import FAST_GROUP, high_watermarks, tracker_settings
from support.broker import TopicFactory, unique_topic

from tracker import headers as h
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import Marker, encode_marker
from tracker.runtime import create_tracker

from .harness import (
    Figures,
    Outgoing,
    metric,
    produce_bulk,
    report,
    size,
    store_offsets,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 20250810
#: START + EXTEND + ACK (acked) or START + EXTEND (not acked): ~2.9 markers per message.
MESSAGES = size(35_000, 345_000)
ACK_SHARE = 0.9
QUEUE_PARTITIONS = 4
MARKERS_PARTITIONS = 4
MAX_PENDING = 50_000
MAX_RECORDS = 5_000
CHUNK = 500  #: messages whose markers are written together (as a consumer batch would be)
APPLIED_WITHIN = size(180.0, 900.0)
BACKENDS = ["postgres"]


def backlog_markers(
    markers: str, group: str, positions: list[MessageId], acked: set[int], partitions: int
) -> Iterator[Outgoing]:
    """The markers of every message, chunk by chunk: STARTs, EXTENDs, then the ACKs."""
    for first in range(0, len(positions), CHUNK):
        chunk = list(enumerate(positions[first : first + CHUNK], start=first))
        rounds = (
            [Marker.start(group, m, timeout_ms=1000, consumer="backlog") for _, m in chunk],
            [Marker.extend(group, m, timeout_ms=1000) for _, m in chunk],
            [Marker.ack(group, m) for i, m in chunk if i in acked],
        )
        for batch in rounds:
            for marker in batch:
                yield Outgoing(
                    markers,
                    encode_marker(marker),
                    marker_key(marker.origin_topic, marker.origin_partition),
                    markers_partition(marker.origin_topic, marker.origin_partition, partitions),
                )


async def copies_after(
    bootstrap: str, topic: str, starts: dict[int, int], within: float = 120.0
) -> list[tuple[MessageId, int]]:
    """``(origin, attempt)`` of every record after ``starts`` (the tracker's copies)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        ends = await high_watermarks(bootstrap, topic)
        tps = [TopicPartition(topic, p) for p in sorted(ends)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, starts.get(tp.partition, 0))
        out: list[tuple[MessageId, int]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while [await consumer.position(tp) for tp in tps] < [ends[tp.partition] for tp in tps]:
            assert loop.time() < deadline, "could not read the copies"
            batch = await consumer.getmany(timeout_ms=300, max_records=20_000)
            for records in batch.values():
                for r in records:
                    headers = dict(r.headers)
                    origin = headers.get(h.ORIGIN)
                    assert origin is not None, f"not a copy: {r}"
                    out.append((MessageId.parse(origin.decode()), int(headers[h.ATTEMPT])))
        return out
    finally:
        await consumer.stop()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_tracker_starts_on_a_huge_backlog(
    backend: str, kafka_bootstrap: str, topic_factory: TopicFactory, request: pytest.FixtureRequest
) -> None:
    database_url = request.getfixturevalue(f"{backend}_url")
    rng = random.Random(SEED)
    acked = {i for i in range(MESSAGES) if rng.random() < ACK_SHARE}
    topic = await topic_factory(partitions=QUEUE_PARTITIONS, prefix="backlog-queue")
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="backlog-markers")
    group = unique_topic("backlog-workers")
    started = time.monotonic()

    produced = await produce_bulk(
        kafka_bootstrap,
        (Outgoing(topic, b"m%d" % i, b"k%d" % i) for i in range(MESSAGES)),
    )
    positions = [MessageId(topic, p, o) for p, o in produced]
    marker_records = list(backlog_markers(markers, group, positions, acked, MARKERS_PARTITIONS))
    await produce_bulk(kafka_bootstrap, marker_records)
    backlog = len(marker_records)
    del marker_records
    queue_ends = await high_watermarks(kafka_bootstrap, topic)
    markers_ends = await high_watermarks(kafka_bootstrap, markers)
    assert sum(markers_ends.values()) == backlog
    written = time.monotonic() - started

    settings = tracker_settings(
        kafka_bootstrap,
        database_url,
        markers,
        markers_partitions=MARKERS_PARTITIONS,
        max_pending_markers=MAX_PENDING,
        ingest_max_records=MAX_RECORDS,
        redelivery_batch=1000,
        kafka_consumer_config=dict(FAST_GROUP),
        default_policy={"processing_timeout": 30, "max_attempts": 5},
    )
    unacked = {positions[i] for i in range(MESSAGES) if i not in acked}
    loop = asyncio.get_running_loop()
    max_pending = 0.0
    first_copy_s: float | None = None
    async with contextlib.AsyncExitStack() as stack:
        tracker = create_tracker(settings)
        t0 = loop.time()
        await tracker.start()
        stack.push_async_callback(tracker.close)

        def copies_made() -> float:
            return metric(tracker, "kmq_redeliveries_total", {"topic": topic})

        async def watch() -> None:
            nonlocal max_pending, first_copy_s
            while True:
                max_pending = max(max_pending, metric(tracker, "kmq_pending_markers"))
                if first_copy_s is None and copies_made() > 0:
                    first_copy_s = loop.time() - t0
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        stack.push_async_callback(_cancel, watcher)
        await wait_until(
            lambda: len(tracker.ingest.owned_epochs()) == MARKERS_PARTITIONS,
            within=40,
            what="the tracker to own every markers partition",
        )
        owning_s = loop.time() - t0

        async def applied() -> bool:
            offsets = await store_offsets(tracker.store, markers)
            return all(offsets.get(p, -1) >= end for p, end in markers_ends.items() if end)

        await wait_until(
            applied, within=APPLIED_WITHIN, what="the whole backlog applied", every=0.25
        )
        applied_s = loop.time() - t0
        await wait_until(
            lambda: copies_made() >= len(unacked),
            within=APPLIED_WITHIN,
            what=f"{len(unacked)} copies",
            explain=lambda: f"{copies_made():.0f} copies so far",
            every=0.25,
        )
        all_copies_s = loop.time() - t0

        async def nothing_left() -> bool:
            return not await tracker.store.list_entries(limit=10, group=group)

        await wait_until(nothing_left, within=60, what="no entry left")
        dead = [d for d in await tracker.store.list_dead_letters() if d["origin_topic"] == topic]
    copies = await copies_after(kafka_bootstrap, topic, queue_ends)

    per_origin = Counter(origin for origin, _ in copies)
    acked_positions = {positions[i] for i in acked}
    redelivered_acked = [o for o in per_origin if o in acked_positions]
    lost = [o for o in unacked if per_origin[o] == 0]
    ingest_s = applied_s - owning_s
    figures = report(
        Figures(
            test=f"backlog of {backlog} markers, {backend}",
            lost=len(lost),
            acked_then_redelivered=len(redelivered_acked),
            duplicates=sum(n - 1 for n in per_origin.values() if n > 1),
            duplicate_bound=0,
            recovery_s=applied_s,
            produced=MESSAGES,
            copies=len(copies),
            seconds=time.monotonic() - started,
            detail={
                "written_s": written,
                "owning_s": owning_s,
                "ingest_markers_per_s": backlog / max(ingest_s, 1e-3),
                "first_copy_s": first_copy_s,
                "all_copies_s": all_copies_s,
                "max_pending_markers": int(max_pending),
            },
        )
    )
    assert lost == [], f"{len(lost)} unacked messages never redelivered: {lost[:10]}"
    assert redelivered_acked == [], f"acked messages redelivered: {redelivered_acked[:10]}"
    assert figures.duplicates == 0, [o for o, n in per_origin.items() if n > 1][:10]
    assert {attempt for _, attempt in copies} == {2}
    assert len(copies) == len(unacked)
    assert dead == []
    assert max_pending <= MAX_PENDING + MAX_RECORDS, max_pending


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
