"""Redelivery rounds against a real store and broker: what overlapping rounds must keep.

Rounds overlap (``Redeliverer.run``): a round is claimed, its copies produced, and it is
recorded in the background while the next is claimed. These tests stop the pieces at the
moments that matters for:

* killed between "copies produced" and "round recorded": the entries come back after the
  claim lease and are republished once more, with the same origin and attempt, so a consumer
  with ``dedup_window`` drops the second copy;
* the markers partition changes owner between the claim and the produce: nothing is
  produced, the entries are given back at once for the new owner;
* the store goes away for a moment while a round is recorded: the record is retried (the copies
  are out; giving up would republish them all after the claim lease);
* the store goes away while the loop looks for the next due entry: redelivery pauses and goes
  on, it does not end.

Each runs on SQLite and PostgreSQL, with the real producer and originals reader.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from support.broker import TopicFactory, unique_topic
from support.engine_parts import FixedProgress

from tracker.client.planning import SeenCopies
from tracker.clock import Clock, ManualClock, SystemClock, to_millis
from tracker.domain.entries import EntryKey
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy, TopicPolicy
from tracker.engine.redeliver import Redeliverer
from tracker.ids import MessageId
from tracker.kafka.originals import OriginalsReader
from tracker.metrics import Metrics
from tracker.protocol import Marker
from tracker.store import Store, StoreUnavailable
from tracker.store.migrate import upgrade
from tracker.store.port import PartitionProgress, PendingMarker

from .engine_support import TopicWatcher, eventually, high_watermarks
from .workload import copy_identity

pytestmark = [pytest.mark.integration]

MESSAGES = 60
LEASE = timedelta(seconds=60)
POLICY = ResolvedPolicy(
    processing_timeout_ms=30_000, backoff=BackoffPolicy(), keep_payload_after_ms=3_600_000
)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    store = Store.from_url(database_url)
    try:
        await upgrade(store.engine)
        yield store
    finally:
        await store.close()


@pytest.fixture
async def producer(kafka_bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    async with AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=2
    ) as started:
        yield started


@pytest.fixture
async def originals(kafka_bootstrap: str) -> AsyncIterator[OriginalsReader]:
    async with OriginalsReader(kafka_bootstrap) as reader:
        yield reader


class Setup:
    """A queue topic with ``MESSAGES`` records whose STARTs ran out a minute ago."""

    def __init__(self, store: Store, queue: str, markers: str, epoch: int, bootstrap: str) -> None:
        self.store = store
        self.bootstrap = bootstrap
        self.markers_offset = 0
        self.queue = queue
        self.markers = markers
        self.epochs = {0: epoch}
        self.positions: list[MessageId] = []

    @classmethod
    async def make(
        cls, store: Store, producer: AIOKafkaProducer, topic_factory: TopicFactory, bootstrap: str
    ) -> Setup:
        queue = await topic_factory(partitions=1, prefix="rounds-queue")
        markers = unique_topic("rounds-markers")
        now = int(time.time() * 1000)
        [claim] = (await store.claim_partitions(markers, [0], "replica", now)).values()
        setup = cls(store, queue, markers, claim.epoch, bootstrap)
        futures = [await producer.send(queue, value=b"m%d" % i) for i in range(MESSAGES)]
        setup.positions = [MessageId(queue, 0, (await f).offset) for f in futures]
        starts = [
            PendingMarker(Marker.start("rounds", m, timeout_ms=1_000), now - 60_000, 0, i)
            for i, m in enumerate(setup.positions)
        ]
        await store.apply(
            markers, {0: PartitionProgress(claim.epoch, len(starts))}, starts, _policy, now
        )
        setup.markers_offset = len(starts)
        return setup

    def redeliverer(
        self,
        producer: AIOKafkaProducer,
        originals: OriginalsReader,
        *,
        store: Any = None,
        clock: Clock | None = None,
        owned: Callable[[], dict[int, int]] | None = None,
        pending_keys: Callable[[Iterable[EntryKey]], set[EntryKey]] | None = None,
    ) -> Redeliverer:
        clock = clock or SystemClock()
        return Redeliverer(
            store=store or self.store,
            producer=producer,
            originals=originals,
            markers_topic=self.markers,
            progress=FixedProgress(
                owned=owned or (lambda: dict(self.epochs)),
                safe=lambda: {0: to_millis(clock.now())},
                pending=pending_keys or (lambda _keys: set()),
            ),
            policy_for=lambda _topic: TopicPolicy(max_attempts=10),
            clock=clock,
            metrics=Metrics(),
            batch=MESSAGES,
            claim_lease_ms=int(LEASE.total_seconds() * 1000),
            max_idle=1.0,
        )

    async def tracked(self) -> list[Any]:
        return [e for e in await self.store.list_entries(limit=10_000) if e.group_id == "rounds"]

    async def tracked_is_empty(self) -> bool:
        return not await self.tracked()

    async def add_due(self, count: int) -> list[MessageId]:
        """``count`` more records whose STARTs ran out a minute ago; their positions."""
        async with AIOKafkaProducer(bootstrap_servers=self.bootstrap) as producer:
            futures = [await producer.send(self.queue, value=b"n%d" % i) for i in range(count)]
            added = [MessageId(self.queue, 0, (await f).offset) for f in futures]
        now = int(time.time() * 1000)
        first = self.markers_offset
        starts = [
            PendingMarker(Marker.start("rounds", m, timeout_ms=1_000), now - 60_000, 0, first + i)
            for i, m in enumerate(added)
        ]
        self.markers_offset += len(starts)
        await self.store.apply(
            self.markers,
            {0: PartitionProgress(self.epochs[0], self.markers_offset)},
            starts,
            _policy,
            now,
        )
        return added


def _policy(_topic: str) -> ResolvedPolicy:
    return POLICY


def _copies(watcher: TopicWatcher) -> list[tuple[MessageId, int]]:
    return [i for r in watcher.records if (i := copy_identity(r)) is not None]


class StalledRecord:
    """The store, except that recording a round never finishes (the process dies there)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.recording = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def finish_redelivery(self, *args: Any, **kwargs: Any) -> None:
        self.recording.set()
        await asyncio.Event().wait()  # never: the transaction is never committed


