"""Scenarios 4 and 5: cost per operation as the store grows, and the admin API under load.

The store is seeded through :meth:`Store.apply` with START markers (1-day leases, so nothing
falls due while the tracker runs), growing through ``sizes``. At each size:

* **ingest**: ``Store.apply`` of 1,000 STARTs of new messages + 1,000 ACKs of tracked ones
  (the table size stays put), per marker;
* **due-scan**: ``Store.next_due_ms`` over the 8 partitions, and ``Store.claim_due_ranges`` of 1,000
  due entries (the claimed ones move out of the due range, so repeats claim others);
* **API**: a tracker replica with its admin API and web console on uvicorn runs as a subprocess
  on the store;
  ``GET /v1/messages?limit=100`` (key order), ``GET /v1/messages?state=in_flight&order=due``
  and ``GET /v1/topics/{topic}``, sequentially, median latency; and the subprocess's RSS.

Scenario 5 runs at the largest size: while a load process writes 1,000 messages/s of markers
(each START acked 3 s later, outside the coalescing window, so the store takes every upsert and
delete) that the tracker ingests, ``concurrency`` HTTP clients hit the list and stats endpoints
for ``api_seconds`` each, then at the web console's pages (target: p95 <= 200 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from aiokafka import AIOKafkaProducer
from sqlalchemy import text

from tracker.clock import SystemClock, to_millis
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy
from tracker.partitioning import markers_partition
from tracker.store import Store
from tracker.store.migrate import upgrade
from tracker.store.port import PendingMarker

from . import markers as mk
from .common import (
    Figure,
    Infra,
    ScenarioResult,
    Stopwatch,
    create_topic,
    delete_topics,
    highwaters,
    median,
    summary_ms,
    unique,
)
from .tracker_proc import TrackerProcess

PARTITIONS = 8
DAY_MS = 86_400_000
SEED_CHUNK = 20_000
#: Different messages whose console pages scenario 5 asks for in turn.
MESSAGE_PAGES = 100
OP_BATCH = 1000
_POLICY = ResolvedPolicy(
    processing_timeout_ms=30_000, backoff=BackoffPolicy(), keep_payload_after_ms=2**62
)


def policy_for(_topic: str) -> ResolvedPolicy:
    return _POLICY


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def analyze(store: Store) -> None:
    """Refresh PostgreSQL's statistics of the tracked tables after a bulk seed.

    Autovacuum does this within a minute (``autovacuum_naptime``) of any change of a tenth of
    a table; the scenario seeds a million rows in a minute and measures at once. Until then
    the planner believes the table holds a few dozen rows and sorts a whole topic for each
    page rather than reading the index that has the page's order (docs/benchmarks.md).
    """
    if store.engine.dialect.name == "postgresql":
        async with store.engine.connect() as conn:
            await conn.execute(text("ANALYZE tracked_messages, tracked_ranges"))
            await conn.commit()


class Seeder:
    """Grows the tracked table through ``Store.apply`` and measures the store operations."""

    def __init__(self, store: Store, markers_topic: str, queue: str) -> None:
        self.store = store
        self.markers_topic = markers_topic
        self.queue = queue
        self.size = 0  #: tracked entries
        self.next_message = 0  #: messages started so far (offset space)
        self.oldest = 0  #: first message not acked yet
        self.epochs: dict[int, int] = {}

    async def load_epochs(self) -> None:
        """The epochs of the running tracker replica (claims are fenced by them)."""
        offsets = await self.store.partition_offsets(self.markers_topic)
        self.epochs = {p: epoch for p, (epoch, _) in offsets.items()}

    def _pending(self, n: int, *, ack: bool = False) -> list[PendingMarker]:
        now = to_millis(SystemClock().now())
        out = []
        first = self.oldest if ack else self.next_message
        for i in range(first, first + n):
            p, o = i % PARTITIONS, i // PARTITIONS
            marker = mk.ack(self.queue, p, o) if ack else mk.start(self.queue, p, o, DAY_MS)
            out.append(PendingMarker(marker, now, markers_partition(self.queue, p, PARTITIONS), 0))
        if ack:
            self.oldest += n
        else:
            self.next_message += n
        return out

    async def apply(self, markers: list[PendingMarker]) -> None:
        now = to_millis(SystemClock().now())
        # No partition progress: the seeder writes entries beside the running replica without
        # moving its markers offsets (nor fencing it).
        await self.store.apply(self.markers_topic, {}, markers, policy_for, now)

    async def grow_to(self, size: int) -> float:
        """Seed STARTs until ``size`` entries are tracked; returns entries/s."""
        watch = Stopwatch()
        added = 0
        while self.size < size:
            n = min(SEED_CHUNK, size - self.size)
            await self.apply(self._pending(n))
            self.size += n
            added += n
        rate = added / watch.seconds if added else float("nan")
        await analyze(self.store)
        return rate

    async def ingest_op(self) -> float:
        """Seconds per marker of one flush: 1,000 new STARTs + 1,000 ACKs of tracked entries."""
        batch = self._pending(OP_BATCH) + self._pending(OP_BATCH, ack=True)
        watch = Stopwatch()
        await self.apply(batch)
        return watch.seconds / len(batch)

    async def due_scan_op(self, far: int) -> tuple[float, float, int]:
        """(next_due_ms seconds, claim_due seconds for up to 1,000, entries claimed)."""
        watch = Stopwatch()
        await self.store.next_due_ms(range(PARTITIONS))
        next_due = watch.seconds
        watch = Stopwatch()
        claim = await self.store.claim_due_ranges(
            self.markers_topic,
            epochs=self.epochs,
            due_by=dict.fromkeys(range(PARTITIONS), far),
            now_ms=far,
            limit=OP_BATCH,
            lease_ms=DAY_MS * 365,
            token=unique("bench"),
        )
        return next_due, watch.seconds, len(claim.expanded())


async def timed_get(client: httpx.AsyncClient, path: str) -> float:
    watch = Stopwatch()
    response = await client.get(path)
    seconds = watch.seconds
    if response.status_code != 200:
        raise RuntimeError(f"GET {path}: {response.status_code} {response.text[:300]}")
    return seconds


async def sequential(client: httpx.AsyncClient, path: str, n: int) -> list[float]:
    await timed_get(client, path)  # warm up
    return [await timed_get(client, path) for _ in range(n)]


async def load(
    client: httpx.AsyncClient, paths: str | list[str], concurrency: int, seconds: float
) -> tuple[list[float], float]:
    """``concurrency`` clients asking one after another for ``paths`` (in turn) for
    ``seconds``: each request's latency, and requests per second."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds
    turns = itertools.cycle([paths] if isinstance(paths, str) else paths)

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            latencies.append(await timed_get(client, next(turns)))

    watch = Stopwatch()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, len(latencies) / watch.seconds


