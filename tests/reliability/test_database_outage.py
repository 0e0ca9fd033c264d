"""Database outage under load: the tracker stops ingesting, says it is not ready, and resumes.

One tracker replica (in this process, so that its ``health()`` can be sampled) runs with a
workload: a producer spreads messages over the whole run, a worker acks ~70 % of first
deliveries and drops the rest (only the tracker can bring those back), and acks every copy.
While the tracker is redelivering, its database goes away:

* **PostgreSQL**: a private server (never the shared one) is stopped (``pg_ctl stop -m fast``:
  every connection is cut) and started again after the outage;
* **SQLite**: another connection holds ``BEGIN EXCLUSIVE`` on the database file, so no one
  else can write (or, with the tracker's ``BEGIN IMMEDIATE`` transactions, do anything).

During the outage the test checks, every 200 ms:

* readiness: ``(await tracker.health()).ready`` is False with ``store_ok`` False, and each
  ``health()`` call answers promptly (a readiness probe must not hang);
* backpressure: the markers held in memory stay bounded (``max_pending_markers`` plus one
  fetch), while the consumers keep working and their markers pile up in Kafka;
* durability: the tracker's committed markers offsets (committed only after a store flush)
  do not move once the store is down.

After the database is back: readiness returns, every marker is applied, every message the
worker dropped is redelivered and acked, nothing acked comes back. Duplicate copies are
possible only if the outage hit the one transaction that records a redelivery round after its
copies were produced: at most ``REDELIVERY_BATCH`` per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from integration.engine_support import FAST_GROUP, TopicWatcher, high_watermarks, tracker_settings
from integration.workload import Ledger, message_index, produce_over_time
from support.broker import TopicFactory, unique_topic
from support.databases import sqlite_url
from support.private_postgres import PrivatePostgres

from tracker.client import KmqMessage
from tracker.engine.process import Tracker
from tracker.ids import MessageId
from tracker.runtime import create_tracker

from .harness import (
    ResilientWorker,
    assert_accounted,
    ledger_figures,
    metric,
    report,
    size,
    store_offsets,
    wait_settled,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 20250807
OUTAGE_S = size(10.0, 40.0)
SQLITE_LOCK_S = size(12.0, 45.0)  #: the soak lock outlasts SQLite's 30 s busy timeout
MESSAGES = size(300, 2000)
ACK_SHARE = 0.7
LEASE = timedelta(seconds=2)
REDELIVERY_BATCH = 20
MAX_PENDING = 500
MAX_RECORDS = 200
MARKERS_PARTITIONS = 4
HEALTH_ANSWERS_WITHIN = 3.0  #: a readiness probe that takes longer is as bad as a dead one
NOT_READY_WITHIN = 10.0  #: from the start of the outage to "not ready"


class Outage(Protocol):
    name: str

    async def begin(self) -> None: ...

    async def end(self) -> None: ...


class PostgresStopped:
    name = "postgres server stopped"

    def __init__(self, server: PrivatePostgres) -> None:
        self.server = server

    async def begin(self) -> None:
        await asyncio.to_thread(self.server.stop, "fast")

    async def end(self) -> None:
        await asyncio.to_thread(self.server.start)


class SqliteLocked:
    """Another process-like connection holds the database's write lock."""

    name = "sqlite file locked (BEGIN EXCLUSIVE elsewhere)"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    def _lock(self) -> None:
        conn = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        conn.execute("BEGIN EXCLUSIVE")
        self._conn = conn

    def _unlock(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.execute("ROLLBACK")
            conn.close()

    async def begin(self) -> None:
        await asyncio.to_thread(self._lock)

    async def end(self) -> None:
        await asyncio.to_thread(self._unlock)


@dataclass
class OutageLog:
    """What the samples taken during the outage showed."""

    samples: int = 0
    not_ready_after: float | None = None  #: seconds from the outage's start
    ready_during: list[float] = field(default_factory=list)  #: "ready" answers, by time
    slowest_health: float = 0.0
    max_pending: float = 0.0
    committed_frozen: dict[int, int] | None = None
    committed_moved: list[str] = field(default_factory=list)
    health_errors: list[str] = field(default_factory=list)
    #: a health() call still blocked when the outage ended, and when it was made
    pending_health: tuple[asyncio.Future[Any], float] | None = None


async def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The tracker group's committed markers offsets, read as any consumer can."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group)
    await consumer.start()
    try:
        out: dict[int, int] = {}
        for p in range(MARKERS_PARTITIONS):
            offset = await consumer.committed(TopicPartition(topic, p))
            out[p] = -1 if offset is None else int(offset)
        return out
    finally:
        await consumer.stop()


async def sample_health(
    tracker: Tracker, log: OutageLog, started: float, stop: asyncio.Event
) -> None:
    """``health()`` back to back (200 ms apart): what it says, and how long it takes.

    A call still running when the outage ends is left to finish on its own (the caller awaits
    it afterwards): the sampler never stretches the outage.
    """
    loop = asyncio.get_running_loop()
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while not stop.is_set():
            t0 = loop.time()
            call = asyncio.ensure_future(tracker.health())
            await asyncio.wait({call, stopped}, return_when=asyncio.FIRST_COMPLETED)
            took = loop.time() - t0
            log.slowest_health = max(log.slowest_health, took)
            if not call.done():
                # Still waiting when the outage ended: its latency is measured afterwards.
                log.pending_health = (call, t0)
                return
            health = call.result()
            log.samples += 1
            if health.ready:
                log.ready_during.append(round(t0 - started, 1))
            elif not health.store_ok and log.not_ready_after is None:
                log.not_ready_after = loop.time() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stopped), 0.2)
    finally:
        stopped.cancel()