class FlakyDueScan:
    """The store, except that its first ``failures`` looks for the next due entry fail."""

    def __init__(self, store: Store, failures: int) -> None:
        self._store = store
        self.failures = failures
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def next_due_by_partition(self, partitions: Iterable[int]) -> dict[int, int]:
        self.calls += 1
        if self.calls <= self.failures:
            raise StoreUnavailable("database error: connection refused (injected)")
        return await self._store.next_due_by_partition(partitions)


class FlakyRecord:
    """The store, except that the first ``failures`` records of a round fail."""

    def __init__(self, store: Store, failures: int) -> None:
        self._store = store
        self.failures = failures
        self.attempts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def finish_redelivery(self, *args: Any, **kwargs: Any) -> None:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise StoreUnavailable("database error: connection refused (injected)")
        await self._store.finish_redelivery(*args, **kwargs)


async def test_killed_between_produce_and_record_republishes_identical_copies(
    store: Store,
    producer: AIOKafkaProducer,
    originals: OriginalsReader,
    topic_factory: TopicFactory,
    kafka_bootstrap: str,
) -> None:
    setup = await Setup.make(store, producer, topic_factory, kafka_bootstrap)
    async with TopicWatcher(kafka_bootstrap, setup.queue) as watcher:
        stalled = StalledRecord(store)
        first = setup.redeliverer(producer, originals, store=stalled)
        stopping = asyncio.Event()
        running = asyncio.create_task(first.run(stopping))
        await asyncio.wait_for(stalled.recording.wait(), 30)
        await eventually(lambda: len(_copies(watcher)) == MESSAGES, what="the first copies")
        # The replica dies: nothing of it runs any more; its round was never recorded.
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 10)
        entries = await setup.tracked()
        assert len(entries) == MESSAGES, "the round was recorded after all"
        assert all(e.claim_token is not None for e in entries)

        # Whoever owns the partition once the claim lease ran out republishes them.
        later = ManualClock(datetime.now(UTC) + LEASE + timedelta(seconds=1))
        second = setup.redeliverer(producer, originals, clock=later)
        assert await second.run_round() == MESSAGES
        await eventually(lambda: len(_copies(watcher)) == 2 * MESSAGES, what="the second copies")
        assert await setup.tracked() == []
        assert await high_watermarks(kafka_bootstrap, setup.queue) == {0: 3 * MESSAGES}

    copies = _copies(watcher)
    assert Counter(copies) == {(position, 2): 2 for position in setup.positions}
    seen = SeenCopies(timedelta(minutes=5))
    taken = [copy for copy in copies if not seen.check_and_add(*copy)]
    assert sorted(taken) == sorted((position, 2) for position in setup.positions)


