"""The Kafka reader: partitioning, bounded ranges, decoding (real broker, local Spark)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest
from aiokafka import AIOKafkaProducer
from pyspark.sql import DataFrame, SparkSession

from pipeline.connector_frames import decode_dlq_frame, decode_markers_frame
from pipeline.offsets import Bound, resolve_ranges, split_ranges
from pipeline.source import read_kafka
from tracker.ids import MessageId
from tracker.partitioning import markers_partition
from tracker.protocol import Marker

from .workload import Script, dlq_headers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TopicFactory = Callable[..., Awaitable[str]]


async def _produce(bootstrap: str, topic: str, counts: dict[int, int], tag: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, f"{tag}:{p}:{i}".encode(), partition=p)
            for p, n in counts.items()
            for i in range(n)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def _values(df: DataFrame) -> list[tuple[int, int, str]]:
    return [
        (r["partition"], r["offset"], bytes(r["value"]).decode())
        for r in df.select("partition", "offset", "value").collect()
    ]


async def test_many_partitions_are_split_into_slices_read_exactly_once(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=12)
    counts = {p: 40 * p + 3 for p in range(11)}  # partition 11 stays empty
    await _produce(kafka_bootstrap, topic, counts, "a")

    ranges = resolve_ranges(kafka_bootstrap, [topic])
    assert {r.partition: r.size for r in ranges} == {**counts, 11: 0}
    df = read_kafka(spark, bootstrap=kafka_bootstrap, ranges=ranges, fmt="raw", chunk=37)
    assert df.rdd.getNumPartitions() == sum(math.ceil(n / 37) for n in counts.values())
    rows = _values(df)
    assert len(rows) == sum(counts.values()), "no record read twice"
    assert set(rows) == {(p, i, f"a:{p}:{i}") for p, n in counts.items() for i in range(n)}, (
        "none skipped"
    )


async def test_bounded_ranges_by_offsets_and_by_time(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=3)
    await _produce(kafka_bootstrap, topic, {0: 30, 1: 30, 2: 30}, "a")
    await asyncio.sleep(1.1)  # brokers find offsets by (append) time at ms resolution
    middle = datetime.now(UTC)
    await _produce(kafka_bootstrap, topic, {0: 20, 1: 20, 2: 20}, "b")
    await asyncio.sleep(1.1)
    last = datetime.now(UTC)
    await _produce(kafka_bootstrap, topic, {0: 10, 1: 10, 2: 10}, "c")

    # Offsets: partition 0 from 5, partition 1 from 10 (2 from the start), all to 25.
    ranges = resolve_ranges(
        kafka_bootstrap,
        [topic],
        start=Bound.parse("0:5,1:10"),
        end=Bound.parse("25"),
    )
    assert [(r.partition, r.start, r.end) for r in ranges] == [(0, 5, 25), (1, 10, 25), (2, 0, 25)]
    slices = split_ranges(ranges, 7)
    df = read_kafka(spark, bootstrap=kafka_bootstrap, ranges=ranges, fmt="raw", chunk=7)
    assert df.rdd.getNumPartitions() == len(slices)
    assert sorted((p, o) for p, o, _ in _values(df)) == sorted(
        (r.partition, o) for r in ranges for o in range(r.start, r.end)
    )

    # Times: exactly the records produced between the two instants.
    timed = resolve_ranges(
        kafka_bootstrap, [topic], start=Bound.at_time(middle), end=Bound.at_time(last)
    )
    assert [(r.start, r.end) for r in timed] == [(30, 50)] * 3
    rows = _values(read_kafka(spark, bootstrap=kafka_bootstrap, ranges=timed, fmt="raw"))
    assert sorted(v for _, _, v in rows) == sorted(
        f"b:{p}:{i}" for p in range(3) for i in range(20)
    )
    # A time after the last record means "the end": an empty range, not everything.
    future = resolve_ranges(
        kafka_bootstrap,
        [topic],
        start=Bound.at_time(datetime.fromtimestamp(time.time() + 3600, UTC)),
    )
    assert [r.size for r in future] == [0, 0, 0]


async def test_markers_decode_the_same_through_both_readers(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    markers = await topic_factory(partitions=2, prefix="markers")
    dlq = await topic_factory(partitions=1, prefix="orders-dlq")
    script = Script(markers, 2)
    now = int(time.time() * 1000)
    origin = MessageId("orders", 3, 42)
    copy = MessageId("orders", 1, 900)
    script.marker(Marker.start("billing", origin, timeout_ms=30_000, consumer="w-1"), now)
    script.marker(Marker.delay("billing", origin, delay_ms=None, reason="busy"), now + 1)
    script.marker(Marker.extend("billing", copy, attempt=2, origin=origin, timeout_ms=5), now + 2)
    script.marker(Marker.reject("billing", copy, attempt=2, origin=origin, reason="x"), now + 3)
    spare = 1 - markers_partition("orders", 3, 2)  # a markers partition with nothing else
    script.raw_marker(b"\x01\x09" + bytes(30), now + 4, partition=spare)
    script.dead_letter(
        dlq,
        at_ms=now + 5,
        headers=dlq_headers(
            group="billing",
            origin=origin,
            reason="rejected by the consumer: x",
            attempts=2,
            first_seen_ms=now,
            at_ms=now + 5,
            source=copy,
        ),
    )
    script.dead_letter(dlq, at_ms=now + 6, headers=[("kmq-origin", b"not an id")])
    await script.produce(kafka_bootstrap)

    ranges = resolve_ranges(kafka_bootstrap, [markers])
    decoded = read_kafka(spark, bootstrap=kafka_bootstrap, ranges=ranges, fmt="markers")
    rows = sorted(decoded.collect(), key=lambda r: r["timestamp"])
    assert [r["kind"] for r in rows] == ["START", "DELAY", "EXTEND", "REJECT", None]
    start, delay, extend, reject, junk = (r.asDict() for r in rows)
    assert (start["consumer"], start["timeout_ms"], start["attempt"]) == ("w-1", 30_000, 1)
    assert (delay["policy_delay"], delay["reason"], delay["deferred"]) == (True, "busy", False)
    assert (extend["offset"], extend["origin_offset"], extend["attempt"]) == (900, 42, 2)
    assert reject["reason"] == "x"
    assert junk["error"] == "unknown marker kind 9"
    assert (junk["markers_partition"], junk["markers_offset"]) == (spare, 0)

    # Spark's kafka connector path: the same raw rows, decoded in mapInArrow.
    raw = read_kafka(spark, bootstrap=kafka_bootstrap, ranges=ranges, fmt="raw")
    via_connector = decode_markers_frame(raw)
    assert via_connector.exceptAll(decoded).count() == 0
    assert decoded.exceptAll(via_connector).count() == 0

    dlq_ranges = resolve_ranges(kafka_bootstrap, [dlq])
    dead = read_kafka(spark, bootstrap=kafka_bootstrap, ranges=dlq_ranges, fmt="dlq")
    good, bad = (r.asDict() for r in dead.orderBy("dlq_offset").collect())
    assert (good["group"], good["origin_topic"], good["origin_partition"]) == (
        "billing",
        "orders",
        3,
    )
    assert (good["origin_offset"], good["attempts"], good["source"]) == (42, 2, "orders/1/900")
    assert good["reason"] == "rejected by the consumer: x"
    assert good["error"] is None
    assert {h["key"] for h in good["headers"]} >= {"trace", "kmq-dlq-reason"}
    assert "bad kmq-origin header" in bad["error"]
    assert "no kmq-group header" in bad["error"]
    raw_dlq = read_kafka(spark, bootstrap=kafka_bootstrap, ranges=dlq_ranges, fmt="raw")
    assert decode_dlq_frame(raw_dlq).exceptAll(dead).count() == 0
