"""``KmqConsumer.run`` (the worker pool) against a real Kafka-protocol broker.

What a user relies on when processing beyond the partition count: never more than
``concurrency`` handlers at once; per key, one message at a time and in offset order, also
while partitions move between members; stopping finishes what was taken and loses nothing; a
slow handler keeps its lease (renewed for it) and is not redelivered while it runs; a hung one
is cancelled and its message retried by the tracker.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import pytest
from support.broker import TopicFactory

from tracker.client import KmqConsumer, KmqMessage, KmqProducer, WorkerStats
from tracker.ids import MessageId

from .engine_support import FAST_GROUP, TopicWatcher, eventually
from .test_engine import running_tracker
from .workload import copy_identity

pytestmark = [pytest.mark.integration]


@dataclass(frozen=True)
class Handled:
    """One handler call, as the handler saw it."""

    consumer: str
    key: bytes | None
    partition: int
    offset: int
    attempt: int
    started: float
    ended: float


def pool_consumer(
    bootstrap: str, topic: str, markers: str, group: str, **kw: object
) -> KmqConsumer:
    kw.setdefault("consumer_config", dict(FAST_GROUP))
    return KmqConsumer(
        topic,
        group_id=group,
        bootstrap_servers=bootstrap,
        markers_topic=markers,
        **kw,  # type: ignore[arg-type]
    )


class Running:
    """A consumer running ``run()`` in the background, recording each handler call."""

    def __init__(
        self,
        name: str,
        consumer: KmqConsumer,
        handled: list[Handled],
        work: Callable[[KmqMessage], Awaitable[None]],
        **run: object,
    ) -> None:
        self.name = name
        self.consumer = consumer
        self.handled = handled
        self.work = work
        self.run = run
        self.task: asyncio.Task[WorkerStats] | None = None

    async def _handler(self, message: KmqMessage) -> None:
        started = time.monotonic()
        await self.work(message)
        self.handled.append(
            Handled(
                self.name,
                message.key,
                message.partition,
                message.offset,
                message.attempt,
                started,
                time.monotonic(),
            )
        )

    async def __aenter__(self) -> Running:
        await self.consumer.start()
        self.task = asyncio.create_task(self.consumer.run(self._handler, **self.run))  # type: ignore[arg-type]
        return self

    async def stop(self) -> WorkerStats:
        assert self.task is not None
        await self.consumer.stop()
        return await self.task

    async def __aexit__(self, *exc: object) -> None:
        if self.task is not None and not self.task.done():
            await self.stop()
        await self.consumer.stop()


async def produce_keyed(bootstrap: str, topic: str, count: int, keys: int) -> None:
    async with KmqProducer(bootstrap) as producer:
        for i in range(count):
            await producer.send_nowait(topic, f"m{i}".encode(), key=f"key-{i % keys}".encode())
        await producer.flush()


def assert_key_order(handled: list[Handled]) -> None:
    """Per key: no two calls overlap in time, and offsets go up (first deliveries)."""
    by_key: dict[bytes | None, list[Handled]] = defaultdict(list)
    for call in handled:
        by_key[call.key].append(call)
    for key, calls in by_key.items():
        calls.sort(key=lambda c: c.started)
        for before, after in itertools.pairwise(calls):
            assert before.ended <= after.started, f"{key!r}: two at once: {before} / {after}"
            assert (before.partition, before.offset) < (after.partition, after.offset), (
                f"{key!r}: out of order: {before} then {after}"
            )


async def test_key_order_holds_under_concurrency_and_across_a_rebalance(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """Two members with key-ordered pools; the second joins while the first is busy, so
    partitions move. Per key, calls never overlap and go in offset order, across both members;
    every message is handled exactly once (the first member finishes what it took before it
    lets its partitions go, and what it had fetched ahead is read again by the new owner)."""
    topic = await topic_factory(partitions=4, prefix="pool-keys")
    markers = await topic_factory(partitions=4, prefix="pool-keys-markers")
    group = f"pool-{topic}"
    count = 1200
    await produce_keyed(kafka_bootstrap, topic, count, keys=16)
    handled: list[Handled] = []

    async def work(message: KmqMessage) -> None:
        await asyncio.sleep(0.04)

    def member(name: str) -> Running:
        consumer = pool_consumer(kafka_bootstrap, topic, markers, group, max_batch=10)
        return Running(name, consumer, handled, work, concurrency=8, ordering="key")

    async with member("first") as first:
        await eventually(lambda: len(handled) >= 50, within=60, what="the first member works")
        async with member("second") as second:
            await eventually(
                lambda: len({(c.partition, c.offset) for c in handled}) == count,
                within=120,
                what="every message handled",
            )
            assert first.consumer.assignment()
            assert second.consumer.assignment()
            await second.stop()
        await first.stop()
    assert {c.consumer for c in handled} == {"first", "second"}
    assert_key_order(handled)
    twice = [k for k, n in Counter((c.partition, c.offset) for c in handled).items() if n > 1]
    assert twice == []


async def test_up_to_concurrency_in_flight_and_stop_finishes_what_was_taken(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """Unordered, concurrency 8 over 4 partitions: 8 handlers at once (twice the partition
    count), never 9. Stopped mid-backlog, the pool finishes every message it had taken and
    gives nothing back; a new member of the group goes on from there, so that every message
    is handled once."""
    topic = await topic_factory(partitions=4, prefix="pool-bound")
    markers = await topic_factory(partitions=4, prefix="pool-bound-markers")
    group = f"pool-{topic}"
    count = 600
    await produce_keyed(kafka_bootstrap, topic, count, keys=50)
    handled: list[Handled] = []
    now = most = 0

    async def work(message: KmqMessage) -> None:
        nonlocal now, most
        now += 1
        most = max(most, now)
        try:
            await asyncio.sleep(0.02)
        finally:
            now -= 1

    def member(name: str) -> Running:
        consumer = pool_consumer(kafka_bootstrap, topic, markers, group)
        return Running(name, consumer, handled, work, concurrency=8)

    first = member("first")
    async with first:
        await eventually(lambda: len(handled) >= 150, within=60, what="the pool works")
        stats = await first.stop()
    assert most == 8
    assert stats.most_in_progress == 8
    assert stats.released == 0  # every message taken was finished
    assert stats.acked == len(handled) < count
    second = Running(
        "second",
        pool_consumer(kafka_bootstrap, topic, markers, group),
        handled,
        work,
        concurrency=8,
    )
    async with second:
        await eventually(
            lambda: len({(c.partition, c.offset) for c in handled}) == count,
            within=60,
            what="the rest handled by the next member",
        )
    assert len(handled) == count, "a message was handled twice"


async def test_a_slow_handler_keeps_its_lease_and_a_hung_one_is_retried(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    """Lease 1.5 s. One handler works for 4 s: its lease is renewed for it (RANGE_EXTENDs by
    batch), the tracker does not redeliver it, it is acked once. Another hangs: after
    ``max_processing`` (6 s) it is cancelled and retried, and its copy is handled."""
    topic = await topic_factory(partitions=2, prefix="pool-lease")
    markers = await topic_factory(partitions=4, prefix="pool-lease-markers")
    group = f"pool-{topic}"
    env = {
        "bootstrap": kafka_bootstrap,
        "database_url": sqlite_url,
        "topic": topic,
        "markers": markers,
        "group": group,
    }
    async with KmqProducer(kafka_bootstrap) as producer:
        for value in (b"slow", b"hang", b"quick-1", b"quick-2"):
            await producer.send(topic, value, partition=0)
    handled: list[Handled] = []

    async def work(message: KmqMessage) -> None:
        if message.value == b"slow":
            await asyncio.sleep(4)
        elif message.value == b"hang" and message.attempt == 1:
            await asyncio.Event().wait()

    policy = {"processing_timeout": 1.5, "max_attempts": 5, "backoff": {"initial": 0.5}}
    async with (
        running_tracker(env, default_policy=policy) as tracker,
        TopicWatcher(kafka_bootstrap, topic) as watcher,
    ):
        consumer = pool_consumer(
            kafka_bootstrap, topic, markers, group, processing_timeout=timedelta(seconds=1.5)
        )
        running = Running(
            "only", consumer, handled, work, concurrency=4, max_processing=timedelta(seconds=6)
        )
        async with running:

            def done() -> bool:
                values = [(c.offset, c.attempt) for c in handled]
                return (0, 1) in values and any(a == 2 for _, a in values)

            await eventually(done, within=60, what="the slow one and the hung one's copy")

            async def nothing_tracked() -> bool:
                return not await tracker.store.list_entries(group=group)

            await eventually(nothing_tracked, within=30, what="every message settled")
            stats = await running.stop()
        copies = [copy_identity(record) for record in await watcher.read_to_end(topic)]
    copied = Counter(identity[0] for identity in copies if identity is not None)
    # The hung one was copied once (its retry); the slow one, renewed, never.
    assert copied == {MessageId(topic, 0, 1): 1}
    assert stats.timed_out == 1
    assert stats.renewals >= 1
    # Every first delivery but the hung one was handled once; the hung one's copy once.
    assert sorted((c.offset, c.attempt) for c in handled if c.attempt == 1) == [
        (0, 1),
        (2, 1),
        (3, 1),
    ]
    assert len([c for c in handled if c.attempt == 2]) == 1