def _paced_load(
    bootstrap: str, markers: str, queue: str, rate: int, seconds: float, first: int
) -> None:
    """Child process: ``rate`` STARTs/s of new messages, each acked 3 s later."""

    async def main() -> None:
        from aiokafka import AIOKafkaProducer  # noqa: PLC0415

        from tracker.partitioning import marker_key  # noqa: PLC0415
        from tracker.protocol import encode_marker  # noqa: PLC0415

        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            tick = 0.05
            per_tick = max(1, int(rate * tick))
            started: list[tuple[float, int]] = []
            n = first
            begin = time.monotonic()
            next_tick = begin
            while time.monotonic() - begin < seconds:
                now = time.monotonic()
                batch = []
                for i in range(n, n + per_tick):
                    batch.append(mk.start(queue, i % PARTITIONS, i // PARTITIONS, DAY_MS))
                started.append((now, n))
                n += per_tick
                while started and started[0][0] < now - 3.0:
                    _, low = started.pop(0)
                    batch += [
                        mk.ack(queue, i % PARTITIONS, i // PARTITIONS)
                        for i in range(low, low + per_tick)
                    ]
                for marker in batch:
                    p = marker.origin_partition
                    await producer.send(
                        markers,
                        value=encode_marker(marker),
                        key=marker_key(queue, p),
                        partition=markers_partition(queue, p, PARTITIONS),
                    )
                next_tick += tick
                await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(main())


ENDPOINTS: dict[str, Callable[[str], str]] = {
    "list": lambda _q: "/v1/messages?limit=100",
    "list_due": lambda _q: "/v1/messages?state=in_flight&order=due&limit=100",
    "stats": lambda q: f"/v1/topics/{q}",
}


def console_pages(queue: str, message_ids: list[str]) -> dict[str, str | list[str]]:
    """The web console's pages (the tracker runs without tokens: reads are open, no login).

    A message's page is asked for many messages in turn, as operators look at different
    ones: the same one over and over would time the Kafka reads' sharing, not the reads.
    ``message_records`` is what the page loads after it is shown (the markers and payload
    read from Kafka).
    """
    return {
        "overview": "/console/",
        "topic": f"/console/topics/{queue}",
        "topic_due": f"/console/topics/{queue}?state=in_flight&order=due",
        "message": [f"/console/messages/{i}" for i in message_ids],
        "message_records": [f"/console/message-records/{i}" for i in message_ids],
        "dead_letters": "/console/dlq",
    }


async def produce_originals(bootstrap: str, queue: str, origins: list[dict[str, int]]) -> None:
    """Write the records that the console's message pages show, at their tracked offsets.

    The seeder tracks messages without producing them (1M records would dominate the run),
    so the queue's partitions are empty; a message page would then ask Kafka for a record
    past the end of its partition, which takes a broker a fetch wait to prove absent (~100 ms
    on tansu) and is not what an operator looks at: a tracked message's record exists.
    The queue topic is fresh, so record n of a partition lands at offset n.
    """
    wanted: dict[int, int] = {}
    for origin in origins:
        partition = origin["partition"]
        wanted[partition] = max(wanted.get(partition, 0), origin["offset"] + 1)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        sent = [
            await producer.send(queue, b"p" * 100, partition=partition)
            for partition, count in wanted.items()
            for _ in range(count)
        ]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


class StoreSeeder(Protocol):
    """What :func:`measure` asks of a seeder (per-message here, ranges in scale_ranges)."""

    async def grow_to(self, size: int) -> float: ...
    async def ingest_op(self) -> float: ...
    async def due_scan_op(self, far: int) -> tuple[float, float, int]: ...


@dataclass
class Replica:
    """A fresh store with a tracker replica (and its admin API) running on it."""

    store: Store
    queue: str
    markers: str
    proc: TrackerProcess
    client: httpx.AsyncClient
    settings: dict[str, Any]  #: the replica's settings (an API-only process takes the same)
    scratch: Path


@contextlib.asynccontextmanager
async def replica_on_fresh_store(infra: Infra, store_name: str, tag: str) -> AsyncIterator[Replica]:
    """Topics, a migrated store and a tracker replica subprocess; all removed afterwards."""
    bootstrap = infra.bootstrap
    queue = await create_topic(bootstrap, unique(f"bench-{tag}-queue"), PARTITIONS)
    markers = await create_topic(bootstrap, unique(f"bench-{tag}-markers"), PARTITIONS)
    url = infra.database_url(store_name, unique(tag))
    store = Store.from_url(url)
    proc: TrackerProcess | None = None
    try:
        await upgrade(store.engine)
        settings = {
            "kafka_bootstrap_servers": bootstrap,
            "database_url": url,
            "markers_topic": markers,
            "markers_partitions": PARTITIONS,
            "tracker_group": unique(f"bench-{tag}-tracker"),
            "replica_id": f"bench-{tag}",
        }
        proc = TrackerProcess(
            settings, free_port(), infra.scratch / f"tracker-{tag}-{store_name}.log"
        )
        await proc.start()
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=60) as client:
            yield Replica(store, queue, markers, proc, client, settings, infra.scratch)
    finally:
        if proc is not None:
            await proc.stop()
        await store.close()
        await delete_topics(bootstrap, [queue, markers])


@contextlib.asynccontextmanager
async def api_alone(replica: Replica, store_name: str) -> AsyncIterator[httpx.AsyncClient]:
    """The admin API in a process of its own on the replica's store (``kmq-tracker api``, the
    Helm chart's ``apiDeployment``): requests no longer share the engine's event loop."""
    proc = TrackerProcess(
        replica.settings,
        free_port(),
        replica.scratch / f"api-alone-{store_name}.log",
        api_only=True,
    )
    await proc.start()
    try:
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=60) as client:
            yield client
    finally:
        await proc.stop()


async def measure(
    seeder: StoreSeeder, replica: Replica, size: int, reps: int, api_requests: int, ingest_key: str
) -> dict[str, Any]:
    """Grow to ``size``, then time ingest, the due-scan and the endpoints (medians), and RSS."""
    seed_rate = await seeder.grow_to(size)
    ingest = [await seeder.ingest_op() for _ in range(reps)]
    far = to_millis(SystemClock().now()) + 365 * DAY_MS
    scans = [await seeder.due_scan_op(far) for _ in range(reps)]
    point: dict[str, Any] = {
        "size": size,
        "seed_rate": seed_rate,
        ingest_key: median(ingest) * 1e6,
        "next_due_ms": median([s[0] for s in scans]) * 1000,
        "claim_due_ms": median([s[1] for s in scans]) * 1000,
        "claimed": min(s[2] for s in scans),
    }
    for name, path in ENDPOINTS.items():
        latencies = await sequential(replica.client, path(replica.queue), api_requests)
        point[f"api_{name}_ms"] = median(latencies) * 1000
    point["rss_mb"], point["rss_peak_mb"] = replica.proc.rss()
    return point


async def run(
    infra: Infra,
    *,
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000),
    postgres_extra: tuple[int, ...] = (),
    stores: tuple[str, ...] = ("sqlite", "postgres"),
    reps: int = 7,
    api_requests: int = 20,
    api_seconds: float = 8.0,
    concurrency: int = 4,
    load_rate: int = 1000,
) -> tuple[ScenarioResult, ScenarioResult]:
    scale = ScenarioResult("scale", "4. Scale: per-operation cost from small to large stores")
    api = ScenarioResult("api_load", "5. Admin API under load (ingest running)")
    logging.getLogger("tracker").setLevel(logging.ERROR)
    for store_name in stores:
        store_sizes = sizes + (postgres_extra if store_name == "postgres" else ())
        series: list[dict[str, Any]] = []
        async with replica_on_fresh_store(infra, store_name, "s4") as replica:
            seeder = Seeder(replica.store, replica.markers, replica.queue)
            await seeder.load_epochs()
            for size in store_sizes:
                point = await measure(
                    seeder, replica, size, reps, api_requests, "ingest_us_per_marker"
                )
                if size == store_sizes[-1]:
                    async with api_alone(replica, store_name) as alone:
                        api.data[store_name] = await _api_load(
                            infra, {"engine": replica.client, "alone": alone}, replica.markers,
                            replica.queue, seeder, size, api_seconds, concurrency, load_rate,
                        )  # fmt: skip
                    point["rss_after_load_mb"], point["rss_peak_mb"] = replica.proc.rss()
                series.append(point)
                print(
                    f"  {store_name} {size:>10,}: ingest "
                    f"{point['ingest_us_per_marker']:.1f} us/marker, claim "
                    f"{point['claim_due_ms']:.1f} ms, list {point['api_list_ms']:.1f} ms, "
                    f"stats {point['api_stats_ms']:.1f} ms, RSS {point['rss_mb']:.0f} MB",
                    flush=True,
                )
        scale.data[store_name] = series
        _scale_figures(scale, store_name, series)
        _api_figures(api, store_name, api.data[store_name])
    return scale, api


