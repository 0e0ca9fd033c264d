"""Two tracker replicas on PostgreSQL: ownership moves between them, no entry is redelivered twice.

Replica A runs alone; a workload produces messages that the worker never acks on their first
delivery (so every one of them must be redelivered exactly once) and acks every copy. While
copies are being made, replica B joins the tracker group (a rebalance: A gives up half of the
markers partitions, B claims them with higher epochs); later A stops (B takes everything).

Nothing crashes, so at-least-once allows no duplicate here: each (origin, attempt) must be
republished exactly once, by exactly one replica. SQLite is single-replica, hence Postgres only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from support.broker import TopicFactory, create_topics, delete_topics, unique_topic

from tracker.client.marker_sink import KafkaMarkerSink
from tracker.engine.redelivery_rounds import TrackerEvent
from tracker.ids import MessageId
from tracker.partitioning import markers_partition
from tracker.protocol import Marker
from tracker.runtime import create_tracker

from .engine_support import TopicWatcher, eventually, high_watermarks, tracker_settings
from .workload import Ledger, Worker, copy_identity, produce_over_time

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MESSAGES = 200
MARKERS_PARTITIONS = 8
QUEUE_PARTITIONS = 8
LEASE = timedelta(seconds=2)


class Replica:
    """A Tracker plus what it did: copies it made, partitions (and epochs) it owned."""

    def __init__(self, name: str, settings_kw: dict[str, Any]) -> None:
        self.name = name
        self.redelivered: list[tuple[MessageId, int]] = []
        self.redelivered_from: list[int] = []  #: markers partition of each redelivered entry
        self.other_events: list[TrackerEvent] = []
        self.tracker = create_tracker(
            tracker_settings(**settings_kw, replica_id=name), on_event=self._event
        )
        self.owned_history: list[tuple[int, int]] = []  #: (partition, epoch) as first seen
        #: With ``hold_after`` copies made, the replica's redelivery waits for ``released``
        #: (its round is recorded; the next rounds wait for it): a test can then make
        #: something happen in the middle of a burst, whatever the machine's speed.
        self.hold_after: int | None = None
        self.released = asyncio.Event()

    async def _event(self, event: TrackerEvent) -> None:
        entry = event.entry
        origin = MessageId(entry.origin_topic, entry.origin_partition, entry.origin_offset)
        if event.kind == "redelivered" and not entry.deferred:
            self.redelivered.append((origin, entry.attempt + 1))
            self.redelivered_from.append(entry.markers_partition)
        else:
            self.other_events.append(event)
        if self.hold_after is not None and len(self.redelivered) >= self.hold_after:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.released.wait(), HOLD_AT_MOST_S)

    def owned(self) -> dict[int, int]:
        return self.tracker.ingest.owned_epochs()

    def sample(self) -> None:
        for item in sorted(self.owned().items()):
            if item not in self.owned_history:
                self.owned_history.append(item)


def covering_topic_name(prefix: str) -> str:
    """A fresh topic name whose QUEUE_PARTITIONS map onto every markers partition."""
    for _ in range(100_000):
        name = unique_topic(prefix)
        used = {markers_partition(name, p, MARKERS_PARTITIONS) for p in range(QUEUE_PARTITIONS)}
        if len(used) == MARKERS_PARTITIONS:
            return name
    raise AssertionError("no covering topic name found")


async def _sample_ownership(replicas: list[Replica], timeline: list[tuple[str, int, int]]) -> None:
    """Every 20 ms: who owns which partition at which epoch (changes only)."""
    last: dict[int, tuple[str, int]] = {}
    while True:
        for replica in replicas:
            replica.sample()
            for partition, epoch in replica.owned().items():
                if last.get(partition) != (replica.name, epoch):
                    last[partition] = (replica.name, epoch)
                    timeline.append((replica.name, partition, epoch))
        await asyncio.sleep(0.02)


async def test_two_replicas_hand_partitions_over_without_double_redelivery(
    kafka_bootstrap: str, topic_factory: TopicFactory, postgres_url: str
) -> None:
    # Markers of queue partition p go to murmur2("<topic>:<p>") % 8: with a random name, a few
    # queue partitions may all land in one replica's half. Pick a name whose QUEUE_PARTITIONS
    # cover every markers partition, so whatever the split, both replicas get work.
    topic = covering_topic_name("replicas-queue")
    await create_topics(kafka_bootstrap, {topic: QUEUE_PARTITIONS})
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="replicas-markers")
    group = unique_topic("replica-workers")
    settings_kw: dict[str, Any] = {
        "bootstrap": kafka_bootstrap,
        "database_url": postgres_url,
        "markers_topic": markers,
        "markers_partitions": MARKERS_PARTITIONS,
        "tracker_group": f"tracker-{markers}",
        "redelivery_batch": 20,
        "default_policy": {"processing_timeout": LEASE, "max_attempts": 5},
    }
    a = Replica("replica-a", settings_kw)
    b = Replica("replica-b", settings_kw)
    timeline: list[tuple[str, int, int]] = []
    sent: dict[MessageId, int] = {}
    loop = asyncio.get_running_loop()
    phases: list[str] = []
    t0 = loop.time()

    def copies_made() -> int:
        return len(a.redelivered) + len(b.redelivered)

    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(delete_topics, kafka_bootstrap, [topic])
        watcher = await stack.enter_async_context(TopicWatcher(kafka_bootstrap, topic))
        worker = await stack.enter_async_context(
            Worker(
                kafka_bootstrap,
                topic,
                group,
                markers,
                lambda m: m.attempt >= 2,  # every first delivery is dropped
                processing_timeout=LEASE,
            )
        )
        sampler = asyncio.create_task(_sample_ownership([a, b], timeline))
        stack.push_async_callback(_cancel, sampler)
        await a.tracker.start()
        stack.push_async_callback(a.tracker.close)
        await eventually(lambda: len(a.owned()) == MARKERS_PARTITIONS, what="A owns everything")
        phases.append(f"A owns all {loop.time() - t0:.1f}s")
        await worker.wait_joined()
        half = MESSAGES // 2
        producing = asyncio.create_task(
            produce_over_time(kafka_bootstrap, topic, half, batch=10, interval=0.5, sent=sent)
        )
        stack.push_async_callback(_cancel, producing)

        # B joins while A is redelivering the first half.
        await eventually(lambda: copies_made() >= 20, what="A's first copies")
        await b.tracker.start()
        stack.push_async_callback(b.tracker.close)
        await eventually(
            lambda: (
                a.owned()
                and b.owned()
                and sorted([*a.owned(), *b.owned()]) == list(range(MARKERS_PARTITIONS))
            ),
            within=40,
            what="A and B to split the markers partitions",
        )
        phases.append(f"split {loop.time() - t0:.1f}s")
        split_a, split_b = dict(a.owned()), dict(b.owned())
        before_split = len(a.redelivered)
        # The second half is produced while A and B share the partitions.
        await producing
        producing = asyncio.create_task(
            produce_over_time(
                kafka_bootstrap, topic, half, batch=10, interval=0.5, sent=sent, first=half
            )
        )
        stack.push_async_callback(_cancel, producing)
        await wait_or_explain(
            lambda: len(b.redelivered) >= 10 and len(a.redelivered) > before_split,
            [a, b],
            group,
            within=30,
            what=f"both replicas to redeliver while sharing (A had {before_split} at the split)",
        )

        # A stops (graceful: releases its partitions, leaves the group) while the last
        # messages are in flight; B takes over.
        await producing
        await a.tracker.close()
        by_b_before_takeover = len(b.redelivered)
        phases.append(f"A stopped {loop.time() - t0:.1f}s")
        await eventually(
            lambda: len(b.owned()) == MARKERS_PARTITIONS, within=40, what="B owns everything"
        )
        phases.append(f"B owns all {loop.time() - t0:.1f}s")
        await eventually(
            lambda: all(worker.acked_attempts().get(origin) for origin in sent),
            within=60,
            what="every message redelivered and acked",
        )
        phases.append(f"all acked {loop.time() - t0:.1f}s")
        await worker.stop()

        async def nothing_tracked() -> bool:
            entries = await b.tracker.store.list_entries(limit=100_000)
            return not [e for e in entries if e.group_id == group]

        await eventually(nothing_tracked, within=30, what="no tracked entries left")
        # The watcher is a consumer of its own and may be behind the worker under load: the
        # ledger is built once it has read a copy of every message the worker acked a copy of.
        await watcher.wait_for(
            lambda records: (
                {
                    identity[0]
                    for r in records
                    if r.topic == topic and (identity := copy_identity(r)) is not None
                }
                >= set(sent)
            ),
            within=30,
            what="the watcher to read every copy",
        )
        final_epochs = {
            p: epoch for p, (epoch, _) in (await b.tracker.store.partition_offsets(markers)).items()
        }
        ledger = Ledger.build(sent, await watcher.read_to_end(topic), worker)

    taken_over = [p for p in b.redelivered_from[by_b_before_takeover:] if p in split_a]
    by_replica = {a.name: Counter(a.redelivered), b.name: Counter(b.redelivered)}
    both = set(by_replica[a.name]) & set(by_replica[b.name])
    print(
        f"\n[replicas] {', '.join(phases)}; copies by A {len(a.redelivered)}, by B "
        f"{len(b.redelivered)} ({len(taken_over)} from A's partitions after A stopped); "
        f"split A={sorted(split_a.items())} B={sorted(split_b.items())}; "
        f"ownership timeline {timeline}; {ledger.summary()}"
    )
    assert len(sent) == MESSAGES
    assert a.other_events == [], "dead-lettered or lost"
    assert b.other_events == [], "dead-lettered or lost"
    # Every unacked message was republished once, as attempt 2, and acked then.
    assert sorted(o for o, attempt in ledger.copies if attempt == 2) == sorted(sent)
    assert [key for key in ledger.copies if key[1] != 2] == []
    assert ledger.never_acked() == []
    # No (origin, attempt) copy made twice, and never by both replicas.
    assert ledger.duplicates() == {}, f"duplicate copies: {ledger.duplicates()}"
    assert both == set(), f"redelivered by both replicas: {sorted(both)[:10]}"
    assert all(n == 1 for counts in by_replica.values() for n in counts.values())
    assert len(a.redelivered) + len(b.redelivered) == MESSAGES
    # The last messages were still in flight when A stopped: B redelivered those of A's half.
    assert taken_over, "B redelivered nothing from the partitions it took over from A"

    # Both replicas owned partitions; every change of owner bumped the partition's epoch.
    assert a.owned_history
    assert b.owned_history
    assert set(split_a).isdisjoint(split_b)
    # B's claim of a partition A held first came with a higher epoch.
    first_a = _first_epochs(a.owned_history)
    assert all(epoch > first_a[p] for p, epoch in split_b.items())
    per_partition: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for name, partition, epoch in timeline:
        per_partition[partition].append((name, epoch))
    for partition, owners in per_partition.items():
        epochs = [epoch for _, epoch in owners]
        assert epochs == sorted(set(epochs)), f"partition {partition}: epochs {owners}"
        assert owners[0][0] == a.name, (partition, owners)
        assert owners[-1][0] == b.name, (partition, owners)
        assert final_epochs[partition] >= epochs[-1]


async def wait_or_explain(
    condition: Callable[[], bool],
    replicas: list[Replica],
    group: str,
    *,
    within: float,
    what: str,
) -> None:
    """Wait until ``condition()``; on timeout, fail with what each replica and the store show."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        if loop.time() > deadline:
            store = replicas[0].tracker.store
            now_ms = int(time.time() * 1000)
            entries = [e for e in await store.list_entries(limit=100_000) if e.group_id == group]
            per_partition: Counter[tuple[int, str, bool]] = Counter(
                (e.markers_partition, e.state.value, (e.due_at_ms or 0) <= now_ms) for e in entries
            )
            lines = [f"timed out waiting for {what}"]
            for r in replicas:
                health = await r.tracker.health()
                lines.append(
                    f"{r.name}: {len(r.redelivered)} copies, owns {r.owned()}, "
                    f"safe_until-now {_relative(r.tracker.ingest.safe_until(), now_ms)}, "
                    f"health {health}"
                )
            lines.append(
                f"entries (markers partition, state, due): {sorted(per_partition.items())}"
            )
            markers = replicas[0].tracker.settings.markers_topic
            lines.append(f"partitions (epoch, next): {await store.partition_offsets(markers)}")
            raise AssertionError("\n".join(lines))
        await asyncio.sleep(0.1)


