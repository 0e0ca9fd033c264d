"""Broker unreachable under load: connections dropped, then stalled; everyone recovers.

Every client — the tracker (in this process), the worker's consumer and marker producer, the
producer of the workload — bootstraps from a proxy, and metadata never leads a client around
it: by default a dedicated tansu broker advertises a :class:`~support.proxy.TcpProxy` in front
of it; with ``KAFKA_BOOTSTRAP_SERVERS`` (an external cluster, whose advertised listeners we
cannot change) a :class:`~support.kafka_proxy.KafkaProxy` in front of it rewrites the broker
addresses of Metadata and FindCoordinator responses to its own listeners (see
``reliability/proxied_broker.py``). While the tracker is redelivering, the network fails in two
ways, back to back:

1. **drop**: every connection is reset and new ones are reset on accept (a broker that went
   away: clients see errors at once);
2. **stall**: connections are accepted and held, nothing is forwarded (a black-holed network:
   clients see only timeouts); then the proxy heals and forwards again.

Afterwards every message must be accounted for. "Acked" means an ACK marker the broker
confirmed to the worker, or an ACK marker found on the markers topic (an ACK whose
confirmation was lost in the outage may still have been written). A copy made after such an
ACK is a **violation** only if the ACK had been confirmed well before the copy was produced
(``ACK_SLACK``): an ACK that reached the broker only after the outage, when the message's lease
had long expired, may legitimately lose the race to the redelivery (a worker cut off past its
lease is a worker that died, for the tracker); those are counted and reported as duplicate
deliveries allowed by at-least-once. Duplicate *copies* (the same attempt twice) can come only
from a redelivery round whose record transaction ran after its copies were produced and failed:
the bound is one round per outage phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from integration.engine_support import FAST_GROUP, high_watermarks, tracker_settings
from integration.workload import Ledger, message_index
from support.broker import create_topics, unique_topic

from tracker.client import KmqMessage, KmqProducer
from tracker.engine.process import Tracker
from tracker.ids import MessageId
from tracker.protocol import MarkerKind, decode_marker
from tracker.runtime import create_tracker
from tracker.store import StoreUnavailable

from .harness import (
    ResilientWorker,
    ledger_figures,
    read_topic,
    report,
    size,
    store_offsets,
    wait_settled,
    wait_until,
)
from .proxied_broker import ProxiedBroker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 20250808
DROP_S = size(8.0, 25.0)
STALL_S = size(7.0, 25.0)
MESSAGES = size(300, 1500)
ACK_SHARE = 0.7
LEASE = timedelta(seconds=3)
REDELIVERY_BATCH = 20
MARKERS_PARTITIONS = 4
ACK_SLACK_MS = 5_000
NOT_READY_WITHIN = 10.0  #: from the cut to "not ready" (the tracker's session is 6 s)
#: Long enough for a send to outlive the whole outage (the workload's producer never gives up).
PRODUCER_REQUEST_TIMEOUT_MS = int((DROP_S + STALL_S + 60) * 1000)


async def produce_patiently(
    bootstrap: str,
    topic: str,
    count: int,
    *,
    batch: int,
    interval: float,
    sent: dict[MessageId, int],
) -> None:
    """Like ``produce_over_time``, with a producer that waits out any outage of the test."""
    async with KmqProducer(
        bootstrap, linger_ms=5, request_timeout_ms=PRODUCER_REQUEST_TIMEOUT_MS
    ) as producer:
        for start in range(0, count, batch):
            indexes = range(start, min(count, start + batch))
            futures = [
                await producer.send_nowait(topic, f"m{i}".encode(), key=f"k{i}".encode())
                for i in indexes
            ]
            for i, future in zip(indexes, futures, strict=True):
                metadata = await future
                sent[MessageId(topic, metadata.partition, metadata.offset)] = i
            if start + batch < count:
                await asyncio.sleep(interval)


@dataclass
class HealthLog:
    samples: int = 0
    not_ready: int = 0
    broker_down: int = 0
    first_not_ready_s: float | None = None
    details: list[str] = field(default_factory=list)


async def sample_health(
    tracker: Tracker, log: HealthLog, started: float, stop: asyncio.Event
) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            health = await asyncio.wait_for(tracker.health(), 5)
        except (TimeoutError, StoreUnavailable) as exc:
            log.details.append(f"health() failed: {exc!r}")
        else:
            log.samples += 1
            if not health.ready:
                log.not_ready += 1
                if log.first_not_ready_s is None:
                    log.first_not_ready_s = loop.time() - started
            if not health.broker_ok:
                log.broker_down += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


async def test_broker_dropped_then_stalled_loses_nothing(postgres_url: str, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    ack_first = {i for i in range(MESSAGES) if rng.random() < ACK_SHARE}
    started = time.monotonic()
    async with ProxiedBroker(tmp_path / "tansu") as broker:
        bootstrap = broker.address
        topic = unique_topic("brk-queue")
        markers = unique_topic("brk-markers")
        broker.own_topics += [topic, markers]  # and the tracker's topics named after them
        await create_topics(bootstrap, {topic: 3, markers: MARKERS_PARTITIONS})
        group = unique_topic("brk-workers")
        settings = tracker_settings(
            bootstrap,
            postgres_url,
            markers,
            markers_partitions=MARKERS_PARTITIONS,
            redelivery_batch=REDELIVERY_BATCH,
            claim_lease=timedelta(seconds=3),
            max_idle_sleep=timedelta(seconds=2),
            kafka_consumer_config=dict(FAST_GROUP),
            default_policy={"processing_timeout": LEASE, "max_attempts": 50},
        )

        def should_ack(message: KmqMessage) -> bool:
            return message.attempt >= 2 or message_index(message) in ack_first

        sent: dict[MessageId, int] = {}
        phases: dict[str, float] = {}
        health = HealthLog()
        async with contextlib.AsyncExitStack() as stack:
            tracker = create_tracker(settings)
            await tracker.start()
            stack.push_async_callback(tracker.close)
            await wait_until(
                lambda: len(tracker.ingest.owned_epochs()) == MARKERS_PARTITIONS,
                within=40,
                what="the tracker to own every markers partition",
            )
            worker = ResilientWorker(bootstrap, topic, group, markers, should_ack)
            await stack.enter_async_context(worker)
            await worker.wait_joined()
            outage = DROP_S + STALL_S
            batch = 10
            producing = asyncio.create_task(
                produce_patiently(
                    bootstrap,
                    topic,
                    MESSAGES,
                    batch=batch,
                    interval=(outage + 8) / (MESSAGES / batch),
                    sent=sent,
                )
            )
            stack.push_async_callback(_finish, producing)
            await wait_until(
                lambda: metric_redeliveries(tracker) >= 5, within=30, what="the first redeliveries"
            )
            loop = asyncio.get_running_loop()
            cut = loop.time()
            stop_sampling = asyncio.Event()
            sampler = asyncio.create_task(sample_health(tracker, health, cut, stop_sampling))
            try:
                broker.proxy.drop()
                await asyncio.sleep(DROP_S)
                broker.proxy.stall()
                await asyncio.sleep(STALL_S)
                broker.proxy.resume()
            finally:
                broker.proxy.resume()
                stop_sampling.set()
                await sampler
            healed = loop.time()
            phases["outage"] = healed - cut
            copies_at_heal = metric_redeliveries(tracker)

            ends = await high_watermarks(bootstrap, markers)

            async def caught_up() -> bool:
                applied = await store_offsets(tracker.store, markers)
                return all(applied.get(p, -1) >= end for p, end in ends.items() if end)

            await wait_until(caught_up, within=90, what="the markers of the outage applied")
            phases["caught_up"] = loop.time() - healed

            async def ready() -> bool:
                return (await tracker.health()).ready

            await wait_until(ready, within=90, what="the tracker to be ready again")
            phases["ready_again"] = loop.time() - healed
            await wait_until(
                lambda: bool(worker.received) and worker.received[-1].at > time.time() - 1,
                within=90,
                what="the worker to receive messages again",
            )
            phases["worker_again"] = loop.time() - healed
            await wait_until(
                lambda: metric_redeliveries(tracker) > copies_at_heal,
                within=90,
                what="the tracker to redeliver again",
            )
            phases["redelivering_again"] = loop.time() - healed
            await producing
            await wait_settled(
                store=tracker.store,
                worker=worker,
                sent=sent,
                group=group,
                bootstrap=bootstrap,
                markers=markers,
                within=120,
                explain=lambda: (
                    f"worker errors {worker.fetch_errors}/{worker.ack_errors}: "
                    f"{worker.last_error}; tracker {tracker.ingest.last_error}"
                ),
            )
            phases["settled"] = loop.time() - healed
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
        queue_records = await read_topic(bootstrap, topic)
        marker_records = await read_topic(bootstrap, markers)
        proxy_errors = broker.proxy_errors

    ledger = Ledger.build(sent, queue_records, worker)
    confirmed = dict(ledger.acked)
    on_topic = acks_on_markers_topic(marker_records, group)
    ledger.acked = {
        o: confirmed.get(o, set()) | on_topic.get(o, set()) for o in {*confirmed, *on_topic}
    }
    violations, late = classify_redeliveries_after_ack(ledger, worker)
    figures = ledger_figures(
        "broker unreachable (proxy drop + stall)",
        ledger,
        worker,
        duplicate_bound=2 * REDELIVERY_BATCH,
        recovery_s=max(
            phases["caught_up"],
            phases["ready_again"],
            phases["worker_again"],
            phases["redelivering_again"],
        ),
        started=started,
        drop_s=DROP_S,
        stall_s=STALL_S,
        ready_again_s=phases["ready_again"],
        worker_again_s=phases["worker_again"],
        redelivering_again_s=phases["redelivering_again"],
        settled_s=phases["settled"],
        redelivered_after_late_ack=len(late),
        acks_unconfirmed_but_written=sum(
            len(on_topic.get(o, set()) - confirmed.get(o, set())) for o in on_topic
        ),
        worker_fetch_errors=worker.fetch_errors,
        worker_ack_errors=worker.ack_errors,
        not_ready_samples=f"{health.not_ready}/{health.samples}",
        broker_down_samples=f"{health.broker_down}/{health.samples}",
        proxy_resets=broker.proxy.stats.refused,
    )
    figures.acked_then_redelivered = len(violations)
    report(figures)
    assert proxy_errors == [], f"responses the proxy could not rewrite: {proxy_errors}"
    assert len(sent) == MESSAGES
    assert ledger.strangers() == []
    assert ledger.never_acked() == [], f"lost: {ledger.never_acked()[:20]}"
    assert violations == [], f"redelivered well after a confirmed ack: {violations[:20]}"
    assert figures.duplicates <= figures.duplicate_bound, ledger.duplicates()
    assert health.details == [], health.details
    # Readiness must not claim "Kafka answers" through an outage of this length.
    assert health.first_not_ready_s is not None, (
        f"the tracker reported ready throughout a {DROP_S + STALL_S:.0f}s broker outage "
        f"({health.samples} samples, broker_ok every time)"
    )
    assert health.first_not_ready_s <= NOT_READY_WITHIN, health.first_not_ready_s


def metric_redeliveries(tracker: Tracker) -> float:
    total = 0.0
    for family in tracker.metrics.registry.collect():
        if family.name == "kmq_redeliveries":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def acks_on_markers_topic(records: list[Any], group: str) -> dict[MessageId, set[int]]:
    """``origin -> attempts`` with an ACK marker of ``group`` on the markers topic."""
    out: dict[MessageId, set[int]] = defaultdict(set)
    for record in records:
        marker = decode_marker(record.value)
        if marker.kind is MarkerKind.ACK and marker.group == group:
            origin = MessageId(marker.origin_topic, marker.origin_partition, marker.origin_offset)
            out[origin].add(marker.attempt)
    return out


def classify_redeliveries_after_ack(
    ledger: Ledger, worker: ResilientWorker
) -> tuple[list[tuple[MessageId, int]], list[tuple[MessageId, int]]]:
    """Split ``acked_then_redelivered`` into violations and redeliveries after a late ACK.

    A violation: the worker had the broker's confirmation of the ACK of attempt n more than
    ``ACK_SLACK_MS`` before the copy with attempt n+1 was produced (its timestamp).
    """
    confirmed_at: dict[tuple[MessageId, int], float] = {}
    for r in worker.received:
        if r.acked:
            key = (r.origin, r.attempt)
            confirmed_at[key] = min(confirmed_at.get(key, r.at), r.at)
    copy_at: dict[tuple[MessageId, int], int] = {}
    for record in ledger.copy_records:
        raw_origin = record.header("kmq-origin")
        raw_attempt = record.header("kmq-attempt")
        if raw_origin is None or raw_attempt is None:
            continue
        key = (MessageId.parse(raw_origin.decode()), int(raw_attempt))
        copy_at[key] = min(copy_at.get(key, record.timestamp_ms), record.timestamp_ms)
    violations: list[tuple[MessageId, int]] = []
    late: list[tuple[MessageId, int]] = []
    for origin, n in ledger.acked_then_redelivered():
        acked = confirmed_at.get((origin, n))
        produced = copy_at.get((origin, n + 1))
        if acked is not None and produced is not None and produced > acked * 1000 + ACK_SLACK_MS:
            violations.append((origin, n))
        else:
            late.append((origin, n))
    return violations, late


async def _finish(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
