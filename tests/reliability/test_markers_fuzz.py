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

**Absurd but valid**: markers the format allows but that ask for extremes are handled without
stalling anything: clamped, redelivered, kept, or recorded as lost. Two kinds of extreme:

* *in the payload*, the furthest a marker can push a deadline: the longest lease
  (``MAX_TIMEOUT_MS``), the ten-year delay (``MAX_DELAY_MS``), a message at offset 2^63-1;
* *in the record timestamp*, the reference of every duration (docs/protocol.md, Time): a
  writer clock ahead of the tracker's is clamped to the tracker's receive time, one behind it
  is taken as is. On a ``CreateTime`` topic a writer's stamp reaches the tracker only within
  what the broker accepts: Apache Kafka 4 refuses stamps more than an hour ahead of its clock
  (``message.timestamp.after.max.ms``; ``InvalidTimestampException``, the whole batch) and
  accepts any past one (``message.timestamp.before.max.ms`` is unbounded), so the test writes
  50 minutes ahead and 55 years back. On a ``LogAppendTime`` topic (what the tracker creates)
  the broker ignores the writer's stamp, however absurd: Apache replaces it with its own, tansu
  keeps it and the tracker clamps it; either way the lease counts from about now.

**Refused by the invalid topic**: a garbage record too large for the invalid-markers topic is
parked as a stub (Apache Kafka; tansu enforces no size limit and takes it whole), and ingest
goes on after it.
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
from integration.engine_support import FAST_GROUP, high_watermarks, tracker_settings
from support.broker import TopicFactory, create_topics, delete_topics, unique_topic
from support.databases import sqlite_url

from tracker.domain.entries import State
from tracker.engine.process import Tracker
from tracker.errors import MarkerError
from tracker.headers import INVALID_CATEGORY, INVALID_SIZE, INVALID_SOURCE, INVALID_STUB
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import (
    MAX_DELAY_MS,
    MAX_TIMEOUT_MS,
    AnyMarker,
    Marker,
    decode_marker,
    encode_any,
    encode_marker,
)
from tracker.protocol_v2 import RangeKind, RangeMarker
from tracker.runtime import create_tracker
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


def valid_markers(topic: str, count: int, rng: random.Random) -> list[AnyMarker]:
    """START+ACK pairs, and some STARTs left open; ``count`` markers in all. One in ten is a
    v2 range pair instead (RANGE_START, RANGE_SETTLE with a few offsets left open)."""
    out: list[AnyMarker] = []
    offset = 0
    while len(out) < count:
        if rng.random() < 0.1 and len(out) < count - 1:
            partition = rng.randrange(QUEUE_PARTITIONS)
            first = 10_000_000 + offset  # apart from the v1 offsets
            last = first + rng.randint(0, 99)
            offset = last - 10_000_000 + 1
            open_bits = rng.getrandbits(last - first + 1) & rng.getrandbits(last - first + 1)
            open_bits &= rng.getrandbits(last - first + 1)  # ~1 in 8 left open
            out.append(
                RangeMarker.start(
                    "fuzz", topic, partition, first, last, timeout_ms=OPEN_LEASE_MS, consumer="c"
                )
            )
            if open_bits != (1 << (last - first + 1)) - 1:
                out.append(
                    RangeMarker.settle("fuzz", topic, partition, first, last, exceptions=open_bits)
                )
            continue
        message = MessageId(topic, offset % QUEUE_PARTITIONS, offset)
        offset += 1
        if rng.random() < OPEN_SHARE or len(out) == count - 1:
            out.append(Marker.start("fuzz", message, timeout_ms=OPEN_LEASE_MS, consumer="c"))
        else:
            out.append(Marker.start("fuzz", message, timeout_ms=60_000, consumer="c"))
            out.append(Marker.ack("fuzz", message))
    return out


def expected_open_entries(markers: list[AnyMarker]) -> int:
    """How many entries the valid markers leave in flight (open STARTs, unsettled offsets)."""
    open_count = 0
    for marker in markers:
        if isinstance(marker, RangeMarker):
            if marker.kind is RangeKind.RANGE_START:
                open_count += marker.covered.bit_count()
            else:
                open_count -= marker.covered.bit_count()
        elif marker.timeout_ms == OPEN_LEASE_MS:
            open_count += 1
    return open_count


