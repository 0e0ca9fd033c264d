"""Bad input on the markers topic: the tracker parks every refused record, applies the rest.

**Garbage mixed in**: two markers topics get the same ``VALID`` valid markers (START+ACK pairs,
and STARTs left open with a long lease so that the store has work), in the same per-partition
order; the second topic also gets as many refused values mixed in between them (one after each
valid marker: 50 % of its records), drawn from every kind in :mod:`reliability.markers_fuzz`.
One tracker ingests each topic. Every refused value must be parked on the invalid-markers topic
(counted there, with its category), none of the clean topic's, and the valid markers must have
the same effect on the store as without the garbage. The rate of valid markers on each side is
reported with the figures; the pace *target* (at least half the clean rate with 50 % garbage)
is a benchmark, ``bench`` scenario 2 (c), measured on a quiet machine rather than asserted
while the rest of the suite competes for the same two cores.

**Absurd but valid**: markers the format allows but that ask for extremes (a record timestamp
200 years ahead or 55 years back, the longest lease, a ten-year delay, a message at offset
2^63-1) are handled without stalling anything: clamped, redelivered, kept, or recorded as lost.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from integration.engine_support import FAST_GROUP, tracker_settings
from integration.workload import high_watermarks
from support.broker import TopicFactory, unique_topic
from support.databases import sqlite_url

from tracker.engine.entries import State
from tracker.engine.parking import INVALID_CATEGORY
from tracker.engine.process import Tracker
from tracker.errors import MarkerError
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import MAX_DELAY_MS, MAX_TIMEOUT_MS, Marker, decode_marker, encode_marker
from tracker.store import Store

from .harness import (
    Figures,
    Outgoing,
    metric,
    produce_bulk,
    read_topic,
    report,
    size,
    store_offsets,
    wait_until,
)
from .markers_fuzz import GARBAGE, garbage

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 20250811
VALID = size(20_000, 150_000)
OPEN_SHARE = 0.1  #: STARTs left open (1 h lease): entries the store must hold
MARKERS_PARTITIONS = 4
QUEUE_PARTITIONS = 2
OPEN_LEASE_MS = 3_600_000


def valid_markers(topic: str, count: int, rng: random.Random) -> list[Marker]:
    """START+ACK pairs, and some STARTs left open; ``count`` markers in all."""
    out: list[Marker] = []
    offset = 0
    while len(out) < count:
        message = MessageId(topic, offset % QUEUE_PARTITIONS, offset)
        offset += 1
        if rng.random() < OPEN_SHARE or len(out) == count - 1:
            out.append(Marker.start("fuzz", message, timeout_ms=OPEN_LEASE_MS, consumer="c"))
        else:
            out.append(Marker.start("fuzz", message, timeout_ms=60_000, consumer="c"))
            out.append(Marker.ack("fuzz", message))
    return out


def as_record(markers: str, marker: Marker) -> Outgoing:
    return Outgoing(
        markers,
        encode_marker(marker),
        marker_key(marker.origin_topic, marker.origin_partition),
        markers_partition(marker.origin_topic, marker.origin_partition, MARKERS_PARTITIONS),
    )


@contextlib.asynccontextmanager
async def tracker_on(
    bootstrap: str, database_url: str, markers: str, **overrides: Any
) -> AsyncIterator[Tracker]:
    values: dict[str, Any] = {
        "markers_partitions": MARKERS_PARTITIONS,
        "kafka_consumer_config": dict(FAST_GROUP),
    }
    settings = tracker_settings(bootstrap, database_url, markers, **(values | overrides))
    tracker = Tracker(settings)
    try:
        await tracker.start()
        yield tracker
    finally:
        await tracker.close()


async def ingest_rate(bootstrap: str, database_url: str, markers: str, valid: int) -> float:
    """Valid markers per second, from owning every partition to having applied everything."""
    ends = await high_watermarks(bootstrap, markers)
    async with tracker_on(bootstrap, database_url, markers) as tracker:
        await wait_until(
            lambda: len(tracker.ingest.owned_epochs()) == MARKERS_PARTITIONS,
            within=40,
            what="the tracker to own every markers partition",
            every=0.01,
        )
        t0 = time.monotonic()

        async def applied() -> bool:
            offsets = await store_offsets(tracker.store, markers)
            return all(offsets.get(p, -1) >= end for p, end in ends.items() if end)

        await wait_until(applied, within=300, what="every marker applied", every=0.02)
        seconds = time.monotonic() - t0
        ingested = sum(
            metric(tracker, "kmq_markers_ingested_total", {"kind": kind})
            for kind in ("START", "ACK")
        )
        assert ingested == valid, f"{ingested} valid markers ingested, {valid} written"
    return valid / seconds


def test_every_garbage_kind_is_refused_or_names_nothing_that_exists() -> None:
    """The generators themselves: each value fails to decode or names a missing topic/partition."""
    rng = random.Random(SEED)
    for name, make in GARBAGE.items():
        for _ in range(50):
            value = make(rng, "orders")
            try:
                marker = decode_marker(value)
            except MarkerError:
                continue
            assert name in ("unknown topic", "unknown partition"), (name, value)
            assert marker.topic != "orders" or marker.partition >= 1000, (name, marker)


async def test_garbage_is_parked_and_valid_markers_are_applied(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    started = time.monotonic()
    topic = await topic_factory(partitions=QUEUE_PARTITIONS, prefix="fuzz-queue")
    markers = valid_markers(topic, VALID, rng)
    clean = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="fuzz-clean")
    mixed = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="fuzz-mixed")
    kinds: Counter[str] = Counter()
    mixed_records: list[Outgoing] = []
    for marker in markers:
        mixed_records.append(as_record(mixed, marker))
        kind, value = garbage(rng, topic)
        kinds[kind] += 1
        mixed_records.append(Outgoing(mixed, value, b"fuzz", rng.randrange(MARKERS_PARTITIONS)))
    await produce_bulk(kafka_bootstrap, (as_record(clean, m) for m in markers))
    await produce_bulk(kafka_bootstrap, mixed_records)
    garbage_count = len(mixed_records) - VALID

    clean_url = sqlite_url(tmp_path / "clean.sqlite3")
    mixed_url = sqlite_url(tmp_path / "mixed.sqlite3")
    clean_rate = await ingest_rate(kafka_bootstrap, clean_url, clean, VALID)
    mixed_rate = await ingest_rate(kafka_bootstrap, mixed_url, mixed, VALID)

    # What the mixed run left: parked records, store entries.
    parked = await read_topic(kafka_bootstrap, f"{mixed}.invalid")
    parked_by_category = Counter((r.header(INVALID_CATEGORY) or b"?").decode() for r in parked)
    clean_parked = await high_watermarks(kafka_bootstrap, f"{clean}.invalid")
    store = Store.from_url(mixed_url)
    try:
        open_entries = await store.count_entries()
    finally:
        await store.close()
    expected_open = sum(1 for m in markers if m.timeout_ms == OPEN_LEASE_MS)
    report(
        Figures(
            test="markers fuzz (50 % garbage)",
            lost=0,
            acked_then_redelivered=0,
            duplicates=0,
            duplicate_bound=0,
            recovery_s=None,
            produced=VALID,
            seconds=time.monotonic() - started,
            detail={
                "clean_valid_per_s": round(clean_rate),
                "mixed_valid_per_s": round(mixed_rate),
                "ratio": round(mixed_rate / clean_rate, 3),
                "garbage": garbage_count,
                "parked": len(parked),
                "parked_by_category": dict(parked_by_category),
                "garbage_kinds": len(kinds),
            },
        )
    )
    assert len(kinds) == len(GARBAGE), f"kinds not drawn: {set(GARBAGE) - set(kinds)}"
    assert len(parked) == garbage_count, f"{len(parked)} parked of {garbage_count} refused"
    assert sum(clean_parked.values()) == 0, "a valid marker was parked"
    assert set(parked_by_category) <= {"malformed", "unknown_topic"}, parked_by_category
    assert open_entries == expected_open, "the garbage changed what the valid markers did"


async def test_a_keyless_tombstone_is_parked_not_fatal(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    """A record with neither key nor value (any Kafka client can write one) is refused like
    any bad marker; it must not stop ingest (on restart it would be read again: a poison pill).
    """
    topic = await topic_factory(partitions=1, prefix="tomb-queue")
    markers = await topic_factory(partitions=1, prefix="tomb-markers")
    valid = Marker.start("tomb", MessageId(topic, 0, 7), timeout_ms=3_600_000)
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all") as producer:
        batch = producer.create_batch()
        batch.append(key=None, value=None, timestamp=None, headers=[])
        await (await producer.send_batch(batch, markers, partition=0))
        await producer.send_and_wait(markers, encode_marker(valid), partition=0)
    async with tracker_on(
        kafka_bootstrap, sqlite_url(tmp_path / "tomb.sqlite3"), markers, markers_partitions=1
    ) as tracker:

        async def past_it() -> bool:
            offsets = await store_offsets(tracker.store, markers)
            return offsets.get(0, -1) >= 2

        await wait_until(
            past_it,
            within=20,
            what="the tombstone parked and the START after it applied (ingest died?)",
        )
        health = await tracker.health()
        entry = await tracker.store.get_entry(("tomb", topic, 0, 7))
    parked = await read_topic(kafka_bootstrap, f"{markers}.invalid")
    assert health.running, health
    assert entry is not None, "the START after the tombstone was not applied"
    assert len(parked) == 1


async def test_absurd_but_valid_markers_are_handled(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    topic = await topic_factory(partitions=1, prefix="absurd-queue")
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="absurd-markers")
    group = unique_topic("absurd")
    positions = [
        MessageId(topic, p, o)
        for p, o in await produce_bulk(
            kafka_bootstrap, [Outgoing(topic, b"m%d" % i, b"k%d" % i) for i in range(4)]
        )
    ]
    future, past, longest, delayed = positions
    beyond = MessageId(topic, 0, 2**63 - 1)
    now_ms = int(time.time() * 1000)
    year_ms = 365 * 24 * 3600 * 1000
    cases = [
        # (marker, record timestamp)
        (Marker.start(group, future, timeout_ms=60_000), now_ms + 200 * year_ms),
        (Marker.start(group, past, timeout_ms=3_600_000), now_ms - 55 * year_ms),
        (Marker.start(group, longest, timeout_ms=MAX_TIMEOUT_MS), now_ms),
        (Marker.delay(group, delayed, delay_ms=MAX_DELAY_MS, reason="later"), now_ms),
        (Marker.start(group, beyond, timeout_ms=1), now_ms - 60_000),
    ]
    await produce_bulk(
        kafka_bootstrap,
        [
            Outgoing(
                markers,
                encode_marker(marker),
                marker_key(topic, marker.origin_partition),
                markers_partition(topic, marker.origin_partition, MARKERS_PARTITIONS),
                timestamp,
            )
            for marker, timestamp in cases
        ],
    )
    url = sqlite_url(tmp_path / "absurd.sqlite3")
    async with tracker_on(
        kafka_bootstrap,
        url,
        markers,
        max_idle_sleep=timedelta(seconds=1),
        default_policy={"processing_timeout": 30, "max_attempts": 5},
    ) as tracker:
        store = tracker.store

        async def entry(message: MessageId) -> Any:
            return await store.get_entry((group, message.topic, message.partition, message.offset))

        async def settled() -> bool:
            past_entry = await entry(past)
            beyond_entry = await entry(beyond)
            return (
                past_entry is None
                and beyond_entry is not None
                and beyond_entry.state is State.LOST
                and metric(tracker, "kmq_redeliveries_total", {"topic": topic}) >= 1
            )

        await wait_until(settled, within=60, what="the past START redelivered, offset 2^63-1 lost")
        loaded_at = int(time.time() * 1000)
        e_future = await entry(future)
        e_longest = await entry(longest)
        e_delayed = await entry(delayed)
        e_beyond = await entry(beyond)
        health = await tracker.health()
    # A record timestamp 200 years ahead is clamped to the tracker's clock: due in ~60 s.
    assert e_future is not None
    assert e_future.due_at_ms is not None
    assert now_ms + 50_000 <= e_future.due_at_ms <= loaded_at + 60_000
    # The longest lease and the ten-year delay are kept as asked.
    assert e_longest is not None
    assert e_longest.due_at_ms is not None
    assert e_longest.due_at_ms >= now_ms + MAX_TIMEOUT_MS - 1000
    assert e_delayed is not None
    assert e_delayed.state is State.DELAYED
    assert e_delayed.due_at_ms is not None
    assert e_delayed.due_at_ms >= now_ms + MAX_DELAY_MS - 1000
    assert e_delayed.keep_payload, "a ten-year delay outlives any retention: keep the payload"
    # Offset 2^63-1 never existed: recorded as lost with the reason, not retried forever.
    assert e_beyond is not None
    assert "unreadable" in e_beyond.reason, e_beyond.reason
    assert health.ready, health