async def _api_load(
    infra: Infra,
    layouts: dict[str, httpx.AsyncClient],
    markers: str,
    queue: str,
    seeder: Seeder,
    size: int,
    seconds: float,
    concurrency: int,
    rate: int,
) -> dict[str, Any]:
    """Each endpoint and console page in turn, with every layout: ``engine`` (the API in the
    tracker replica's process, on its event loop) and ``alone`` (an API-only process); the
    engine layout's figures are at the top level of the result, the other's under its name."""
    before = await highwaters(infra.bootstrap, markers)
    client = layouts["engine"]
    listed = (await client.get(f"/v1/messages?limit={MESSAGE_PAGES}")).json()["items"]
    await produce_originals(infra.bootstrap, queue, [item["origin"] for item in listed])
    pages = console_pages(queue, [item["id"] for item in listed])
    total = seconds * (len(ENDPOINTS) + len(pages)) * len(layouts) + 4
    process = multiprocessing.get_context("spawn").Process(
        target=_paced_load,
        args=(infra.bootstrap, markers, queue, rate, total, seeder.next_message + 10_000_000),
        daemon=True,
    )
    process.start()
    await asyncio.sleep(2.0)  # the load is flowing and the first flushes have happened
    out: dict[str, Any] = {"size": size, "concurrency": concurrency, "load_rate": rate}
    for layout, client in layouts.items():
        into = out if layout == "engine" else out.setdefault(layout, {})
        for name, path in ENDPOINTS.items():
            latencies, rps = await load(client, path(queue), concurrency, seconds)
            into[name] = {**summary_ms(latencies), "rps": rps}
        for name, page in pages.items():
            latencies, rps = await load(client, page, concurrency, seconds)
            into[f"console_{name}"] = {**summary_ms(latencies), "rps": rps}
    await asyncio.to_thread(process.join, total + 30)
    after = await highwaters(infra.bootstrap, markers)
    out["markers_written"] = sum(after.values()) - sum(before.values())
    out["markers_per_s"] = out["markers_written"] / total
    return out


