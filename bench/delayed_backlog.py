"""Scenario 7: a large backlog of delayed messages (a week of delays), and the first due one.

Users delay messages for days (``message.delay(...)``, retries with long backoff). The tracker
keeps each one as a row until it is due, so a busy topic builds a backlog of millions of rows
that nothing reads until their time comes. What must hold whatever its size:

* **the due-time index stays flat**: finding the next due entry (``next_due_ms``, what the
  redelivery loop sleeps on) and an empty claim cost the same at 1M and 10M rows (a probe of
  ``(markers_partition, due_at_ms)``, never a scan);
* **memory stays bounded**: the tracker's process (engine, API, web console) holds none of
  the backlog (peak RSS <= 256 MB);
* **the first due message still leaves on time**: DELAY markers written while the backlog
  sits in the store are republished within 100 ms (p99) of their due time + ``ack_grace``.

The backlog is seeded with one ``INSERT .. SELECT`` per step (``generate_series`` on
PostgreSQL, a recursive CTE on SQLite): ingesting ten million DELAY markers through Kafka
would measure ingest (scenario 2), not the backlog. Rows are what ingest writes for a DELAY:
state ``delayed``, attempt 2, due uniformly over the next 1 h .. 7 days, and the payload kept
in the row for delays past half the topic's retention (3.5 days: half of the rows, 100 B
each), with ``tracked_counts`` set to match. Then a tracker replica starts as a subprocess on
that store, and ``probes`` DELAY markers with delays of 2 s and more are written for records
of a fresh topic; their copies' timestamps on the retry topic give the lateness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiokafka import AIOKafkaProducer
from sqlalchemy import text

from tracker.clock import SystemClock, to_millis
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import encode_any
from tracker.store import Store
from tracker.store.counts import recount
from tracker.store.migrate import upgrade
from tracker.store.tables import encode_headers, tracked, tracked_counts

from . import markers as mk
from .common import (
    Figure,
    Infra,
    ScenarioResult,
    Stopwatch,
    create_topic,
    delete_topics,
    median,
    summary_ms,
    unique,
    wait_until,
)
from .redelivery import ACK_GRACE, PARTITIONS, copy_origin, read_timestamps
from .scale import analyze, free_port
from .tracker_proc import TrackerProcess

HOUR_MS = 3_600_000
WEEK_MS = 7 * 24 * HOUR_MS
KEEP_AFTER_MS = WEEK_MS // 2  #: the default keep_payload_after: half of 7 days' retention
#: Origin offsets of the seeded rows start here: far above the probes' records (offset 0..),
#: so a probe never lands on a seeded row.
SEEDED_BASE = 10**12
PROBE_DELAY_MS = 2_000
PROBE_SPACING_MS = 40
RSS_TARGET_MB = 256.0


def _seed_sql(dialect: str, topic: str) -> str:
    """One INSERT of rows ``:lo .. :hi`` (row i: partition i % 8, due in 1 h .. 7 days).

    Built from this module's constants and the markers partitions of ``topic`` (integers);
    every other value is a bound parameter.
    """
    series = (
        "generate_series(CAST(:lo AS BIGINT), CAST(:hi AS BIGINT)) AS s(i)"
        if dialect == "postgresql"
        else "(WITH RECURSIVE r(i) AS (SELECT :lo UNION ALL SELECT i + 1 FROM r WHERE i < :hi)"
        " SELECT i FROM r) AS s"
    )
    payload = "convert_to(repeat('x', 100), 'UTF8')" if dialect == "postgresql" else "zeroblob(100)"
    mapping = " ".join(
        f"WHEN {p} THEN {markers_partition(topic, p, PARTITIONS)}" for p in range(PARTITIONS)
    )
    # due offset from now: 1 h + (i * a large prime) mod (7 days - 1 h), spread evenly
    delay = f"({HOUR_MS} + (s.i * 7919) % {WEEK_MS - HOUR_MS})"
    keep = f"({delay} > {KEEP_AFTER_MS})"
    columns = (
        "group_id, origin_topic, origin_partition, origin_offset,"
        " markers_partition, state, attempt, copy_topic, copy_partition, copy_offset,"
        " due_at_ms, first_seen_ms, updated_ms, deferred, consumer, reason, keep_payload,"
        " payload_stored, payload_key, payload_value, payload_headers, payload_timestamp_ms"
    )
    now = "CAST(:now AS BIGINT)"
    headers = f"CAST(:headers AS {'BYTEA' if dialect == 'postgresql' else 'BLOB'})"
    return (
        f"INSERT INTO tracked_messages ({columns})"  # noqa: S608 - constants and integers only
        f" SELECT :group, :topic, s.i % {PARTITIONS}, {SEEDED_BASE} + s.i / {PARTITIONS},"
        f" CASE s.i % {PARTITIONS} {mapping} END, 'delayed', 2, :topic, s.i % {PARTITIONS},"
        f" {SEEDED_BASE} + s.i / {PARTITIONS}, {now} + {delay}, {now}, {now}, true, 'bench', '',"
        f" {keep}, {keep}, NULL, CASE WHEN {keep} THEN {payload} END,"
        f" CASE WHEN {keep} THEN {headers} END, CASE WHEN {keep} THEN {now} END"
        f" FROM {series}"
    )


class BacklogSeeder:
    """Grows the delayed backlog of one store in steps, keeping ``tracked_counts`` right (the
    store's own :func:`~tracker.store.counts.recount`, as a partition takeover runs it)."""

    def __init__(self, store: Store, markers: str, topic: str) -> None:
        self.store = store
        self.markers = markers
        self.topic = topic
        self.group = mk.GROUP
        self.rows = 0
        self.epochs: dict[int, int] = {}

    async def load_epochs(self) -> None:
        now_ms = to_millis(SystemClock().now())
        claims = await self.store.claim_partitions(
            self.markers, range(PARTITIONS), "bench-seeder", now_ms
        )
        self.epochs = {p: claim.epoch for p, claim in claims.items()}

    async def grow_to(self, size: int) -> float:
        """Insert rows up to ``size``; returns the seconds it took (counts included)."""
        watch = Stopwatch()
        dialect = self.store.engine.dialect.name
        sql = text(_seed_sql(dialect, self.topic))
        now_ms = to_millis(SystemClock().now())
        step = 1_000_000 if dialect == "postgresql" else 200_000
        for lo in range(self.rows, size, step):
            hi = min(size, lo + step) - 1
            async with self.store.transaction() as conn:
                await conn.execute(
                    sql,
                    {
                        "lo": lo,
                        "hi": hi,
                        "now": now_ms,
                        "headers": encode_headers(()),
                        "group": self.group,
                        "topic": self.topic,
                    },
                )
        self.rows = size
        async with self.store.transaction() as conn:
            await recount(conn, tracked_counts, tracked, range(PARTITIONS))
        await analyze(self.store)
        return watch.seconds

    async def due_scan(self, reps: int) -> tuple[float, float]:
        """Median ms of ``next_due_ms`` over the 8 partitions, and of a claim finding nothing."""
        next_due: list[float] = []
        claims: list[float] = []
        for rep in range(reps):
            watch = Stopwatch()
            found = await self.store.next_due_ms(range(PARTITIONS))
            next_due.append(watch.seconds * 1000)
            if found is None:
                raise AssertionError("the seeded backlog has no due time")
            now_ms = to_millis(SystemClock().now())
            watch = Stopwatch()
            claim = await self.store.claim_due_ranges(
                self.markers,
                epochs=self.epochs,
                due_by=dict.fromkeys(range(PARTITIONS), now_ms),
                now_ms=now_ms,
                limit=1000,
                lease_ms=60_000,
                token=f"bench-{rep}",
            )
            claimed, fenced = claim.expanded(), claim.fenced
            claims.append(watch.seconds * 1000)
            if claimed or fenced:
                raise AssertionError(f"claimed {len(claimed)} (fenced {fenced}): nothing is due")
        return median(next_due), median(claims)

    async def table_mb(self) -> float | None:
        if self.store.engine.dialect.name != "postgresql":
            return None
        async with self.store.transaction(read_only=True) as conn:
            size = (
                await conn.execute(text("SELECT pg_total_relation_size('tracked_messages')"))
            ).scalar_one()
        return int(size) / 2**20


async def probe_lateness(
    bootstrap: str, markers: str, queue: str, retry: str, probes: int
) -> dict[str, Any]:
    """Write ``probes`` DELAY markers (2 s and up) and time their copies on ``retry``."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await producer.start()
    copies: dict[Any, int] = {}
    stop = asyncio.Event()
    reader = asyncio.create_task(
        read_timestamps(bootstrap, retry, copies, lambda r: [copy_origin(r.headers)], stop)
    )
    due: dict[Any, int] = {}
    try:
        originals = [
            await producer.send_and_wait(queue, b"probe-%d" % i, partition=i % PARTITIONS)
            for i in range(probes)
        ]
        for sent in originals:
            marker = mk.delay(queue, sent.partition, sent.offset, PROBE_DELAY_MS)
            written_ms = to_millis(SystemClock().now())
            await producer.send_and_wait(
                markers,
                encode_any(marker),
                key=marker_key(queue, sent.partition),
                partition=markers_partition(queue, sent.partition, PARTITIONS),
                timestamp_ms=written_ms,
            )
            due[marker.origin] = written_ms + PROBE_DELAY_MS
            await asyncio.sleep(PROBE_SPACING_MS / 1000)
        await wait_until(
            lambda: all(origin in copies for origin in due),
            PROBE_DELAY_MS / 1000 + 60,
            "every probe's copy",
            0.05,
        )
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await reader
        await producer.stop()
    lateness = [(copies[origin] - due_ms) / 1000 for origin, due_ms in due.items()]
    grace = ACK_GRACE.total_seconds()
    return {
        "probes": probes,
        "after_due": summary_ms(lateness),
        "after_due_plus_grace": summary_ms([x - grace for x in lateness]),
        "samples_ms": sorted(round(x * 1000) for x in lateness),
    }


async def run(
    infra: Infra,
    *,
    sizes: tuple[int, ...] = (1_000_000, 10_000_000),
    stores: tuple[str, ...] = ("postgres",),
    reps: int = 9,
    probes: int = 100,
) -> ScenarioResult:
    result = ScenarioResult(
        "delayed_backlog", "7. Delayed backlog: a week of delays in the store, first due on time"
    )
    logging.getLogger("tracker").setLevel(logging.ERROR)
    bootstrap = infra.bootstrap
    for store_name in stores:
        queue = await create_topic(bootstrap, unique("bench-s7-queue"), PARTITIONS)
        retry = await create_topic(bootstrap, unique("bench-s7-retry"), PARTITIONS)
        markers = await create_topic(bootstrap, unique("bench-s7-markers"), PARTITIONS)
        url = infra.database_url(store_name, unique("s7"))
        store = Store.from_url(url)
        proc: TrackerProcess | None = None
        try:
            await upgrade(store.engine)
            seeder = BacklogSeeder(store, markers, queue)
            await seeder.load_epochs()
            series: list[dict[str, Any]] = []
            for size in sizes:
                seconds = await seeder.grow_to(size)
                next_due_ms, claim_ms = await seeder.due_scan(reps)
                point = {
                    "size": size,
                    "seed_seconds": seconds,
                    "next_due_ms": next_due_ms,
                    "empty_claim_ms": claim_ms,
                    "table_mb": await seeder.table_mb(),
                }
                series.append(point)
                print(
                    f"  {store_name} {size:>11,} delayed: next_due {next_due_ms:.2f} ms, "
                    f"empty claim {claim_ms:.2f} ms (seeded in {seconds:.0f} s)",
                    flush=True,
                )
            settings = {
                "kafka_bootstrap_servers": bootstrap,
                "database_url": url,
                "markers_topic": markers,
                "markers_partitions": PARTITIONS,
                "tracker_group": unique("bench-s7-tracker"),
                "replica_id": "bench-s7",
                "ack_grace": ACK_GRACE.total_seconds(),
                "default_policy": {"retry_topic": retry},
            }
            proc = TrackerProcess(
                settings, free_port(), infra.scratch / f"tracker-s7-{store_name}.log"
            )
            started = time.perf_counter()
            await proc.start()
            start_seconds = time.perf_counter() - started
            rss_ready = proc.rss()[0]
            probed = await probe_lateness(bootstrap, markers, queue, retry, probes)
            rss, peak = proc.rss()
        finally:
            if proc is not None:
                await proc.stop()
            await store.close()
            await delete_topics(bootstrap, [queue, retry, markers])
        samples = probed.pop("samples_ms")
        result.data[store_name] = {
            "series": series,
            "tracker_start_seconds": start_seconds,
            "rss_ready_mb": rss_ready,
            "rss_mb": rss,
            "peak_rss_mb": peak,
            **probed,
        }
        result.data[f"{store_name}_samples_ms"] = samples
        _figures(result, store_name, result.data[store_name])
    return result


def _figures(result: ScenarioResult, store: str, data: dict[str, Any]) -> None:
    series = data["series"]
    first, last = series[0], series[-1]
    span = f"{first['size']:,} -> {last['size']:,} delayed"
    for key, label in (("next_due_ms", "next_due_ms"), ("empty_claim_ms", "empty claim_due")):
        result.add(Figure(f"{store}: {label} at {last['size']:,} delayed", last[key], "ms"))
        result.add(
            Figure(
                f"{store}: {label}, growth {span}",
                last[key] / first[key] if first[key] else float("nan"),
                "x",
                2.0,
                "<=",
                note=f"{first[key]:.2f} -> {last[key]:.2f} ms (median); flat = index probe",
            )
        )
    result.add(
        Figure(
            f"{store}: tracker peak RSS with {last['size']:,} delayed",
            data["peak_rss_mb"],
            "MB",
            RSS_TARGET_MB,
            "<=",
            note=f"{data['rss_ready_mb']:.0f} MB when ready, started in "
            f"{data['tracker_start_seconds']:.1f} s",
        )
    )
    g, d = data["after_due_plus_grace"], data["after_due"]
    grace_ms = ACK_GRACE.total_seconds() * 1000
    result.add(Figure(f"{store}: p50 lateness after due + ack_grace", g["p50_ms"], "ms"))
    result.add(
        Figure(
            f"{store}: p99 lateness after due + ack_grace",
            g["p99_ms"],
            "ms",
            100,
            "<=",
            note=f"{data['probes']} DELAYs of {PROBE_DELAY_MS} ms beside {last['size']:,} "
            f"delayed; after the raw due time: p50 {d['p50_ms']:.0f} / p99 {d['p99_ms']:.0f} ms "
            f"(ack_grace {grace_ms:.0f} ms)",
        )
    )
