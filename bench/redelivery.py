"""Scenario 3: redelivery throughput and punctuality, with the real tracker.

* **(a) burst**: ``burst`` messages (8 partitions) get a START with the same lease (one v1 START
  per message, and in a second run one v2 RANGE_START per block of ``BLOCK``), written as
  fast as possible, never acked; the tracker ingests them and republishes all of them when the
  leases expire. The republish rate (copies/s, from the first copy to the last, as counted by
  the tracker's ``kmq_redeliveries_total``) is compared with the raw rate of an aiokafka
  producer with the tracker's settings (``acks=all``, ``linger_ms=2``) sending as many records
  of the same size and headers, in the same run, a round of ``ROUND`` at a time: under Python's
  collector setting (a plain producer: the judged ratio) and under the tracker's
  (``tracker.gc_policy``, the same footing).
* The tracker runs under the collector policy ``kmq-tracker run`` sets for its process, in both
  parts: what is measured is the product as it runs.
* **(b) steady**: a process writes 1,000 STARTs/s (lease ``LEASE_MS``, never acked) for
  ``steady_seconds``; then 10,000/s (``steady_fast_rate``), as v1 STARTs and as v2
  RANGE_STARTs (one per partition every 10 ms, what a v2 consumer writes per fetched batch);
  a watcher reads the copies. End-to-end lateness per message = the copy's
  record timestamp - (the START record's timestamp + lease). The tracker deliberately waits
  ``ack_grace`` after a deadline (an ACK written just before the deadline may still be on its
  way), so lateness is reported after the deadline and after deadline + ``ack_grace``; the
  target is judged on the latter (the earliest moment the tracker is allowed to act), the
  deadline figure is shown next to it. ``ack_grace`` and ``coalesce_window`` are set here.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from tracker import headers as h
from tracker.engine.process import Tracker
from tracker.gc_policy import DEFAULT_GEN0_THRESHOLD, gc_policy
from tracker.ids import MessageId
from tracker.protocol import AnyMarker
from tracker.runtime import create_tracker
from tracker.settings import TrackerSettings

from . import markers as mk
from .common import (
    Figure,
    Infra,
    ScenarioResult,
    Stopwatch,
    create_topic,
    delete_topics,
    summary_ms,
    unique,
    wait_until,
)
from .ingest import BLOCK, settings_for

PARTITIONS = 8
SIZE = 100
LEASE_MS = 3000
ACK_GRACE = timedelta(milliseconds=500)
COALESCE = timedelta(seconds=1)
#: records the raw producer sends before it waits for their acks: the tracker's round
#: (``redelivery_batch``). Holding all 100k futures at once made a plain producer's cyclic GC
#: walk them over and over: 84-93k records/s against 123-129k in rounds, same sitting.
ROUND = TrackerSettings.model_fields["redelivery_batch"].default


def _tracker(infra: Infra, url: str, markers: str, retry: str) -> Tracker:
    return create_tracker(
        settings_for(
            infra,
            url,
            markers,
            coalesce_window=COALESCE,
            ack_grace=ACK_GRACE,
            max_idle_sleep=timedelta(seconds=5),
            default_policy={"retry_topic": retry, "max_attempts": 100},
        )
    )


async def raw_produce_rate(bootstrap: str, topic: str, count: int) -> float:
    """The tracker's producer settings, records like its copies, sent as fast as possible a
    round (``ROUND``) at a time."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=2,
        max_batch_size=TrackerSettings.model_fields["kafka_producer_batch_bytes"].default,
    )
    await producer.start()
    try:
        value = b"q" * SIZE
        headers = [
            (h.ORIGIN, b"bench-queue-0123456789/3/123456"),
            (h.GROUP, mk.GROUP.encode()),
            (h.FIRST_SEEN, b"1700000000000"),
            (h.ATTEMPT, b"2"),
        ]
        watch = Stopwatch()
        for low in range(0, count, ROUND):
            sent = min(ROUND, count - low)
            await asyncio.gather(
                *[await producer.send(topic, value=value, headers=headers) for _ in range(sent)]
            )
        return count / watch.seconds
    finally:
        await producer.stop()


async def best_produce(bootstrap: str, topic: str, count: int, gen0_threshold: int = 0) -> float:
    """The better of two raw produce runs under the collector policy ``gen0_threshold`` (0:
    Python's setting, as a plain producer runs)."""
    with gc_policy(gen0_threshold):
        return max([await raw_produce_rate(bootstrap, topic, count) for _ in range(2)])