def _scale_figures(result: ScenarioResult, store: str, series: list[dict[str, Any]]) -> None:
    first, last = series[0], series[-1]
    span = f"{first['size']:,} -> {last['size']:,}"
    for key, label in (
        ("ingest_us_per_marker", "ingest (Store.apply) per marker"),
        ("next_due_ms", "due-scan: next_due_ms"),
        ("claim_due_ms", "due-scan: claim_due of 1,000"),
        ("api_list_ms", "API list (key order)"),
        ("api_list_due_ms", "API list (in_flight by due)"),
        ("api_stats_ms", "API topic stats"),
    ):
        ratio = last[key] / first[key] if first[key] else float("nan")
        result.add(
            Figure(
                f"{store}: {label}, largest/smallest",
                ratio,
                "x",
                1.5,
                "<=",
                note=f"{span}: {first[key]:.3g} -> {last[key]:.3g}",
            )
        )
    at_1m = [p for p in series if p["size"] >= 1_000_000]
    peak = max(p.get("rss_peak_mb", p["rss_mb"]) for p in (at_1m or series[-1:]))
    result.add(
        Figure(
            f"{store}: tracker peak RSS at {(at_1m or series)[0]['size']:,} tracked",
            peak,
            "MB",
            256,
            "<=",
            note="VmHWM of the tracker+API process, incl. the API load test",
        )
    )
    result.add(
        Figure(
            f"{store}: tracker RSS growth, largest/smallest",
            last["rss_mb"] / first["rss_mb"],
            "x",
            1.25,
            "<=",
            note=f"{first['rss_mb']:.0f} MB -> {last['rss_mb']:.0f} MB after the same requests",
        )
    )


