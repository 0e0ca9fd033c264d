"""Rolling upgrades: v1 and v2 consumers in one group, partitions handed from one to the other.

A group may run old (protocol v1, one START and one ACK per message) and new (v2, range
markers) clients side by side for a while, and a partition may move from a v2 client to a v1
one and back within seconds. The tracker reads both from the same markers topic, in order per
origin partition, so nothing may be lost and nothing may come back once its ack was written
(the markers topic decides: a batch read again after a commit failed at a rebalance may be
copied and acked both, a documented duplicate). Each worker acks about 70 % of first
deliveries and drops the rest (no marker: only the tracker can bring them back), and acks
every copy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from datetime import timedelta

import pytest
from support.broker import TopicFactory

from tracker.client import KmqMessage
from tracker.ids import MessageId

from .engine_support import TopicWatcher, eventually
from .test_engine import running_tracker
from .workload import Ledger, MarkerLog, Worker, message_index, produce_over_time

pytestmark = [pytest.mark.integration]

MESSAGES = 120
LEASE = timedelta(seconds=2)


def should_ack(message: KmqMessage) -> bool:
    return message.attempt >= 2 or message_index(message) % 10 < 7


class _Everyone:
    """The workers of the group taken together, for the ledger."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def acked_attempts(self) -> dict[MessageId, set[int]]:
        out: dict[MessageId, set[int]] = defaultdict(set)
        for worker in self.workers:
            for origin, attempts in worker.acked_attempts().items():
                out[origin] |= attempts
        return out


async def test_v1_and_v2_consumers_share_a_group_and_hand_partitions_over(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> None:
    topic = await topic_factory(partitions=4, prefix="mixed-queue")
    env = {
        "bootstrap": kafka_bootstrap,
        "database_url": database_url,
        "topic": topic,
        "markers": await topic_factory(partitions=4, prefix="mixed-markers"),
        "group": f"mixed-{topic}",
    }
    args = (kafka_bootstrap, topic, env["group"], env["markers"])
    workers: list[Worker] = []
    sent: dict[MessageId, int] = {}

    def worker(version: int) -> Worker:
        made = Worker(*args, should_ack, processing_timeout=LEASE, marker_version=version)
        workers.append(made)
        return made

    def acked() -> int:
        return len(_Everyone(workers).acked_attempts())

    async with (
        running_tracker(env, default_policy={"processing_timeout": 2, "max_attempts": 5}),
        TopicWatcher(kafka_bootstrap, topic, env["markers"]) as watcher,
        contextlib.AsyncExitStack() as stack,
    ):
        old = await stack.enter_async_context(worker(1))
        await old.wait_joined()
        producing = asyncio.create_task(
            produce_over_time(kafka_bootstrap, topic, MESSAGES, batch=6, interval=0.25, sent=sent)
        )
        await eventually(lambda: acked() >= 15, within=60, what="the v1 worker at work")
        new = await stack.enter_async_context(worker(2))  # v1 and v2 share the partitions
        await new.wait_joined()
        await eventually(lambda: len(new.received) >= 10, within=60, what="the v2 worker at work")
        await old.__aexit__(None, None, None)  # v2 takes every partition over from v1
        await eventually(
            lambda: len(new.received) >= 40, within=60, what="the v2 worker alone at work"
        )
        back = await stack.enter_async_context(worker(1))  # and back to v1
        await back.wait_joined()
        await new.__aexit__(None, None, None)
        await producing
        await eventually(
            lambda: acked() == MESSAGES, within=120, what=f"all {MESSAGES} messages acked"
        )
        ledger = Ledger.build(sent, await watcher.read_to_end(topic), _Everyone(workers))  # type: ignore[arg-type]
        markers = MarkerLog.read(await watcher.read_to_end(env["markers"]))

    print(f"\n[mixed v1/v2 group] {ledger.summary()}")
    assert {w.marker_version for w in workers if w.received} == {1, 2}
    assert ledger.strangers() == []
    assert ledger.never_acked() == []
    # A batch STARTed at a rebalance whose offset commit failed is read again by the next
    # owner, which acks it, while the tracker may already have copied it (the lease ran out
    # during the rebalance): a duplicate, not a broken ack. The markers topic tells them apart.
    unwritten = [
        (o, n) for o, acked in ledger.acked.items() for n in acked if (o, n) not in markers.acked_ms
    ]
    assert unwritten == [], f"acks that never reached the markers topic: {unwritten[:10]}"
    broken = ledger.acked_then_copied(markers)
    assert broken == [], "\n".join(ledger.story(o, markers, workers) for o, _ in broken[:10])
