"""Scenario 2: tracker ingest rate, next to plain aiokafka merely reading the same markers.

A markers topic (8 partitions) is filled once per workload:

* **(a) acked**: every message gets a START and, within the coalescing window, its ACK (blocks
  of 500 STARTs followed by their 500 ACKs, as the client writes them). The pair folds in
  memory; the store is still asked once per flush whether older entries exist for the keys.
* **(b) not acked**: only STARTs (10-minute lease): every message is persisted.
* **(c) 50 % garbage**: workload (a) with a refused value (random bytes, a truncated marker,
  a wrong version, trailing bytes) after each marker, on the same partition. The tracker parks
  each one on ``<markers>.invalid``; the figure is its rate of *valid* markers next to (a)'s.

Then, in the same run, plain aiokafka reads the whole topic (``assign`` + ``getmany`` with the
tracker's ``ingest_max_records``), and the real :class:`tracker.engine.process.Tracker` ingests
it on a fresh SQLite file and a fresh Postgres database. The clock starts when the tracker has
ingested its first marker (the consumer-group join is excluded) and stops when the store's
applied offsets reach the end of every partition, i.e. everything is durable, including the
last coalescing window (0.5 s here, set explicitly).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from tracker.engine.process import Tracker
from tracker.settings import TrackerSettings

from . import markers as mk
from .common import (
    Figure,
    Infra,
    ScenarioResult,
    create_topic,
    delete_topics,
    highwaters,
    unique,
    wait_until,
)

PARTITIONS = 8
BLOCK = 500
COALESCE = timedelta(milliseconds=500)


def settings_for(infra: Infra, database_url: str, markers_topic: str, **extra: Any) -> Any:
    values: dict[str, Any] = {
        "kafka_bootstrap_servers": infra.bootstrap,
        "database_url": database_url,
        "markers_topic": markers_topic,
        "markers_partitions": PARTITIONS,
        "tracker_group": unique("bench-tracker"),
        "migrate_on_start": True,
        "coalesce_window": COALESCE,
        "kafka_client_config": {},
    }
    values.update(extra)
    return TrackerSettings(**values)


def workload(queue: str, messages: int, *, acked: bool) -> list[Any]:
    """Markers for ``messages`` first deliveries spread over the queue's partitions."""
    out: list[Any] = []
    per_partition = messages // PARTITIONS
    for low in range(0, per_partition, BLOCK):
        high = min(per_partition, low + BLOCK)
        for p in range(PARTITIONS):
            out += [mk.start(queue, p, o, 600_000) for o in range(low, high)]
            if acked:
                out += [mk.ack(queue, p, o) for o in range(low, high)]
    return out


async def raw_read(bootstrap: str, topic: str, total: int, max_records: int) -> float:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, 0)
        seen = 0
        started = time.perf_counter()
        while seen < total:
            fetched = await consumer.getmany(timeout_ms=500, max_records=max_records)
            seen += sum(len(v) for v in fetched.values())
        return total / (time.perf_counter() - started)
    finally:
        await consumer.stop()


async def tracker_ingest(
    infra: Infra,
    database_url: str,
    markers_topic: str,
    ends: dict[int, int],
    valid: int | None = None,
) -> dict[str, float]:
    """Run a Tracker over the whole markers topic; markers/s from first marker to durable.

    ``valid``: how many of the records are valid markers (the rate counts only those).
    """
    total = sum(ends.values()) if valid is None else valid
    tracker = Tracker(settings_for(infra, database_url, markers_topic))
    ingested = tracker.metrics.markers_ingested

    def count() -> float:
        return float(sum(ingested.labels(k)._value.get() for k in ("START", "ACK")))

    await tracker.start()
    try:
        t0 = await wait_until(lambda: count() > 0, 60, "first marker", interval=0.002)
        cpu0 = time.process_time()

        async def durable() -> bool:
            offsets = await tracker.store.partition_offsets(markers_topic)
            return all(end == 0 or offsets.get(p, (0, -1))[1] >= end for p, end in ends.items())

        t1 = await wait_until(durable, 300, "all markers applied", interval=0.05)
        cpu = time.process_time() - cpu0
        flushes = tracker.metrics.flush_seconds._sum.get()
    finally:
        await tracker.close()
    seconds = t1 - t0
    return {
        "rate": total / seconds,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "flush_seconds": flushes,
    }


async def run(
    infra: Infra, *, messages: int = 200_000, stores: tuple[str, ...] = ("sqlite", "postgres")
) -> ScenarioResult:
    result = ScenarioResult("ingest", "2. Tracker ingest vs raw read of the markers topic")
    logging.getLogger("tracker").setLevel(logging.ERROR)
    bootstrap = infra.bootstrap
    queue = await create_topic(bootstrap, unique("bench-s2-queue"), PARTITIONS)
    made: list[str] = [queue]
    try:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            topics: dict[str, str] = {}
            valid: dict[str, int] = {}
            for name, acked in (("acked", True), ("unacked", False), ("garbage", True)):
                topic = await create_topic(bootstrap, unique(f"bench-s2-{name}"), PARTITIONS)
                made.append(topic)
                markers = workload(queue, messages, acked=acked)
                if name == "garbage":
                    made.append(f"{topic}.invalid")
                    valid[name] = len(markers)
                    await mk.produce_with_garbage(producer, topic, markers, PARTITIONS, seed=7)
                else:
                    await mk.produce_markers(producer, topic, markers, PARTITIONS)
                topics[name] = topic
        finally:
            await producer.stop()
        for name, topic in topics.items():
            ends = await highwaters(bootstrap, topic)
            total = sum(ends.values())
            entry: dict[str, Any] = {"markers": total, "stores": {}}
            if name != "garbage":
                raw = max([await raw_read(bootstrap, topic, total, 5000) for _ in range(2)])
                entry["raw_read_rate"] = raw
                result.add(Figure(f"({name}) plain aiokafka read rate", raw, "markers/s"))
            for store in stores:
                url = infra.database_url(store, unique(f"s2-{name}"))
                run_ = await tracker_ingest(infra, url, topic, ends, valid.get(name))
                entry["stores"][store] = run_
                if name == "garbage":
                    entry["valid_markers"] = valid[name]
                    clean = result.data["acked"]["stores"][store]["rate"]
                    result.add(
                        Figure(
                            f"(c) 50 % garbage, {store}: valid-marker rate / (a)",
                            run_["rate"] / clean,
                            "x",
                            0.5,
                            ">=",
                            note=f"{run_['rate']:,.0f} valid markers/s",
                        )
                    )
                elif name == "acked":
                    result.add(
                        Figure(f"(a) acked, {store}: ingest rate", run_["rate"], "markers/s")
                    )
                    result.add(
                        Figure(
                            f"(a) acked, {store}: ingest / raw read",
                            run_["rate"] / raw,
                            "x",
                            0.5,
                            ">=",
                        )
                    )
                else:
                    starts = total  # one START per message
                    result.add(
                        Figure(
                            f"(b) not acked, {store}: messages persisted",
                            starts / run_["seconds"],
                            "msg/s",
                            30_000,
                            ">=",
                            note=f"raw read {raw:,.0f} markers/s",
                        )
                    )
            result.data[name] = entry
    finally:
        await delete_topics(bootstrap, made)
    await asyncio.sleep(0)
    return result