async def test_a_partition_that_moves_after_the_claim_is_given_back_not_produced(
    store: Store,
    producer: AIOKafkaProducer,
    originals: OriginalsReader,
    topic_factory: TopicFactory,
    kafka_bootstrap: str,
) -> None:
    setup = await Setup.make(store, producer, topic_factory, kafka_bootstrap)
    owned = dict(setup.epochs)

    def rebalance_after_claim(keys: Iterable[EntryKey]) -> set[EntryKey]:
        """Asked right after the claim: the partition is revoked at that moment."""
        owned.clear()
        return set()

    async with TopicWatcher(kafka_bootstrap, setup.queue) as watcher:
        moving = setup.redeliverer(
            producer, originals, owned=lambda: dict(owned), pending_keys=rebalance_after_claim
        )
        assert await moving.run_round() == 0
        entries = await setup.tracked()
        now = int(time.time() * 1000)
        assert len(entries) == MESSAGES
        assert all(e.claim_token is None for e in entries), "still claimed by the old owner"
        assert all(e.due_at_ms is not None and e.due_at_ms <= now for e in entries)

        # The new owner republishes them at once, not after the claim lease.
        owner = setup.redeliverer(producer, originals)
        assert await owner.run_round() == MESSAGES
        await eventually(lambda: len(_copies(watcher)) >= MESSAGES, what="the copies")
        # Nothing else was produced: the originals and one copy each.
        assert await high_watermarks(kafka_bootstrap, setup.queue) == {0: 2 * MESSAGES}
    assert Counter(_copies(watcher)) == {(position, 2): 1 for position in setup.positions}


async def test_a_record_through_a_short_store_outage_is_retried(
    store: Store,
    producer: AIOKafkaProducer,
    originals: OriginalsReader,
    topic_factory: TopicFactory,
    kafka_bootstrap: str,
) -> None:
    setup = await Setup.make(store, producer, topic_factory, kafka_bootstrap)
    flaky = FlakyRecord(store, failures=2)
    async with TopicWatcher(kafka_bootstrap, setup.queue) as watcher:
        rounds = setup.redeliverer(producer, originals, store=flaky)
        assert await rounds.run_round() == MESSAGES
        assert flaky.attempts == 3
        assert await setup.tracked() == []
        await eventually(lambda: len(_copies(watcher)) >= MESSAGES, what="the copies")
        assert await high_watermarks(kafka_bootstrap, setup.queue) == {0: 2 * MESSAGES}
    assert Counter(_copies(watcher)) == {(position, 2): 1 for position in setup.positions}


async def test_the_loop_survives_a_store_outage_while_it_sleeps(
    store: Store,
    producer: AIOKafkaProducer,
    originals: OriginalsReader,
    topic_factory: TopicFactory,
    kafka_bootstrap: str,
) -> None:
    setup = await Setup.make(store, producer, topic_factory, kafka_bootstrap)
    flaky = FlakyDueScan(store, failures=2)
    async with TopicWatcher(kafka_bootstrap, setup.queue) as watcher:
        loop = setup.redeliverer(producer, originals, store=flaky)
        stopping = asyncio.Event()
        running = asyncio.create_task(loop.run(stopping))
        try:
            await eventually(lambda: len(_copies(watcher)) >= MESSAGES, what="the copies")
            await eventually(lambda: flaky.calls > flaky.failures, what="the scan to recover")
            assert not running.done(), "the redelivery loop ended on a store outage"
            assert loop.last_error is not None
            assert "connection refused" in loop.last_error
            # Still working: entries that fall due now are republished too.
            await eventually(setup.tracked_is_empty, what="the first round recorded")
            more = await setup.add_due(MESSAGES)
            await eventually(lambda: len(_copies(watcher)) >= 2 * MESSAGES, what="the later copies")
        finally:
            stopping.set()
            await asyncio.wait_for(running, 30)
    assert Counter(_copies(watcher)) == {(position, 2): 1 for position in [*setup.positions, *more]}