def _api_figures(result: ScenarioResult, store: str, data: dict[str, Any]) -> None:
    _layout_figures(result, store, data, data)
    if "alone" in data:
        _layout_figures(result, f"{store}, API in its own process,", data["alone"], data)
    result.add(
        Figure(f"{store}: markers written during the test", data["markers_per_s"], "markers/s")
    )


def _layout_figures(
    result: ScenarioResult, store: str, data: dict[str, Any], run: dict[str, Any]
) -> None:
    """One layout's figures (``run`` holds what the layouts share: size, clients)."""
    for name in ENDPOINTS:
        d = data[name]
        result.add(Figure(f"{store} {name}: p50 latency", d["p50_ms"], "ms"))
        result.add(
            Figure(
                f"{store} {name}: p99 latency",
                d["p99_ms"],
                "ms",
                50,
                "<=",
                note=f"{d['rps']:.0f} req/s, {run['concurrency']} clients, {run['size']:,} tracked",
            )
        )
        result.add(Figure(f"{store} {name}: throughput", d["rps"], "req/s"))
    for name in (k for k in data if k.startswith("console_")):
        d = data[name]
        page = name.removeprefix("console_")
        what = (
            "message page's Kafka reads (fragment)" if page == "message_records" else f"{page} page"
        )
        result.add(
            Figure(
                f"{store} console {what}: p95 latency",
                d["p95_ms"],
                "ms",
                200,
                "<=",
                note=f"{d['rps']:.0f} pages/s, {run['concurrency']} clients, "
                f"{run['size']:,} tracked, ingest running",
            )
        )