async def sample_ingest(
    tracker: Tracker, log: OutageLog, started: float, stop: asyncio.Event, bootstrap: str
) -> None:
    """Markers held in memory (every 100 ms) and the committed markers offsets (every 0.5 s,
    from 1 s into the outage: a flush that was already committing when it began may finish)."""
    group = tracker.settings.tracker_group
    markers = tracker.settings.markers_topic
    loop = asyncio.get_running_loop()
    last_commit_check = 0.0
    while not stop.is_set():
        log.max_pending = max(log.max_pending, metric(tracker, "kmq_pending_markers"))
        now = loop.time()
        if now - started >= 1.0 and now - last_commit_check >= 0.5:
            last_commit_check = now
            committed = await committed_offsets(bootstrap, group, markers)
            if log.committed_frozen is None:
                log.committed_frozen = committed
            elif committed != log.committed_frozen:
                log.committed_moved.append(
                    f"{now - started:.1f}s: {log.committed_frozen} -> {committed}"
                )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def run_outage(
    *,
    bootstrap: str,
    topic_factory: TopicFactory,
    database_url: str,
    outage: Outage,
    duration: float,
    label: str,
) -> None:
    rng = random.Random(SEED)
    ack_first = {i for i in range(MESSAGES) if rng.random() < ACK_SHARE}
    topic = await topic_factory(partitions=3, prefix="dbout-queue")
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="dbout-markers")
    group = unique_topic("dbout-workers")
    settings = tracker_settings(
        bootstrap,
        database_url,
        markers,
        markers_partitions=MARKERS_PARTITIONS,
        redelivery_batch=REDELIVERY_BATCH,
        claim_lease=timedelta(seconds=2),
        max_idle_sleep=timedelta(seconds=2),
        max_pending_markers=MAX_PENDING,
        ingest_max_records=MAX_RECORDS,
        kafka_consumer_config=dict(FAST_GROUP),
        default_policy={"processing_timeout": LEASE, "max_attempts": 50},
    )

    def should_ack(message: KmqMessage) -> bool:
        return message.attempt >= 2 or message_index(message) in ack_first

    started = time.monotonic()
    sent: dict[MessageId, int] = {}
    log = OutageLog()
    phases: dict[str, float] = {}
    async with contextlib.AsyncExitStack() as stack:
        tracker = create_tracker(settings)
        await tracker.start()
        stack.push_async_callback(tracker.close)
        await wait_until(
            lambda: len(tracker.ingest.owned_epochs()) == MARKERS_PARTITIONS,
            within=40,
            what="the tracker to own every markers partition",
        )
        watcher = await stack.enter_async_context(TopicWatcher(bootstrap, topic))
        worker = ResilientWorker(bootstrap, topic, group, markers, should_ack)
        await stack.enter_async_context(worker)
        await worker.wait_joined()
        # Production spans the run: before, during and after the outage.
        batch = 10
        interval = (duration + 8.0) / (MESSAGES / batch)
        producing = asyncio.create_task(
            produce_over_time(bootstrap, topic, MESSAGES, batch=batch, interval=interval, sent=sent)
        )
        stack.push_async_callback(_finish, producing)

        def copies() -> int:
            return sum(1 for r in watcher.on(topic) if r.header("kmq-origin") is not None)

        # Under load: the tracker is redelivering when the database goes.
        await wait_until(lambda: copies() >= 5, within=30, what="the first redeliveries")
        markers_before = sum((await high_watermarks(bootstrap, markers)).values())
        received_before = len(worker.received)
        loop = asyncio.get_running_loop()
        outage_started = loop.time()
        await outage.begin()
        stop_sampling = asyncio.Event()
        samplers = [
            asyncio.create_task(sample_health(tracker, log, outage_started, stop_sampling)),
            asyncio.create_task(
                sample_ingest(tracker, log, outage_started, stop_sampling, bootstrap)
            ),
        ]
        try:
            await asyncio.sleep(max(0.0, duration - (loop.time() - outage_started)))
        finally:
            stop_sampling.set()
            await asyncio.gather(*samplers)
        markers_during = sum((await high_watermarks(bootstrap, markers)).values())
        received_during = len(worker.received) - received_before
        await outage.end()
        outage_ended = loop.time()
        if log.pending_health is not None:
            call, called_at = log.pending_health
            health = await call
            took = loop.time() - called_at
            log.slowest_health = max(log.slowest_health, took)
            if took > HEALTH_ANSWERS_WITHIN:
                log.health_errors.append(
                    f"health() called {outage_ended - called_at:.1f}s before the end of the "
                    f"outage answered only {took:.1f}s later (ready={health.ready})"
                )
        phases["outage"] = outage_ended - outage_started

        # Recovery: ready again, and everything written meanwhile applied.
        ends = await high_watermarks(bootstrap, markers)

        async def ready() -> bool:
            return (await tracker.health()).ready

        await wait_until(ready, within=60, what="the tracker to be ready again")
        phases["ready_again"] = loop.time() - outage_ended

        async def caught_up() -> bool:
            applied = await store_offsets(tracker.store, markers)
            return all(applied.get(p, -1) >= end for p, end in ends.items() if end)

        await wait_until(caught_up, within=60, what="the backlog of the outage applied")
        phases["caught_up"] = loop.time() - outage_ended
        await producing
        await wait_settled(
            store=tracker.store,
            worker=worker,
            sent=sent,
            group=group,
            bootstrap=bootstrap,
            markers=markers,
            within=90,
        )
        await worker.stop()
        await wait_settled(
            store=tracker.store,
            worker=worker,
            sent=sent,
            group=group,
            bootstrap=bootstrap,
            markers=markers,
            within=60,
        )
        ledger = Ledger.build(sent, await watcher.read_to_end(topic), worker)

    figures = report(
        ledger_figures(
            f"database outage, {label}",
            ledger,
            worker,
            duplicate_bound=REDELIVERY_BATCH,
            recovery_s=phases["caught_up"],
            started=started,
            outage_s=phases["outage"],
            not_ready_after_s=log.not_ready_after,
            ready_again_s=phases["ready_again"],
            slowest_health_s=log.slowest_health,
            max_pending_markers=int(log.max_pending),
            markers_piled_up=markers_during - markers_before,
            worker_receptions_during=received_during,
        )
    )
    dropped = [o for o, i in sent.items() if i not in ack_first]
    assert len(sent) == MESSAGES
    assert_accounted(ledger, figures)
    assert [o for o in dropped if ledger.copies[(o, 2)] == 0] == [], (
        "a dropped message not redelivered"
    )
    # Consumers kept working without the database; their markers waited in Kafka.
    assert received_during > 0, "the worker received nothing during the outage"
    assert markers_during > markers_before, "no markers were written during the outage"
    # Backpressure: the tracker did not buffer the outage in memory.
    assert log.max_pending <= MAX_PENDING + MAX_RECORDS, log.max_pending
    # Nothing was committed that is not durable.
    assert log.committed_frozen is not None
    assert log.committed_moved == [], f"committed markers offsets moved: {log.committed_moved}"
    # Readiness told the truth, promptly.
    assert log.health_errors == [], log.health_errors
    assert log.slowest_health <= HEALTH_ANSWERS_WITHIN, (
        f"health() took {log.slowest_health:.1f}s during the outage"
    )
    assert log.not_ready_after is not None, (
        f"the tracker never reported not-ready during a {duration:.0f}s outage "
        f"({log.samples} samples, ready at {log.ready_during})"
    )
    assert log.not_ready_after <= NOT_READY_WITHIN, log.not_ready_after


async def _finish(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def test_postgres_stopped_and_restarted(
    kafka_bootstrap: str, topic_factory: TopicFactory, private_postgres: PrivatePostgres
) -> None:
    url = await asyncio.to_thread(private_postgres.create_database)
    await run_outage(
        bootstrap=kafka_bootstrap,
        topic_factory=topic_factory,
        database_url=url,
        outage=PostgresStopped(private_postgres),
        duration=OUTAGE_S,
        label="postgres stopped",
    )


async def test_sqlite_file_locked(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    path = tmp_path / "kmq.sqlite3"
    await run_outage(
        bootstrap=kafka_bootstrap,
        topic_factory=topic_factory,
        database_url=sqlite_url(path),
        outage=SqliteLocked(path),
        duration=SQLITE_LOCK_S,
        label="sqlite locked",
    )