async def burst(
    infra: Infra, store: str, count: int, min_lease_ms: int = 5_000, *, ranges: bool = False
) -> dict[str, Any]:
    """(a): ``count`` messages started with one lease, never acked, republished in a burst.

    ``ranges``: the STARTs are v2 RANGE_STARTs of ``BLOCK`` offsets (what ``KmqConsumer``
    writes by default, one per fetched partition batch) instead of one v1 START per message.
    """
    bootstrap = infra.bootstrap
    queue = await create_topic(bootstrap, unique("bench-s3a-queue"), PARTITIONS)
    retry = await create_topic(bootstrap, unique("bench-s3a-retry"), PARTITIONS)
    markers = await create_topic(bootstrap, unique("bench-s3a-markers"), PARTITIONS)
    try:
        per_partition = count // PARTITIONS
        await mk.fill_queue(bootstrap, queue, PARTITIONS, per_partition, SIZE)
        raw = await best_produce(bootstrap, retry, count)
        raw_policy = await best_produce(bootstrap, retry, count, DEFAULT_GEN0_THRESHOLD)
        tracker = _tracker(infra, infra.database_url(store, unique("s3a")), markers, retry)
        # The collector policy `kmq-tracker run` sets for its process (tracker.gc_policy).
        with gc_policy(tracker.settings.gc_gen0_threshold):
            await tracker.start()
            redelivered = tracker.metrics.redeliveries.labels(queue)
            try:
                # Lease: long enough for the tracker to ingest every START before the first expires.
                lease_ms = max(min_lease_ms, count // 5)
                producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
                await producer.start()
                try:
                    starts: list[AnyMarker] = (
                        [
                            mk.range_start(
                                queue, p, low, min(per_partition, low + BLOCK) - 1, lease_ms
                            )
                            for low in range(0, per_partition, BLOCK)
                            for p in range(PARTITIONS)
                        ]
                        if ranges
                        else [
                            mk.start(queue, p, o, lease_ms)
                            for o in range(per_partition)
                            for p in range(PARTITIONS)
                        ]
                    )
                    written = Stopwatch()
                    await mk.produce_markers(producer, markers, starts, PARTITIONS)
                    write_seconds = written.seconds
                    # Not kept alive while the tracker in this process is measured: the cyclic
                    # GC would walk 100k marker objects in every full collection.
                    del starts
                finally:
                    await producer.stop()
                total = per_partition * PARTITIONS
                # The clock starts when the first lease ran out and ack_grace passed: the earliest
                # moment the tracker may republish anything.
                t0 = written.started + lease_ms / 1000 + ACK_GRACE.total_seconds()
                await wait_until(
                    lambda: redelivered._value.get() > 0, lease_ms / 1000 + 120, "first copy", 0.005
                )
                t1 = await wait_until(
                    lambda: redelivered._value.get() >= total, 300, "all copies", 0.005
                )
                phases = _phase_means_ms(tracker.metrics)
            finally:
                await tracker.close()
    finally:
        await delete_topics(bootstrap, [queue, retry, markers])
    rate = total / (t1 - t0) if t1 > t0 else float("nan")
    return {
        "copies": total,
        "republish_rate": rate,
        "raw_produce_rate": raw,
        "raw_produce_rate_same_policy": raw_policy,
        "seconds": t1 - t0,
        "starts_written_seconds": write_seconds,
        "phase_mean_ms": phases,
    }


def _paced_starts(
    bootstrap: str,
    markers: str,
    queue: str,
    rate: int,
    seconds: float,
    lease_ms: int,
    ranges: bool = False,
) -> None:
    """Child process: ``rate`` STARTs/s with explicit record timestamps, offsets in order.

    ``ranges``: every 10 ms tick, one RANGE_START per partition over the offsets it owes.
    """

    async def main() -> None:
        from tracker.partitioning import marker_key, markers_partition  # noqa: PLC0415
        from tracker.protocol import encode_any  # noqa: PLC0415

        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        await producer.start()
        try:
            tick = 0.01
            owed = 0.0
            n = 0
            started = time.monotonic()
            next_tick = started
            futures = []
            while time.monotonic() - started < seconds:
                owed += rate * tick
                due = int(owed)
                owed -= due
                # message n is offset n // PARTITIONS of partition n % PARTITIONS
                spans = [
                    (p, o, o)
                    for p, o in ((m % PARTITIONS, m // PARTITIONS) for m in range(n, n + due))
                ]
                if ranges:
                    first: dict[int, int] = {}
                    last: dict[int, int] = {}
                    for p, o, _ in spans:
                        first.setdefault(p, o)
                        last[p] = o
                    spans = [(p, first[p], last[p]) for p in first]
                n += due
                for p, low, high in spans:
                    marker = (
                        mk.range_start(queue, p, low, high, lease_ms)
                        if ranges
                        else mk.start(queue, p, low, lease_ms)
                    )
                    futures.append(
                        await producer.send(
                            markers,
                            value=encode_any(marker),
                            key=marker_key(queue, p),
                            partition=markers_partition(queue, p, PARTITIONS),
                            timestamp_ms=int(time.time() * 1000),
                        )
                    )
                next_tick += tick
                await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

    asyncio.run(main())


def _watch(bootstrap: str, markers: str, retry: str, counts: Any, stop: Any, results: Any) -> None:
    """Child process: read the STARTs (per message they put in flight) and the copies (per
    origin) with their record timestamps, keep ``counts`` up to date, and send both maps
    through ``results`` once ``stop`` is set."""

    async def main() -> None:
        starts: dict[MessageId, int] = {}
        copies: dict[MessageId, int] = {}
        done = asyncio.Event()

        async def follow() -> None:
            while not stop.is_set():
                counts[0], counts[1] = len(starts), len(copies)
                await asyncio.sleep(0.05)
            done.set()

        await asyncio.gather(
            read_timestamps(bootstrap, markers, starts, _started, done),
            read_timestamps(bootstrap, retry, copies, _copied, done),
            follow(),
        )
        results.send((starts, copies))

    asyncio.run(main())


def _started(record: Any) -> list[MessageId]:
    return mk_origins(record.value)


def _copied(record: Any) -> list[MessageId]:
    return [copy_origin(record.headers)]


async def read_timestamps(
    bootstrap: str,
    topic: str,
    out: dict[Any, int],
    keys_of: Callable[[Any], list[MessageId]],
    stop: asyncio.Event,
) -> None:
    """Record each record's timestamp under every key ``keys_of(record)`` gives, until
    ``stop``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, 0)
        while not stop.is_set():
            fetched = await consumer.getmany(timeout_ms=100)
            for records in fetched.values():
                for r in records:
                    for key in keys_of(r):
                        out[key] = r.timestamp
    finally:
        await consumer.stop()


def _histogram_quantile(histogram: Any, q: float) -> float:
    """Upper bound of the bucket holding the ``q`` quantile of a prometheus Histogram."""
    samples = [s for s in histogram.collect()[0].samples if s.name.endswith("_bucket")]
    total = samples[-1].value if samples else 0
    for sample in samples:
        if total and sample.value >= q * total:
            return float(sample.labels["le"])
    return float("nan")


def _histogram_mean_count(histogram: Any) -> tuple[float, int]:
    samples = {s.name: s.value for s in histogram.collect()[0].samples if "le" not in s.labels}
    count = next((v for k, v in samples.items() if k.endswith("_count")), 0.0)
    total = next((v for k, v in samples.items() if k.endswith("_sum")), 0.0)
    return (total / count if count else float("nan")), int(count)


PHASES = ("claim", "read", "produce", "ack", "record")


def _phase_means_ms(metrics: Any) -> dict[str, float]:
    """Mean time of each redelivery phase (``kmq_redelivery_phase_seconds``), in ms."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for sample in metrics.redelivery_phase.collect()[0].samples:
        phase = sample.labels.get("phase")
        if sample.name.endswith("_sum"):
            sums[phase] = sample.value
        elif sample.name.endswith("_count"):
            counts[phase] = sample.value
    return {
        p: sums.get(p, 0.0) / counts[p] * 1000 if counts.get(p) else float("nan") for p in PHASES
    }


def _phases_note(phases: dict[str, float]) -> str:
    return ", ".join(f"{p} {phases[p]:.1f}" for p in PHASES) + " ms per round"


async def steady(
    infra: Infra, store: str, rate: int, seconds: float, *, ranges: bool = False
) -> dict[str, Any]:
    bootstrap = infra.bootstrap
    queue = await create_topic(bootstrap, unique("bench-s3b-queue"), PARTITIONS)
    retry = await create_topic(bootstrap, unique("bench-s3b-retry"), PARTITIONS)
    markers = await create_topic(bootstrap, unique("bench-s3b-markers"), PARTITIONS)
    expected = int(rate * seconds)
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    counts = spawn.Array("q", 2)  # (messages started, copies) the watcher has read
    results, sent = spawn.Pipe(duplex=False)
    try:
        await mk.fill_queue(bootstrap, queue, PARTITIONS, expected // PARTITIONS + rate, SIZE)
        tracker = _tracker(infra, infra.database_url(store, unique("s3b")), markers, retry)
        # The collector policy `kmq-tracker run` sets for its process (tracker.gc_policy).
        with gc_policy(tracker.settings.gc_gen0_threshold):
            await tracker.start()
            watcher: Any = None
            try:
                await wait_until(
                    lambda: len(tracker.ingest.owned_epochs()) == PARTITIONS, 60, "partitions"
                )
                await asyncio.sleep(1.0)  # let ingest record that it is caught up
                # The watcher reads the STARTs and the copies in a process of its own: in the
                # tracker's, reading 10,000 of each a second took CPU from the loop it times.
                watcher = spawn.Process(
                    target=_watch, args=(bootstrap, markers, retry, counts, stop, sent), daemon=True
                )
                watcher.start()
                process = spawn.Process(
                    target=_paced_starts,
                    args=(bootstrap, markers, queue, rate, seconds, LEASE_MS, ranges),
                    daemon=True,
                )
                process.start()
                await asyncio.to_thread(process.join, seconds + 60)
                await wait_until(
                    lambda: counts[1] >= counts[0] > 0, LEASE_MS / 1000 + 60, "all copies", 0.1
                )
                histogram = tracker.metrics.redelivery_lateness
                tracker_p50 = _histogram_quantile(histogram, 0.5)
                tracker_p99 = _histogram_quantile(histogram, 0.99)
                rounds = _histogram_mean_count(tracker.metrics.redelivery_seconds)
                claim_lateness = _histogram_mean_count(histogram)[0]
                phases = _phase_means_ms(tracker.metrics)
            finally:
                stop.set()
                starts: dict[Any, int] = {}
                copies: dict[Any, int] = {}
                if watcher is not None:
                    if await asyncio.to_thread(results.poll, 60):
                        starts, copies = results.recv()
                    await asyncio.to_thread(watcher.join, 10)
                await tracker.close()
    finally:
        await delete_topics(bootstrap, [queue, retry, markers])
    by_origin = starts
    lateness = [
        (copies[origin] - (ts + LEASE_MS)) / 1000
        for origin, ts in by_origin.items()
        if origin in copies
    ]
    grace = ACK_GRACE.total_seconds()
    return {
        "starts": len(by_origin),
        "copies": len(copies),
        "after_deadline": summary_ms(lateness),
        "after_deadline_plus_grace": summary_ms([x - grace for x in lateness]),
        "tracker_histogram_p50_le_s": tracker_p50,
        "tracker_histogram_p99_le_s": tracker_p99,
        "redelivery_round_mean_ms": rounds[0] * 1000,
        "redelivery_rounds": rounds[1],
        # From due + ack_grace to the claim: the wake-up path (safe horizon, notify_safe).
        "wake_mean_ms": claim_lateness * 1000 - ACK_GRACE.total_seconds() * 1000,
        "phase_mean_ms": phases,
        "samples_ms": sorted(round(x * 1000) for x in lateness),
    }


def mk_origins(value: bytes) -> list[MessageId]:
    """The messages a START (v1) or RANGE_START (v2) the bench wrote puts in flight."""
    from tracker.protocol import Marker, decode_marker  # noqa: PLC0415

    marker = decode_marker(value)
    if isinstance(marker, Marker):
        return [marker.origin]
    return list(marker.messages())


def copy_origin(headers: Any) -> MessageId:
    for name, value in headers:
        if name == h.ORIGIN:
            return MessageId.parse(value.decode())
    raise ValueError("copy without origin header")


async def run(
    infra: Infra,
    *,
    burst_messages: int = 100_000,
    steady_rate: int = 1000,
    steady_fast_rate: int = 10_000,
    steady_fast_ranges: tuple[bool, ...] = (False, True),
    steady_seconds: float = 15.0,
    stores: tuple[str, ...] = ("sqlite", "postgres"),
    min_lease_ms: int = 5_000,
) -> ScenarioResult:
    result = ScenarioResult("redelivery", "3. Redelivery: burst rate and steady lateness")
    logging.getLogger("tracker").setLevel(logging.ERROR)
    for store, ranges in [(store, ranges) for store in stores for ranges in (False, True)]:
        b = await burst(infra, store, burst_messages, min_lease_ms, ranges=ranges)
        label = f"{store}, v2 ranges" if ranges else store
        result.data[f"burst_{store}_ranges" if ranges else f"burst_{store}"] = b
        result.add(Figure(f"(a) {label}: raw produce rate", b["raw_produce_rate"], "records/s"))
        result.add(Figure(f"(a) {label}: republish rate", b["republish_rate"], "copies/s"))
        result.add(
            Figure(
                f"(a) {label}: republish / raw produce",
                b["republish_rate"] / b["raw_produce_rate"],
                "x",
                0.5,
                ">=",
                note=f"{b['copies']:,} copies in {b['seconds']:.1f} s",
            )
        )
        same = b["raw_produce_rate_same_policy"]
        result.add(
            Figure(
                f"(a) {label}: republish / raw produce under the tracker's collector policy",
                b["republish_rate"] / same,
                "x",
                note=f"raw produce {same:,.0f} records/s",
            )
        )
        result.add(
            Figure(
                f"(a) {label}: claim + read + produce per round (rounds overlap)",
                sum(b["phase_mean_ms"][p] for p in ("claim", "read", "produce")),
                "ms",
                note=_phases_note(b["phase_mean_ms"]),
            )
        )
    for store in stores:
        s = await steady(infra, store, steady_rate, steady_seconds)
        samples = s.pop("samples_ms")
        result.data[f"steady_{store}"] = s
        result.data[f"steady_{store}_samples_ms"] = samples[:: max(1, len(samples) // 2000)]
        d, g = s["after_deadline"], s["after_deadline_plus_grace"]
        grace_ms = ACK_GRACE.total_seconds() * 1000
        result.add(
            Figure(f"(b) {store}: p50 lateness after deadline + ack_grace", g["p50_ms"], "ms")
        )
        result.add(
            Figure(
                f"(b) {store}: p99 lateness after deadline + ack_grace",
                g["p99_ms"],
                "ms",
                100,
                "<=",
                note=f"{s['copies']:,} of {s['starts']:,} copies; ack_grace {grace_ms:.0f} ms",
            )
        )
        result.add(
            Figure(
                f"(b) {store}: p50 / p99 lateness after the raw deadline",
                d["p99_ms"],
                "ms (p99)",
                note=f"p50 {d['p50_ms']:.0f} ms; includes ack_grace {grace_ms:.0f} ms by design",
            )
        )
        result.add(
            Figure(
                f"(b) {store}: tracker histogram p99 bucket",
                s["tracker_histogram_p99_le_s"] * 1000,
                "ms (le)",
                note="kmq_redelivery_lateness_seconds: claim time - due time "
                "(due = deadline; bucket upper bound)",
            )
        )
        result.add(
            Figure(
                f"(b) {store}: mean wake-up, due + ack_grace -> claim",
                s["wake_mean_ms"],
                "ms",
                note="kmq_redelivery_lateness_seconds mean less ack_grace: the safe horizon "
                "(ingest reading past the deadline) and notify_safe",
            )
        )
        result.add(
            Figure(
                f"(b) {store}: mean redelivery round",
                s["redelivery_round_mean_ms"],
                "ms",
                note=f"{s['redelivery_rounds']} rounds; {_phases_note(s['phase_mean_ms'])}",
            )
        )
    for store, ranges in [(store, ranges) for store in stores for ranges in steady_fast_ranges]:
        s = await steady(infra, store, steady_fast_rate, steady_seconds, ranges=ranges)
        s.pop("samples_ms")
        label = f"{store}, {steady_fast_rate:,}/s" + (" v2 ranges" if ranges else " v1")
        result.data[f"steady_{store}_{steady_fast_rate}" + ("_ranges" if ranges else "")] = s
        g = s["after_deadline_plus_grace"]
        result.add(
            Figure(
                f"(b) {label}: p99 lateness after deadline + ack_grace",
                g["p99_ms"],
                "ms",
                100,
                "<=",
                note=f"p50 {g['p50_ms']:.0f} ms; {s['copies']:,} of {s['starts']:,} copies; "
                f"mean wake-up {s['wake_mean_ms']:.0f} ms, mean round "
                f"{s['redelivery_round_mean_ms']:.0f} ms ({s['redelivery_rounds']} rounds)",
            )
        )
    return result
