"""Rebalance storm: tracker replicas (PostgreSQL) join and leave again and again under load.

Replicas run in this process, in one tracker group, on a PostgreSQL database of the test's own. A
workload runs throughout (a worker that drops ~30 % of first deliveries, so the replicas have
redeliveries to make, and acks every copy). Membership changes follow a fixed script (CI) or
a seeded random walk between one and four replicas (soak); after each change the test waits
until the live replicas own every markers partition exactly once (a finished rebalance),
then holds for a random moment of work.

Every handover here is graceful (a replica that leaves flushes, releases its partitions and
leaves the group), and a redelivery round is far shorter than the claim lease, so at-least-once
allows no duplicate at all: an entry claimed by a replica that loses its partition stays
claimed until that replica records the round, and the new owner (a higher epoch) never claims
it meanwhile. Crashes are the crash-safety test's subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from integration.engine_support import FAST_GROUP, TopicWatcher, tracker_settings
from integration.workload import Ledger, message_index, produce_over_time
from support.broker import TopicFactory, unique_topic

from tracker.client import KmqMessage
from tracker.engine.redelivery_rounds import TrackerEvent
from tracker.ids import MessageId
from tracker.runtime import create_tracker

from .harness import (
    SOAK,
    ResilientWorker,
    assert_accounted,
    ledger_figures,
    report,
    size,
    wait_settled,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 20250809
MARKERS_PARTITIONS = 8
MESSAGES = size(300, 2000)
ACK_SHARE = 0.7
LEASE = timedelta(seconds=2)
REDELIVERY_BATCH = 20
MAX_REPLICAS = 4
#: CI: a fixed script of joins (+) and leaves (-): 1 -> 3 -> 1 replicas, the first one leaving.
CI_SCRIPT = ["+b", "+c", "-a", "-b"]
SOAK_CHANGES = 24
REBALANCED_WITHIN = 45.0


class Replica:
    def __init__(self, name: str, settings_kw: dict[str, Any]) -> None:
        self.name = name
        self.copies: list[tuple[MessageId, int]] = []
        self.tracker = create_tracker(
            tracker_settings(**settings_kw, replica_id=name), on_event=self._event
        )

    def _event(self, event: TrackerEvent) -> None:
        e = event.entry
        if event.kind == "redelivered":
            self.copies.append(
                (MessageId(e.origin_topic, e.origin_partition, e.origin_offset), e.attempt + 1)
            )

    def owned(self) -> set[int]:
        return set(self.tracker.ingest.owned_epochs())


def membership_script(rng: random.Random) -> list[str]:
    """The joins and leaves of this run (names a, b, c, ... in order of first join)."""
    if not SOAK:
        return list(CI_SCRIPT)
    live = ["a"]
    names = iter("bcdefghijklmnopqrstuvwxyz" * 4)
    script: list[str] = []
    for _ in range(SOAK_CHANGES):
        join = len(live) == 1 or (len(live) < MAX_REPLICAS and rng.random() < 0.5)
        if join:
            name = next(names)
            live.append(name)
            script.append(f"+{name}")
        else:
            name = rng.choice(live)
            live.remove(name)
            script.append(f"-{name}")
    return script


def ownership_settled(live: dict[str, Replica]) -> bool:
    owned = [replica.owned() for replica in live.values()]
    if any(not o for o in owned):
        return False  # a member without partitions: the rebalance is not over
    every = [p for o in owned for p in o]
    return sorted(every) == list(range(MARKERS_PARTITIONS))


async def test_replicas_join_and_leave_repeatedly(
    kafka_bootstrap: str, topic_factory: TopicFactory, postgres_url: str
) -> None:
    rng = random.Random(SEED)
    ack_first = {i for i in range(MESSAGES) if rng.random() < ACK_SHARE}
    script = membership_script(rng)
    topic = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="storm-queue")
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="storm-markers")
    group = unique_topic("storm-workers")
    settings_kw: dict[str, Any] = {
        "bootstrap": kafka_bootstrap,
        "database_url": postgres_url,
        "markers_topic": markers,
        "markers_partitions": MARKERS_PARTITIONS,
        "tracker_group": f"tracker-{markers}",
        "redelivery_batch": REDELIVERY_BATCH,
        # A round takes well under a second; the lease only matters for a replica that dies.
        "claim_lease": timedelta(seconds=15),
        "max_idle_sleep": timedelta(seconds=2),
        "kafka_consumer_config": dict(FAST_GROUP),
        "default_policy": {"processing_timeout": LEASE, "max_attempts": 50},
    }

    def should_ack(message: KmqMessage) -> bool:
        return message.attempt >= 2 or message_index(message) in ack_first

    started = time.monotonic()
    sent: dict[MessageId, int] = {}
    all_replicas: list[Replica] = []
    live: dict[str, Replica] = {}
    handovers: list[float] = []
    loop = asyncio.get_running_loop()

    async def join(name: str) -> None:
        replica = Replica(name, settings_kw)
        all_replicas.append(replica)
        live[name] = replica
        await replica.tracker.start()

    async def leave(name: str) -> None:
        replica = live.pop(name)
        await replica.tracker.close()

    def explain() -> str:
        return "; ".join(f"{n}: {sorted(r.owned())}" for n, r in live.items())

    async with contextlib.AsyncExitStack() as stack:

        async def close_live() -> None:
            for replica in list(live.values()):
                await replica.tracker.close()

        stack.push_async_callback(close_live)
        await join("a")
        await wait_until(
            lambda: ownership_settled(live), within=REBALANCED_WITHIN, what="a owns everything"
        )
        watcher = await stack.enter_async_context(TopicWatcher(kafka_bootstrap, topic))
        worker = ResilientWorker(kafka_bootstrap, topic, group, markers, should_ack)
        await stack.enter_async_context(worker)
        await worker.wait_joined()
        # Production spans the storm (about 5 s per change on tansu).
        batch = 10
        producing = asyncio.create_task(
            produce_over_time(
                kafka_bootstrap,
                topic,
                MESSAGES,
                batch=batch,
                interval=(len(script) * 5.0 + 5) / (MESSAGES / batch),
                sent=sent,
            )
        )
        stack.push_async_callback(_finish, producing)
        await wait_until(
            lambda: sum(len(r.copies) for r in all_replicas) >= 5,
            within=30,
            what="the first redeliveries",
        )
        for change in script:
            op, name = change[0], change[1:]
            t0 = loop.time()
            if op == "+":
                await join(name)
            else:
                await leave(name)
            await wait_until(
                lambda: ownership_settled(live),
                within=REBALANCED_WITHIN,
                what=f"the rebalance after {change}",
                explain=explain,
            )
            handovers.append(loop.time() - t0)
            await asyncio.sleep(rng.uniform(0.2, 1.5))
        await producing
        survivor = next(iter(live.values()))
        settled = await wait_settled(
            store=survivor.tracker.store,
            worker=worker,
            sent=sent,
            group=group,
            bootstrap=kafka_bootstrap,
            markers=markers,
            within=90,
            explain=explain,
        )
        await worker.stop()
        await wait_settled(
            store=survivor.tracker.store,
            worker=worker,
            sent=sent,
            group=group,
            bootstrap=kafka_bootstrap,
            markers=markers,
            within=60,
        )
        ledger = Ledger.build(sent, await watcher.read_to_end(topic), worker)

    by_replica = {r.name: Counter(r.copies) for r in all_replicas}
    twice = [
        key
        for key in {k for c in by_replica.values() for k in c}
        if sum(c[key] for c in by_replica.values()) > 1
    ]
    figures = report(
        ledger_figures(
            "rebalance storm (replicas join/leave)",
            ledger,
            worker,
            duplicate_bound=0,
            recovery_s=max(handovers),
            started=started,
            changes=len(script),
            replicas_used=len(all_replicas),
            handover_avg_s=sum(handovers) / len(handovers),
            handover_max_s=max(handovers),
            settled_after_storm_s=settled,
            copies_by_replica={n: sum(c.values()) for n, c in by_replica.items()},
        )
    )
    assert len(sent) == MESSAGES
    assert_accounted(ledger, figures)
    assert twice == [], f"redelivered by more than one replica or twice: {twice[:10]}"
    dropped = [o for o, i in sent.items() if i not in ack_first]
    assert [o for o in dropped if ledger.copies[(o, 2)] == 0] == []
    working = [n for n, c in by_replica.items() if c]
    assert len(working) >= 2, f"only {working} redelivered anything: the storm did not move work"


async def _finish(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