def as_record(markers: str, marker: AnyMarker) -> Outgoing:
    return Outgoing(
        markers,
        encode_any(marker),
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
    tracker = create_tracker(settings)
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
            for kind in ("START", "ACK", "RANGE_START", "RANGE_SETTLE")
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
            assert name in ("unknown topic", "unknown partition", "v2 unknown topic"), (name, value)
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
    expected_open = expected_open_entries(markers)
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
        await applied_past(
            tracker, markers, 2, 20, "the tombstone parked and the START after it applied"
        )
        health = await tracker.health()
        entry = await tracker.store.get_entry(("tomb", topic, 0, 7))
    parked = await read_topic(kafka_bootstrap, f"{markers}.invalid")
    assert health.running, health
    assert entry is not None, "the START after the tombstone was not applied"
    assert len(parked) == 1


#: How far ahead a writer's clock may stamp a CreateTime record and still be accepted: Apache
#: Kafka 4 refuses more than ``message.timestamp.after.max.ms`` (1 h by default) ahead of the
#: broker's clock; 10 minutes are left for the broker's clock to differ from the test's.
WRITER_AHEAD_MS = 50 * 60 * 1000
YEAR_MS = 365 * 24 * 3600 * 1000


def stamped(markers: str, topic: str, marker: Marker, timestamp: int) -> Outgoing:
    return Outgoing(
        markers,
        encode_marker(marker),
        marker_key(topic, marker.origin_partition),
        markers_partition(topic, marker.origin_partition, MARKERS_PARTITIONS),
        timestamp,
    )


async def test_absurd_but_valid_markers_are_handled(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    topic = await topic_factory(partitions=1, prefix="absurd-queue")
    # CreateTime: the writers' stamps are what this test is about (and Apache's default).
    markers = await topic_factory(
        partitions=MARKERS_PARTITIONS,
        prefix="absurd-markers",
        configs={"message.timestamp.type": "CreateTime"},
    )
    group = unique_topic("absurd")
    positions = [
        MessageId(topic, p, o)
        for p, o in await produce_bulk(
            kafka_bootstrap, [Outgoing(topic, b"m%d" % i, b"k%d" % i) for i in range(5)]
        )
    ]
    future, past, longest, delayed, delayed_ahead = positions
    beyond = MessageId(topic, 0, 2**63 - 1)
    now_ms = int(time.time() * 1000)
    ahead_ms = now_ms + WRITER_AHEAD_MS
    cases = [
        # (marker, record timestamp)
        (Marker.start(group, future, timeout_ms=60_000), ahead_ms),
        (Marker.start(group, past, timeout_ms=3_600_000), now_ms - 55 * YEAR_MS),
        (Marker.start(group, longest, timeout_ms=MAX_TIMEOUT_MS), now_ms),
        (Marker.delay(group, delayed, delay_ms=MAX_DELAY_MS, reason="later"), now_ms),
        (Marker.delay(group, delayed_ahead, delay_ms=MAX_DELAY_MS, reason="later"), ahead_ms),
        (Marker.start(group, beyond, timeout_ms=1), now_ms - 60_000),
    ]
    await produce_bulk(kafka_bootstrap, [stamped(markers, topic, m, ts) for m, ts in cases])
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
        e_delayed_ahead = await entry(delayed_ahead)
        e_beyond = await entry(beyond)
        health = await tracker.health()
    # A record stamped 50 minutes ahead is clamped to the tracker's clock: due in ~60 s, not
    # in 51 minutes (a writer clock running ahead must not make a lease longer).
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
    # The furthest a marker reaches is the field limit from the tracker's clock, whatever the
    # writer's clock says: ten years from receipt, not ten years from 50 minutes ahead.
    assert e_delayed_ahead is not None
    assert e_delayed_ahead.state is State.DELAYED
    assert e_delayed_ahead.due_at_ms is not None
    assert now_ms + MAX_DELAY_MS - 1000 <= e_delayed_ahead.due_at_ms <= loaded_at + MAX_DELAY_MS
    # Offset 2^63-1 never existed: recorded as lost with the reason, not retried forever.
    assert e_beyond is not None
    assert "unreadable" in e_beyond.reason, e_beyond.reason
    assert health.ready, health


async def test_a_writer_clock_centuries_ahead_is_harmless_on_a_log_append_time_topic(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    """The markers topic as the tracker creates it: any writer stamp is accepted (Apache does
    not check stamps with LogAppendTime) and the lease counts from about now (Apache stamps
    the append time; tansu keeps the writer's stamp, which the tracker clamps)."""
    topic = await topic_factory(partitions=1, prefix="ahead-queue")
    markers = await topic_factory(
        partitions=MARKERS_PARTITIONS,
        prefix="ahead-markers",
        configs={"message.timestamp.type": "LogAppendTime"},
    )
    group = unique_topic("ahead")
    [(partition, offset)] = await produce_bulk(kafka_bootstrap, [Outgoing(topic, b"m", b"k")])
    message = MessageId(topic, partition, offset)
    now_ms = int(time.time() * 1000)
    start = Marker.start(group, message, timeout_ms=60_000)
    await produce_bulk(kafka_bootstrap, [stamped(markers, topic, start, now_ms + 200 * YEAR_MS)])
    async with tracker_on(
        kafka_bootstrap, sqlite_url(tmp_path / "ahead.sqlite3"), markers
    ) as tracker:

        async def applied() -> Any:
            return await tracker.store.get_entry((group, topic, partition, offset))

        await wait_until(applied, within=40, what="the START stamped 200 years ahead applied")
        loaded_at = int(time.time() * 1000)
        entry = await applied()
    assert entry.due_at_ms is not None
    assert now_ms + 50_000 <= entry.due_at_ms <= loaded_at + 60_000


async def test_a_marker_too_large_for_the_invalid_topic_does_not_stall_ingest(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    """Ingest moves past refused markers only once they are parked. On Apache Kafka the invalid
    topic below refuses the 4 kB garbage record (MESSAGE_TOO_LARGE): it is parked as a stub
    and the START after it is applied; tansu has no size limit and parks it whole."""
    topic = await topic_factory(partitions=1, prefix="big-queue")
    markers = await topic_factory(partitions=1, prefix="big-markers")
    await create_topics(
        kafka_bootstrap, {f"{markers}.invalid": 1}, configs={"max.message.bytes": "2048"}
    )
    valid = Marker.start("big", MessageId(topic, 0, 7), timeout_ms=3_600_000)
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all") as producer:
        await producer.send_and_wait(markers, b"\x7f" * 4000, key=b"big", partition=0)
        await producer.send_and_wait(markers, encode_marker(valid), partition=0)
    try:
        async with tracker_on(
            kafka_bootstrap, sqlite_url(tmp_path / "big.sqlite3"), markers, markers_partitions=1
        ) as tracker:
            await applied_past(tracker, markers, 2, 30, "ingest past the oversized marker")
            health = await tracker.health()
            entry = await tracker.store.get_entry(("big", topic, 0, 7))
        parked = await read_topic(kafka_bootstrap, f"{markers}.invalid")
    finally:
        await delete_topics(kafka_bootstrap, [f"{markers}.invalid"])
    assert health.running, health
    assert entry is not None, "the START after the oversized marker was not applied"
    assert len(parked) == 1
    [record] = parked
    assert record.header(INVALID_SOURCE) == f"{markers}/0/0".encode()
    stub = record.header(INVALID_STUB)
    if stub is None:  # taken whole (tansu)
        assert record.value == b"\x7f" * 4000
    else:  # refused whole, parked as a stub (Apache Kafka)
        assert b"MessageSizeTooLarge" in stub, stub
        assert record.value in (b"", None)
        assert record.header(INVALID_SIZE) == b"4003"


async def applied_past(
    tracker: Tracker, markers: str, offset: int, within: float, what: str
) -> None:
    """Until the store says markers partition 0 is applied up to ``offset`` (ingest moved on)."""

    async def past_it() -> bool:
        offsets = await store_offsets(tracker.store, markers)
        return offsets.get(0, -1) >= offset

    await wait_until(past_it, within=within, what=f"{what} (ingest: {tracker.ingest.last_error})")
