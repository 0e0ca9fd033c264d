"""The tracker engine end to end: real broker, real SQLite and PostgreSQL stores.

Timing assertions use Kafka timestamps (marker records vs. republished copies), never sleeps:
"not before the deadline" means the copy's timestamp is at or after the marker's timestamp
plus the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from support.broker import topic_partition_ids, unique_topic
from support.counts import assert_counters_match

from tracker import headers as h
from tracker.client import KmqMessage, KmqProducer
from tracker.client.marker_sink import KafkaMarkerSink
from tracker.domain.entries import State
from tracker.engine.process import Tracker
from tracker.ids import MessageId
from tracker.protocol import Marker, MarkerKind, decode_marker, encode_marker
from tracker.runtime import create_tracker
from tracker.store.dialects import create_engine

from .engine_support import (
    Seen,
    TopicWatcher,
    consumer,
    eventually,
    high_watermarks,
    tracker_settings,
)

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def env(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> dict[str, str]:
    topic = await topic_factory(partitions=2, prefix="queue")
    return {
        "bootstrap": kafka_bootstrap,
        "database_url": database_url,
        "topic": topic,
        "markers": await topic_factory(partitions=4, prefix="markers"),
        # Unique per test: the Postgres database is shared by the whole session.
        "group": f"workers-{topic}",
    }


@contextlib.asynccontextmanager
async def running_tracker(env: dict[str, str], **overrides: Any) -> AsyncIterator[Tracker]:
    settings = tracker_settings(env["bootstrap"], env["database_url"], env["markers"], **overrides)
    async with create_tracker(settings) as tracker:
        yield tracker
    # Stopped: whatever the engine wrote, the entry counters match the entries.
    engine = create_engine(env["database_url"])
    try:
        await assert_counters_match(engine)
    finally:
        await engine.dispose()


class Worker:
    """A consumer in the background that hands each message to ``behaviour``."""

    def __init__(
        self, env: dict[str, str], behaviour: Callable[[KmqMessage], Awaitable[None]]
    ) -> None:
        self.env = env
        self.behaviour = behaviour
        self.received: list[KmqMessage] = []
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def _run(self) -> None:
        async with consumer(
            self.env["bootstrap"],
            self.env["topic"],
            self.env["group"],
            self.env["markers"],
            processing_timeout=timedelta(seconds=2),
        ) as c:
            while not self._stop.is_set():
                for message in await c.getmany(timedelta(milliseconds=200)):
                    self.received.append(message)
                    await self.behaviour(message)
            await c.flush()

    async def __aenter__(self) -> Worker:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task


async def nothing(_: KmqMessage) -> None:
    return None


def markers_for(watcher: TopicWatcher, markers: str, kind: MarkerKind) -> list[Seen]:
    # A v2 range marker counts as the v1 kind it stands for (RANGE_START = START = 1, ...).
    return [r for r in watcher.on(markers) if decode_marker(r.value).kind == kind]


def copies(watcher: TopicWatcher, topic: str) -> list[Seen]:
    return [r for r in watcher.on(topic) if r.header(h.ORIGIN) is not None]


async def test_unacked_message_is_redelivered_after_its_lease_then_dead_lettered(
    env: dict[str, str],
) -> None:
    topic, markers = env["topic"], env["markers"]
    dlq = f"{topic}.dlq"
    async with (
        running_tracker(env) as tracker,
        KmqProducer(env["bootstrap"]) as producer,
    ):
        await producer.send(topic, b"payload", key=b"k1", headers=[("trace", b"abc")])
        async with (
            TopicWatcher(env["bootstrap"], topic, markers) as watcher,
            Worker(env, nothing) as worker,
        ):
            await watcher.wait_for(lambda _: len(copies(watcher, topic)) >= 2, what="2 copies")
            await eventually(lambda: len(worker.received) >= 3, what="3 deliveries")

            async def dead_lettered() -> bool:
                rows = await tracker.store.list_dead_letters(topic=topic)
                return any(row["origin_topic"] == topic for row in rows)

            await eventually(dead_lettered, what="the dead letter")
            await watcher.wait_for(
                lambda _: len(markers_for(watcher, markers, MarkerKind.START)) >= 3,
                what="3 STARTs",
            )
        async with TopicWatcher(env["bootstrap"], dlq) as dlq_watcher:
            await dlq_watcher.wait_for(lambda r: len(r) >= 1, what="the DLQ record")
            dead = dlq_watcher.records
        dead_rows = await tracker.store.list_dead_letters(topic=topic)

    starts = markers_for(watcher, markers, MarkerKind.START)
    first, second = sorted(copies(watcher, topic), key=lambda r: r.timestamp_ms)[:2]
    origin = watcher.on(topic)[0]
    # Redelivered only after the lease (2 s) measured from the START's timestamp.
    assert first.timestamp_ms >= starts[0].timestamp_ms + 2000
    assert second.timestamp_ms >= starts[1].timestamp_ms + 2000
    for copy, attempt in ((first, b"2"), (second, b"3")):
        assert copy.header(h.ATTEMPT) == attempt
        assert copy.header(h.ORIGIN) == f"{topic}/{origin.partition}/{origin.offset}".encode()
        assert copy.header(h.GROUP) == env["group"].encode()
        assert copy.header("trace") == b"abc"
        assert (copy.key, copy.value) == (b"k1", b"payload")
    assert [m.attempt for m in worker.received[:3]] == [1, 2, 3]
    assert all(
        m.origin == MessageId(topic, origin.partition, origin.offset) for m in worker.received
    )

    [record] = dead
    assert (record.key, record.value) == (b"k1", b"payload")
    assert record.header("trace") == b"abc"
    assert record.header(h.DLQ_ATTEMPTS) == b"3"
    assert b"max attempts reached (3 of 3" in (record.header(h.DLQ_REASON) or b"")
    assert record.header(h.ORIGIN) == f"{topic}/{origin.partition}/{origin.offset}".encode()
    assert record.header(h.GROUP) == env["group"].encode()
    first_seen = int(record.header(h.DLQ_FIRST_SEEN) or 0)
    assert abs(first_seen - starts[0].timestamp_ms) < 1000
    assert int(record.header(h.DLQ_AT) or 0) >= starts[2].timestamp_ms + 2000
    assert record.header(h.DLQ_SOURCE) is not None
    assert [row["attempts"] for row in dead_rows if row["origin_topic"] == topic] == [3]


async def test_reject_dead_letters_at_once_with_the_reason(env: dict[str, str]) -> None:
    topic = env["topic"]

    async def reject(message: KmqMessage) -> None:
        await message.reject("schema violation: no id")

    async with (
        running_tracker(env, default_policy={"processing_timeout": 30, "max_attempts": 5}) as t,
        KmqProducer(env["bootstrap"]) as producer,
        TopicWatcher(env["bootstrap"], topic) as watcher,
        Worker(env, reject) as worker,
    ):
        await producer.send(topic, b"poison", key=b"p")

        async def dead_lettered() -> bool:
            rows = await t.store.list_dead_letters(topic=topic)
            return any(row["origin_topic"] == topic for row in rows)

        await eventually(dead_lettered, what="the dead letter")
    async with TopicWatcher(env["bootstrap"], f"{topic}.dlq") as dlq:
        await dlq.wait_for(lambda r: len(r) == 1, what="the DLQ record")
    [record] = dlq.records
    assert record.header(h.DLQ_REASON) == b"rejected by the consumer: schema violation: no id"
    assert record.header(h.DLQ_ATTEMPTS) == b"1"
    assert record.header(h.DLQ_LAST_ERROR) == b"schema violation: no id"
    assert (record.key, record.value) == (b"p", b"poison")
    assert copies(watcher, topic) == []
    assert len(worker.received) == 1
    # The tracker created the DLQ on first use, with the queue's partition count (it learns
    # it from the cluster, not from a consumer that never subscribed to the queue).
    assert await topic_partition_ids(env["bootstrap"], f"{topic}.dlq") == [0, 1]
    assert t.metrics.output_topic_partitions_missing.labels(f"{topic}.dlq", topic)._value.get() == 0


async def test_an_existing_dlq_with_fewer_partitions_is_used_and_reported(
    env: dict[str, str], topic_factory: TopicFactory
) -> None:
    topic = env["topic"]  # 2 partitions
    dlq = await topic_factory(partitions=1, prefix="small-dlq")

    async def reject(message: KmqMessage) -> None:
        await message.reject("no")

    async with (
        running_tracker(env, topics={topic: {"dlq_topic": dlq}}) as t,
        KmqProducer(env["bootstrap"]) as producer,
        Worker(env, reject),
        TopicWatcher(env["bootstrap"], dlq) as dead,
    ):
        await producer.send(topic, b"poison", key=b"p")
        await dead.wait_for(lambda r: len(r) == 1, what="the DLQ record")
        missing = t.metrics.output_topic_partitions_missing.labels(dlq, topic)._value.get()
    assert missing == 1
    assert await topic_partition_ids(env["bootstrap"], dlq) == [0]  # reported, not altered


async def test_extend_postpones_redelivery_to_the_new_deadline(env: dict[str, str]) -> None:
    topic, markers = env["topic"], env["markers"]
    extended: list[KmqMessage] = []

    async def extend_once(message: KmqMessage) -> None:
        if message.attempt == 1:
            await message.extend(timedelta(seconds=5), wait=True)
            extended.append(message)
        else:
            await message.ack()

    async with (
        running_tracker(env),
        KmqProducer(env["bootstrap"]) as producer,
        TopicWatcher(env["bootstrap"], topic, markers) as watcher,
        Worker(env, extend_once),
    ):
        await producer.send(topic, b"long job")
        await watcher.wait_for(lambda _: len(copies(watcher, topic)) == 1, what="the copy")
    [extend] = markers_for(watcher, markers, MarkerKind.EXTEND)
    [start] = markers_for(watcher, markers, MarkerKind.START)[:1]
    [copy] = copies(watcher, topic)
    assert copy.timestamp_ms >= extend.timestamp_ms + 5000, "redelivered before the new deadline"
    assert copy.timestamp_ms >= start.timestamp_ms + 5000


async def test_retry_with_a_delay_is_republished_when_due_not_before(env: dict[str, str]) -> None:
    topic, markers = env["topic"], env["markers"]

    async def retry_then_ack(message: KmqMessage) -> None:
        if message.attempt == 1:
            await message.retry(timedelta(seconds=3), reason="downstream busy")
        else:
            await message.ack()

    async with (
        running_tracker(env) as tracker,
        KmqProducer(env["bootstrap"]) as producer,
        TopicWatcher(env["bootstrap"], topic, markers) as watcher,
        Worker(env, retry_then_ack) as worker,
    ):
        await producer.send(topic, b"job")
        await eventually(lambda: any(m.attempt == 2 for m in worker.received), what="retry")
        await eventually(
            lambda: len(markers_for(watcher, markers, MarkerKind.ACK)) == 1, what="the ACK"
        )
        await eventually(
            lambda: _count(tracker, env["group"]), within=10, what="no tracked entries left"
        )
        await watcher.read_to_end(topic)  # the worker's copy may be a fetch ahead of the watcher
    [delay] = markers_for(watcher, markers, MarkerKind.DELAY)
    [copy] = copies(watcher, topic)
    assert copy.timestamp_ms >= delay.timestamp_ms + 3000
    assert copy.header(h.ATTEMPT) == b"2"
    assert [m.attempt for m in worker.received] == [1, 2]


async def _count(tracker: Tracker, group: str) -> bool:
    return not await tracker.store.list_entries(group=group)


async def test_delayed_message_is_handed_over_only_when_due(env: dict[str, str]) -> None:
    topic, markers = env["topic"], env["markers"]

    async def ack(message: KmqMessage) -> None:
        await message.ack()

    async with (
        running_tracker(env) as tracker,
        KmqProducer(env["bootstrap"]) as producer,
        TopicWatcher(env["bootstrap"], topic, markers) as watcher,
        Worker(env, ack) as worker,
    ):
        metadata = await producer.send(topic, b"later", delay=timedelta(seconds=4))
        await eventually(lambda: len(worker.received) == 1, within=30, what="delivery")
        handed_at = worker.received[0].timestamp
        metrics = tracker.metrics
        # Its first delivery is counted as such, not as a redelivery.
        await eventually(
            lambda: metrics.delayed_delivered.labels(topic)._value.get() == 1, what="the count"
        )
        assert metrics.redeliveries.labels(topic)._value.get() == 0
        # The worker can get the copy a fetch before the watcher does: read both to the end.
        await watcher.read_to_end(markers)
        await watcher.read_to_end(topic)
    [delay] = markers_for(watcher, markers, MarkerKind.DELAY)
    deferred = decode_marker(delay.value)
    assert isinstance(deferred, Marker)
    assert deferred.deferred
    [copy] = copies(watcher, topic)
    assert copy.timestamp_ms >= metadata.timestamp + 4000, "republished before it was due"
    assert copy.header(h.DELIVER_AT) is None
    assert copy.header(h.ATTEMPT) == b"1", "a delayed message is not a retry"
    message = worker.received[0]
    assert (message.value, message.attempt) == (b"later", 1)
    assert handed_at.timestamp() * 1000 >= metadata.timestamp + 4000


async def test_acked_messages_never_come_back_and_leave_no_entries(env: dict[str, str]) -> None:
    topic = env["topic"]

    async def ack(message: KmqMessage) -> None:
        await message.ack()

    async with running_tracker(env) as tracker:
        async with (
            KmqProducer(env["bootstrap"]) as producer,
            Worker(env, ack) as worker,
        ):
            for i in range(200):
                await producer.send_nowait(topic, f"m{i}".encode())
            await producer.flush()
            await eventually(lambda: len(worker.received) == 200, what="200 deliveries")

        # Once every marker the worker wrote (range STARTs and SETTLEs per batch) is applied,
        # nothing is left that could be redelivered ...
        written = await high_watermarks(env["bootstrap"], env["markers"])

        async def all_applied() -> bool:
            offsets = await tracker.store.partition_offsets(env["markers"])
            return all(offsets.get(p, (0, 0))[1] >= end for p, end in written.items() if end)

        await eventually(all_applied, what=f"all {sum(written.values())} markers applied")
        assert await _count(tracker, env["group"])
        coalesced = tracker.metrics.markers_coalesced._value.get()
        redelivered = tracker.metrics.redeliveries.labels(topic)._value.get()
    # ... and nothing was redelivered before that: the topic holds exactly the 200 originals.
    assert redelivered == 0
    assert await _record_count(env["bootstrap"], topic) == 200
    assert coalesced > 0, "no START/SETTLE pair was coalesced in memory"


async def _record_count(bootstrap: str, topic: str) -> int:
    """Records in ``topic``, by reading it to the high watermark of a fetch response.

    (Not ListOffsets: tansu answers it wrongly after batched produces; see docs/testing.md.)
    """
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partition_ids(bootstrap, topic)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        count = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            batch = await c.getmany(timeout_ms=200)
            count += sum(len(records) for records in batch.values())
            highwater = [c.highwater(tp) for tp in tps]
            positions = [await c.position(tp) for tp in tps]
            if None not in highwater and positions == highwater:
                return count
            assert loop.time() < deadline, "could not read the topic to its end"
    finally:
        await c.stop()


async def test_retry_without_delay_follows_the_backoff_policy(env: dict[str, str]) -> None:
    topic, markers = env["topic"], env["markers"]

    async def retry_once(message: KmqMessage) -> None:
        if message.attempt == 1:
            await message.retry()
        else:
            await message.ack()

    policy = {
        "processing_timeout": 30,
        "max_attempts": 3,
        "backoff": {"initial": 2, "multiplier": 2, "max": 60, "jitter": 0.1},
    }
    async with (
        running_tracker(env, default_policy=policy),
        KmqProducer(env["bootstrap"]) as producer,
        TopicWatcher(env["bootstrap"], topic, markers) as watcher,
        Worker(env, retry_once),
    ):
        await producer.send(topic, b"job")
        await watcher.wait_for(lambda _: len(copies(watcher, topic)) == 1, what="the copy")
    [delay] = markers_for(watcher, markers, MarkerKind.DELAY)
    policy_delay = decode_marker(delay.value)
    assert isinstance(policy_delay, Marker)
    assert policy_delay.policy_delay
    [copy] = copies(watcher, topic)
    assert copy.timestamp_ms >= delay.timestamp_ms + 1800  # 2 s -10% jitter


async def test_markers_for_missing_originals_are_recorded_as_lost(env: dict[str, str]) -> None:
    """A START for a record that is not there: when due, the entry is lost, not dropped."""

    topic, markers = env["topic"], env["markers"]
    producer = AIOKafkaProducer(bootstrap_servers=env["bootstrap"])
    await producer.start()
    sink = KafkaMarkerSink(producer, markers)
    try:
        async with running_tracker(env) as tracker:
            ghost = MessageId(topic, 0, 10_000)  # far beyond the end of the partition
            await sink.send_all([Marker.start(env["group"], ghost, timeout_ms=500)])

            async def lost() -> bool:
                entries = await tracker.store.list_entries(group=env["group"])
                return any(e.group_id == env["group"] and e.state is State.LOST for e in entries)

            await eventually(lost, what="the entry to be recorded as lost")
            entries = await tracker.store.list_entries(group=env["group"])
            [entry] = [e for e in entries if e.group_id == env["group"]]
            assert "beyond the end" in entry.reason
            assert tracker.metrics.lost.labels(topic)._value.get() == 1
    finally:
        await producer.stop()


async def test_malformed_and_unknown_markers_are_parked_while_valid_ones_work(
    env: dict[str, str],
) -> None:

    topic, markers = env["topic"], env["markers"]
    invalid = f"{markers}.invalid"
    # A fresh name: a fixed one may exist on a long-lived cluster (anything that once named it
    # in a produce or metadata request auto-created it there), and the marker would be valid.
    absent = unique_topic("no-such-topic")
    raw = AIOKafkaProducer(bootstrap_servers=env["bootstrap"])
    await raw.start()
    sink = KafkaMarkerSink(raw, markers)
    # The last: a REJECT whose reason holds U+0000, valid UTF-8 that no PostgreSQL text
    # holds (it failed every flush it was in, stalling the partition, before it was refused).
    nul = encode_marker(Marker.reject(env["group"], MessageId(topic, 0, 9), reason="aXb"))
    garbage = [b"", b"\x01", b"\x02garbage", b"\x01\x02\x00" + b"\xff" * 40]
    garbage.append(nul.replace(b"aXb", b"a\x00b"))

    async def ack(message: KmqMessage) -> None:
        await message.ack()

    try:
        async with (
            running_tracker(env) as tracker,
            KmqProducer(env["bootstrap"]) as producer,
            TopicWatcher(env["bootstrap"], topic) as watcher,
        ):
            for i, junk in enumerate(garbage * 5):
                await raw.send_and_wait(markers, junk, partition=i % 4)
            await sink.send_all([Marker.start(env["group"], MessageId(absent, 0, 1), timeout_ms=1)])
            async with Worker(env, ack) as worker:
                for i in range(50):
                    await producer.send(topic, f"ok{i}".encode())
                await eventually(lambda: len(worker.received) == 50, what="50 deliveries")
            async with TopicWatcher(env["bootstrap"], invalid) as parked:
                await parked.wait_for(lambda r: len(r) == 26, what="26 parked markers")
            assert copies(watcher, topic) == []
            assert tracker.metrics.markers_invalid.labels("malformed")._value.get() == 25
            assert tracker.metrics.markers_invalid.labels("unknown_topic")._value.get() == 1
    finally:
        await raw.stop()
    reasons = {r.header("kmq-invalid-category") for r in parked.records}
    assert reasons == {b"malformed", b"unknown_topic"}
    assert all(r.header("kmq-invalid-source") for r in parked.records)
    unknown = [r for r in parked.records if r.header("kmq-invalid-category") == b"unknown_topic"]
    assert b"does not exist" in (unknown[0].header("kmq-invalid-reason") or b"")
    with_nul = [r for r in parked.records if r.value == garbage[-1]]
    assert len(with_nul) == 5
    assert with_nul[0].header("kmq-invalid-reason") == b"reason contains a NUL character (U+0000)"
