"""Scenario 1: what the kmq client costs a consumer, next to plain aiokafka on the same topic.

* **Throughput**: one topic (8 partitions) pre-filled with ``messages`` records of each size is
  read from the beginning, alternately, ``repeat`` times each, by two plain aiokafka baselines
  — ``getmany`` + ``commit()`` after each batch (safe at-least-once), and aiokafka's default
  auto-commit (what most plain consumers run) — and by ``KmqConsumer`` in the forms of
  :data:`KMQ_FORMS` (range markers: whole batches with ``ack_all()``, and the README's
  per-message ``async for`` + ``await message.ack()``; and protocol v1 per message); the best
  run of each is compared, as ratios to both baselines and as CPU per message. All fetch
  batches of the same size (``KmqConsumer``'s default ``max_batch``). The group join is
  excluded (the clock starts when the first batch arrives; that batch is not counted), and a
  kmq run ends when its last settle is acknowledged (``flush()``).
* **Latency**: a producer in another process writes ``rate`` messages/s carrying their send time;
  the consumer, already joined, records ``hand-over time - send time`` for each message. Plain
  aiokafka hands a batch over when ``getmany`` returns; ``KmqConsumer`` after its STARTs are
  acknowledged and the offsets committed. The *added* latency is the difference of the
  percentiles of the two runs. Both use ``fetch_max_wait_ms=10`` (see ``LOW_LATENCY``).

The tracker does not run here: it is a separate process (or pod) in a deployment and is
measured by scenario 2; on this 2-core machine it would only steal CPU from the consumer.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import struct
import time
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tracker.client import KmqConsumer
from tracker.errors import MarkerWriteFailed

from .common import (
    FAST_GROUP,
    Figure,
    Infra,
    ScenarioResult,
    Stopwatch,
    create_topic,
    delete_topics,
    summary_ms,
    unique,
)

PARTITIONS = 8
BATCH = 500  #: KmqConsumer's default max_batch; plain aiokafka gets the same
_TS = struct.Struct(">d")
#: Latency runs, both consumers: a fetch is answered after at most 10 ms without data (the
#: default 500 ms ``fetch_max_wait_ms`` made hand-over times depend on where in the broker's
#: wait a record arrived, swamping the client's own cost).
LOW_LATENCY: dict[str, Any] = {**FAST_GROUP, "fetch_max_wait_ms": 10}


def payload(size: int, sent: float = 0.0) -> bytes:
    return _TS.pack(sent) + b"x" * max(0, size - _TS.size)


async def fill_topic(
    bootstrap: str, topic: str, count: int, size: int, partitions: int = PARTITIONS
) -> float:
    """Produce ``count`` records of ``size`` bytes round-robin over ``partitions`` (batch API);
    returns the produce rate (records/s)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    watch = Stopwatch()
    try:
        value = payload(size)
        per_batch = max(1, min(2000, (512 * 1024) // (size + 64)))
        futures = []
        sent = 0
        partition = 0
        while sent < count:
            batch = producer.create_batch()
            n = 0
            while n < per_batch and sent + n < count:
                if batch.append(key=None, value=value, timestamp=None) is None:
                    break
                n += 1
            batch.close()
            futures.append(await producer.send_batch(batch, topic, partition=partition))
            partition = (partition + 1) % partitions
            sent += n
            if len(futures) >= 64:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return count / watch.seconds


# -- throughput -------------------------------------------------------------------------------


async def plain_throughput(
    bootstrap: str, topic: str, total: int, *, auto_commit: bool = False
) -> dict[str, float]:
    """Plain aiokafka: ``getmany`` and a commit after each batch (safe at-least-once), or
    with aiokafka's default auto-commit (offsets committed every 5 s in the background,
    whether the batch was processed or not: what most plain consumers run)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=unique("plain"),
        enable_auto_commit=auto_commit,
        auto_offset_reset="earliest",
        **FAST_GROUP,
    )
    await consumer.start()
    try:
        seen = counted = 0
        t0 = cpu0 = 0.0
        while seen < total:
            fetched = await consumer.getmany(timeout_ms=500, max_records=BATCH)
            n = sum(len(v) for v in fetched.values())
            if not n:
                continue
            if seen == 0:
                t0, cpu0 = time.perf_counter(), time.process_time()
            else:
                counted += n
            seen += n
            if not auto_commit:
                await consumer.commit()
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        await consumer.stop()
    return {"rate": counted / elapsed, "seconds": elapsed, "cpu_us_per_msg": cpu / counted * 1e6}


#: The kmq client's forms, as an application would write them:
#: * ``v2-batch``: range markers, ``getmany()`` then ``ack_all()`` (whole batches);
#: * ``v2-message``: range markers, ``async for message in consumer`` + ``await message.ack()``
#:   (the README's form);
#: * ``v1-message``: protocol v1 (one START and one ACK record per message), per message.
KMQ_FORMS = ("v2-batch", "v2-message", "v1-message")


async def kmq_throughput(
    bootstrap: str, topic: str, markers: str, total: int, form: str = "v2-message"
) -> dict[str, float]:
    consumer = KmqConsumer(
        topic,
        group_id=unique("kmq"),
        bootstrap_servers=bootstrap,
        markers_topic=markers,
        processing_timeout=timedelta(seconds=30),
        max_batch=BATCH,
        consumer_config=dict(FAST_GROUP),
        marker_version=1 if form == "v1-message" else 2,
    )
    await consumer.start()
    try:
        seen = counted = 0
        t0 = cpu0 = 0.0
        if form == "v2-message":
            # The first message starts the clock (the group join is excluded).
            async for message in consumer:
                await message.ack()
                seen += 1
                if seen == 1:
                    t0, cpu0 = time.perf_counter(), time.process_time()
                if seen >= total:
                    break
            counted = seen - 1
        while seen < total:
            try:
                messages = await consumer.getmany()
            except MarkerWriteFailed as exc:  # the batch is read again; an app would go on
                print(f"  (kmq: {exc}; batch re-read)", flush=True)
                continue
            if not messages:
                continue
            if form == "v2-batch":
                await consumer.ack_all()
            else:
                for message in messages:
                    await message.ack()
            if seen == 0:
                t0, cpu0 = time.perf_counter(), time.process_time()
            else:
                counted += len(messages)
            seen += len(messages)
        await consumer.flush()  # every settle acknowledged by the broker: the work is done
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        await consumer.stop()
    return {"rate": counted / elapsed, "seconds": elapsed, "cpu_us_per_msg": cpu / counted * 1e6}


#: Targets per form (issue 13): ratio to plain aiokafka committing per batch, to plain
#: aiokafka auto-committing, and CPU per message against the auto-committing one.
_TARGETS: dict[str, dict[int, tuple[float | None, float | None, float | None]]] = {
    "v2-batch": {100: (0.95, 0.7, 1.3), 1024: (0.95, 0.7, 1.3)},
    "v2-message": {100: (0.8, None, None), 1024: (0.9, None, None)},
    "v1-message": {100: (None, None, None), 1024: (None, None, None)},
}


def _throughput_figures(
    result: ScenarioResult, size: int, best: dict[str, dict[str, float]]
) -> None:
    label = f"{size} B"
    plain, auto = best["plain"], best["plain-auto"]
    result.add(Figure(f"{label}: plain aiokafka, commit per batch", plain["rate"], "msg/s"))
    result.add(Figure(f"{label}: plain aiokafka, auto-commit", auto["rate"], "msg/s"))
    for form in KMQ_FORMS:
        run = best[form]
        to_batch, to_auto, cpu = _TARGETS[form].get(size, (None, None, None))
        result.add(Figure(f"{label}: kmq {form} throughput", run["rate"], "msg/s"))
        result.add(
            Figure(
                f"{label}: kmq {form} / plain commit-per-batch",
                run["rate"] / plain["rate"],
                "x",
                to_batch,
                ">=",
            )
        )
        result.add(
            Figure(
                f"{label}: kmq {form} / plain auto-commit",
                run["rate"] / auto["rate"],
                "x",
                to_auto,
                ">=",
            )
        )
        result.add(
            Figure(
                f"{label}: kmq {form} CPU per message / plain auto-commit",
                run["cpu_us_per_msg"] / auto["cpu_us_per_msg"],
                "x",
                cpu,
                "<=",
                note=f"{auto['cpu_us_per_msg']:.1f} vs {run['cpu_us_per_msg']:.1f} us/msg",
            )
        )


# -- latency ----------------------------------------------------------------------------------


def _rate_producer(bootstrap: str, topic: str, rate: int, seconds: float, size: int) -> None:
    """Runs in a child process: ``rate`` records/s for ``seconds``, each carrying its send time."""

    async def main() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        await producer.start()
        try:
            tick = 0.005
            per_tick = rate * tick
            owed = 0.0
            started = time.monotonic()
            next_tick = started
            futures = []
            while time.monotonic() - started < seconds:
                owed += per_tick
                while owed >= 1:
                    futures.append(await producer.send(topic, payload(size, time.time())))
                    owed -= 1
                next_tick += tick
                await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

    asyncio.run(main())


async def _latency_run(
    bootstrap: str, topic: str, markers: str | None, rate: int, seconds: float, size: int
) -> list[float]:
    """Join first, then start the producer process and record hand-over latencies."""
    expected = int(rate * seconds * 0.98)
    latencies: list[float] = []
    if markers is None:
        plain = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=unique("plain-lat"),
            enable_auto_commit=False,
            auto_offset_reset="latest",
            **LOW_LATENCY,
        )
        await plain.start()
        kmq = None
    else:
        kmq = KmqConsumer(
            topic,
            group_id=unique("kmq-lat"),
            bootstrap_servers=bootstrap,
            markers_topic=markers,
            processing_timeout=timedelta(seconds=30),
            max_batch=BATCH,
            fetch_timeout=timedelta(milliseconds=100),
            consumer_config={**LOW_LATENCY, "auto_offset_reset": "latest"},
        )
        await kmq.start()
    process: Any = None
    try:
        # Join the group before anything is produced (so there is no backlog).
        deadline = time.monotonic() + 30
        while True:
            assigned = plain.assignment() if kmq is None else kmq.assignment()
            if len(assigned) == PARTITIONS:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("consumer did not get its partitions")
            if kmq is None:
                await plain.getmany(timeout_ms=100)
            else:
                await kmq.getmany(timedelta(milliseconds=100))
        process = multiprocessing.get_context("spawn").Process(
            target=_rate_producer, args=(bootstrap, topic, rate, seconds, size), daemon=True
        )
        process.start()
        stop_at = time.monotonic() + seconds + 30
        while len(latencies) < expected and time.monotonic() < stop_at:
            if kmq is None:
                fetched = await plain.getmany(timeout_ms=100, max_records=BATCH)
                now = time.time()
                for records in fetched.values():
                    latencies.extend(now - _TS.unpack_from(r.value)[0] for r in records)
                if fetched:
                    await plain.commit()
            else:
                try:
                    messages = await kmq.getmany(timedelta(milliseconds=100))
                except MarkerWriteFailed as exc:
                    print(f"  (kmq: {exc}; batch re-read)", flush=True)
                    continue
                now = time.time()
                for message in messages:
                    assert message.value is not None
                    latencies.append(now - _TS.unpack_from(message.value)[0])
                    await message.ack()
    finally:
        if process is not None:
            await asyncio.to_thread(process.join, 60)
        if kmq is None:
            await plain.stop()
        else:
            await kmq.stop()
    return latencies


# -- the scenario -----------------------------------------------------------------------------


async def run(
    infra: Infra,
    *,
    messages: int = 200_000,
    sizes: tuple[int, ...] = (100, 1024),
    repeat: int = 2,
    latency_rate: int = 2000,
    latency_seconds: float = 8.0,
) -> ScenarioResult:
    result = ScenarioResult("consumer_overhead", "1. Consumer overhead: kmq client vs aiokafka")
    bootstrap = infra.bootstrap
    for size in sizes:
        topic = await create_topic(bootstrap, unique(f"bench-s1-{size}b"), PARTITIONS)
        markers = await create_topic(bootstrap, unique("bench-s1-markers"), PARTITIONS)
        # Each latency run gets an empty topic of its own: the kmq run on the topic the plain
        # run had just filled measured 17 ms at p50 instead of 10 (and read a few of the plain
        # run's records: tansu's "latest" offset is wrong after batched produces).
        lat_topics = [
            await create_topic(bootstrap, unique(f"bench-s1-lat-{size}b"), PARTITIONS)
            for _ in range(2)
        ]
        try:
            produce_rate = await fill_topic(bootstrap, topic, messages, size)
            runs: dict[str, list[dict[str, float]]] = {
                name: [] for name in ("plain", "plain-auto", *KMQ_FORMS)
            }
            for _ in range(repeat):
                runs["plain"].append(await plain_throughput(bootstrap, topic, messages))
                runs["plain-auto"].append(
                    await plain_throughput(bootstrap, topic, messages, auto_commit=True)
                )
                for form in KMQ_FORMS:
                    runs[form].append(
                        await kmq_throughput(bootstrap, topic, markers, messages, form)
                    )
            best = {k: max(v, key=lambda r: r["rate"]) for k, v in runs.items()}
            plain_lat = await _latency_run(
                bootstrap, lat_topics[0], None, latency_rate, latency_seconds, size
            )
            kmq_lat = await _latency_run(
                bootstrap, lat_topics[1], markers, latency_rate, latency_seconds, size
            )
        finally:
            await delete_topics(bootstrap, [topic, markers, *lat_topics])
        p, k = summary_ms(plain_lat), summary_ms(kmq_lat)
        added = {q: k[f"{q}_ms"] - p[f"{q}_ms"] for q in ("p50", "p95", "p99")}
        label = f"{size} B"
        result.data[str(size)] = {
            "messages": messages,
            "fill_rate": produce_rate,
            "runs": runs,
            "latency_plain": p,
            "latency_kmq": k,
            "latency_added_ms": added,
            "latency_rate": latency_rate,
        }
        _throughput_figures(result, size, best)
        for q in ("p50", "p95", "p99"):
            result.add(
                Figure(
                    f"{label}: added {q} latency produce->hand-over",
                    added[q],
                    "ms",
                    10.0 if q == "p95" else None,
                    "<=",
                    note=f"plain {p[f'{q}_ms']:.1f} ms, kmq {k[f'{q}_ms']:.1f} ms",
                )
            )
    return result