def _relative(safe: dict[int, int], now_ms: int) -> dict[int, int]:
    return {p: t - now_ms for p, t in sorted(safe.items())}


def _first_epochs(history: list[tuple[int, int]]) -> dict[int, int]:
    first: dict[int, int] = {}
    for partition, epoch in history:
        first.setdefault(partition, epoch)
    return first


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


BURST = 4_000  #: messages whose leases run out together
BURST_LEASE_MS = 6_000
HOLD_AT_MOST_S = 60.0  #: a held replica goes on by itself after this (a test that failed)


async def _fill_queue(bootstrap: str, topic: str, per_partition: int) -> list[MessageId]:
    """``per_partition`` records in each queue partition; their positions."""
    async with AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5) as producer:
        futures = [
            await producer.send(topic, value=b"burst-%d" % i, partition=p)
            for i in range(per_partition)
            for p in range(QUEUE_PARTITIONS)
        ]
        done = [await future for future in futures]
    return [MessageId(topic, d.partition, d.offset) for d in done]


async def test_two_replicas_share_a_burst_without_double_redelivery(
    kafka_bootstrap: str, topic_factory: TopicFactory, postgres_url: str
) -> None:
    """Mass expiry while a second replica joins: every message republished exactly once.

    Redelivery rounds overlap (the next is claimed while one is produced and recorded), so a
    rebalance in the middle of a burst finds rounds claimed but not produced and rounds
    produced but not recorded. Whatever the moment, a message must be republished once, by
    one replica: a claimed round of a partition that moved is given back, not produced.
    """
    topic = covering_topic_name("burst-queue")
    await create_topics(kafka_bootstrap, {topic: QUEUE_PARTITIONS})
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="burst-markers")
    retry = await topic_factory(partitions=QUEUE_PARTITIONS, prefix="burst-retry")
    group = unique_topic("burst-workers")
    settings_kw: dict[str, Any] = {
        "bootstrap": kafka_bootstrap,
        "database_url": postgres_url,
        "markers_topic": markers,
        "markers_partitions": MARKERS_PARTITIONS,
        "tracker_group": f"tracker-{markers}",
        "redelivery_batch": 10,  # many rounds (the burst outlasts B's join), several in flight
        "default_policy": {"retry_topic": retry, "max_attempts": 5},
    }
    a = Replica("replica-a", settings_kw)
    b = Replica("replica-b", settings_kw)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(delete_topics, kafka_bootstrap, [topic])
        positions = await _fill_queue(kafka_bootstrap, topic, BURST // QUEUE_PARTITIONS)
        watcher = await stack.enter_async_context(TopicWatcher(kafka_bootstrap, retry))
        await a.tracker.start()
        stack.push_async_callback(a.tracker.close)
        await eventually(lambda: len(a.owned()) == MARKERS_PARTITIONS, what="A owns everything")
        async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all") as producer:
            await KafkaMarkerSink(producer, markers).send_all(
                [Marker.start(group, p, timeout_ms=BURST_LEASE_MS) for p in positions]
            )
        # B joins once A is republishing: the rebalance lands in the middle of the burst. A
        # holds after its first 100 copies until B owns partitions (a rebalance takes longer
        # than A needs for the whole burst on a fast machine), its rounds in flight waiting.
        a.hold_after = 100
        stack.callback(a.released.set)
        await eventually(lambda: len(a.redelivered) >= 100, within=60, what="A's first copies")
        at_join = len(a.redelivered)
        await b.tracker.start()
        stack.push_async_callback(b.tracker.close)
        await eventually(lambda: len(b.owned()) > 0, within=60, what="B owns partitions")
        a.released.set()

        def copied() -> Counter[MessageId]:
            return Counter(
                identity[0]
                for r in watcher.records
                if (identity := copy_identity(r)) is not None and identity[1] == 2
            )

        await eventually(lambda: len(copied()) == len(positions), within=120, what="every copy")

        async def nothing_tracked() -> bool:
            """Every round recorded: no entry left that anyone could republish again."""
            entries = await a.tracker.store.list_entries(limit=100_000)
            return not [e for e in entries if e.group_id == group]

        await eventually(nothing_tracked, within=60, what="every round recorded")
        ends = await high_watermarks(kafka_bootstrap, retry)
        await watcher.wait_for(
            lambda records: all(
                any(r.partition == p and r.offset == end - 1 for r in records)
                for p, end in ends.items()
                if end > 0
            ),
            within=30,
            what="the watcher to read every copy",
        )

    counts = copied()
    twice = sorted(origin for origin, n in counts.items() if n > 1)
    both = set(a.redelivered) & set(b.redelivered)
    print(
        f"\n[replicas-burst] {len(positions)} expired together; copies by A {len(a.redelivered)} "
        f"({at_join} before B joined), by B {len(b.redelivered)}"
    )
    assert at_join < len(positions)
    assert b.redelivered, "B joined after the burst: the rebalance did not land in it"
    assert set(counts) == set(positions)
    assert twice == [], f"republished twice: {twice[:10]}"
    assert both == set(), f"republished by both replicas: {sorted(both)[:10]}"
    assert len(a.redelivered) + len(b.redelivered) == len(positions)
    assert a.other_events == [], "dead-lettered or lost"
    assert b.other_events == [], "dead-lettered or lost"
