"""The consumer client and producer helper against a real Kafka-protocol broker."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from support.broker import unique_topic

from tracker.client import KmqConsumer, KmqMessage, KmqProducer
from tracker.clock import ManualClock
from tracker.errors import InvalidDelay, InvalidHeader, MarkerWriteFailed
from tracker.headers import KmqHeaders
from tracker.ids import MessageId
from tracker.kafka.topic_admin import topic_partitions
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import MarkerKind
from tracker.protocol_v2 import RangeKind, RangeMarker
from tracker.testing import InMemoryMarkerSink

from .markers_reader import committed_offset, read_markers

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]


async def collect(
    consumer: KmqConsumer, count: int, within: timedelta = timedelta(seconds=30)
) -> list[KmqMessage]:
    """Fetch until ``count`` messages were handed over, or fail at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within.total_seconds()
    out: list[KmqMessage] = []
    while len(out) < count:
        assert loop.time() < deadline, f"only {len(out)} of {count} messages arrived"
        out.extend(await consumer.getmany(timedelta(milliseconds=200)))
    return out


async def produce(bootstrap: str, topic: str, values: list[bytes], **kwargs: object) -> None:
    async with KmqProducer(bootstrap) as producer:
        for value in values:
            await producer.send(topic, value, **kwargs)  # type: ignore[arg-type]


def consumer_for(bootstrap: str, topic: str, markers: str, **kwargs: object) -> KmqConsumer:
    group = kwargs.pop("group_id", f"group-{topic}")
    # Short sessions make group joins quick (tansu takes about half the session timeout to
    # complete a join; Apache Kafka has group.initial.rebalance.delay.ms=3s).
    kwargs.setdefault(
        "consumer_config", {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}
    )
    # These tests read the per-message markers back: protocol v1 unless they say otherwise
    # (v2 is parametrized in some of them and in test_mixed_versions.py).
    kwargs.setdefault("marker_version", 1)
    return KmqConsumer(
        topic,
        group_id=str(group),
        bootstrap_servers=bootstrap,
        markers_topic=markers,
        consumer_id="test-consumer",
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("version", [1, 2])
async def test_start_is_on_the_broker_and_offset_committed_before_the_app_sees_it(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path, version: int
) -> None:
    """Kill the consumer (SIGKILL) after it received messages and before it acked any.

    v1: one START per message; v2: RANGE_STARTs covering exactly the messages received (the
    batch prepared ahead finds nothing more to fetch)."""
    topic = await topic_factory(partitions=3)
    markers = await topic_factory(partitions=4)
    group = f"crash-{topic}"
    await produce(kafka_bootstrap, topic, [f"job-{i}".encode() for i in range(30)])

    script = Path(__file__).with_name("crash_consumer.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    log_path = tmp_path / "consumer.log"
    with log_path.open("w") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            kafka_bootstrap,
            topic,
            group,
            markers,
            "30",
            str(version),
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
            env=env,
        )
    received: list[tuple[int, int]] = []
    try:
        assert proc.stdout is not None
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, f"consumer exited early: {log_path.read_text()}"
            if line.startswith("RECEIVED"):
                _, part, off = line.split()
                received.append((int(part), int(off)))
            if line.startswith("ALL"):
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 30)

    assert len(received) == 30
    if version == 1:
        found = await read_markers(kafka_bootstrap, markers, at_least=30)
        starts = [r.single for r in found if r.single.kind is MarkerKind.START]
        assert len(found) == len(starts) == 30, "exactly one START per message, nothing else"
        assert sorted((m.partition, m.offset) for m in starts) == sorted(received)
        assert all(m.group == group and m.timeout_ms == 30_000 for m in starts)
        assert all(m.consumer == "crash-consumer" for m in starts)
    else:
        found = await read_markers(kafka_bootstrap, markers, at_least=3)
        ranges = [r.marker for r in found]
        assert all(
            isinstance(m, RangeMarker) and m.kind is RangeKind.RANGE_START for m in ranges
        ), "nothing but RANGE_STARTs (no message was settled)"
        covered = sorted(
            (m.partition, o) for m in ranges if isinstance(m, RangeMarker) for o in m.offsets()
        )
        assert covered == sorted(received), "the ranges cover exactly what the app received"
        assert all(
            isinstance(m, RangeMarker)
            and (m.group, m.timeout_ms, m.consumer) == (group, 30_000, "crash-consumer")
            for m in ranges
        )
    for partition in range(3):
        offsets = [o for p, o in received if p == partition]
        committed = await committed_offset(kafka_bootstrap, group, topic, partition)
        if version == 1:
            assert committed is not None
            assert committed > max(offsets), "committed past every handed-over message"
        else:
            # v2 commits after the STARTs are acknowledged without holding the hand-over for
            # it: a kill may come first. What was not committed is covered (checked above).
            assert committed is None or committed <= max(offsets) + 1


async def test_verbs_write_the_right_markers_with_the_right_fields(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=1)
    markers = await topic_factory(partitions=3)
    await produce(kafka_bootstrap, topic, [b"ack", b"retry", b"retry-policy", b"extend", b"bad"])
    async with consumer_for(kafka_bootstrap, topic, markers) as consumer:
        messages = {m.value: m for m in await collect(consumer, 5)}
        await messages[b"ack"].ack()
        await messages[b"retry"].retry(timedelta(seconds=45), reason="db busy")
        await messages[b"retry-policy"].retry()
        await messages[b"extend"].extend(timedelta(minutes=10))
        await messages[b"extend"].ack()
        await messages[b"bad"].reject("schema violation")
        await consumer.flush()

    found = await read_markers(kafka_bootstrap, markers, at_least=11)
    assert len(found) == 11
    by_offset: dict[int, list[MarkerKind]] = collections.defaultdict(list)
    for record in found:
        by_offset[record.single.offset].append(record.single.kind)
        assert record.key == marker_key(topic, 0)
        assert record.partition == markers_partition(topic, 0, 3)
        assert record.single.group == f"group-{topic}"
        assert record.single.origin == record.single.message
    offset = {m.value: m.offset for m in messages.values()}
    assert by_offset[offset[b"ack"]] == [MarkerKind.START, MarkerKind.ACK]
    assert by_offset[offset[b"extend"]] == [MarkerKind.START, MarkerKind.EXTEND, MarkerKind.ACK]
    assert by_offset[offset[b"bad"]] == [MarkerKind.START, MarkerKind.REJECT]
    last = {r.single.offset: r.single for r in found}
    assert (last[offset[b"retry"]].delay_ms, last[offset[b"retry"]].reason) == (45_000, "db busy")
    assert last[offset[b"retry-policy"]].policy_delay
    assert last[offset[b"bad"]].reason == "schema violation"
    extend = next(r.single for r in found if r.single.kind is MarkerKind.EXTEND)
    assert extend.timeout_ms == 600_000


async def test_markers_of_one_message_stay_in_order_on_one_partition_across_topics(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """Two queue topics share one markers topic; each message's markers keep their order."""
    topic_a = await topic_factory(partitions=4)
    topic_b = await topic_factory(partitions=4)
    markers = await topic_factory(partitions=5)
    per_topic = 40
    async with KmqProducer(kafka_bootstrap) as producer:
        for i in range(per_topic):
            await producer.send(topic_a, f"a{i}".encode(), partition=i % 4)
            await producer.send(topic_b, f"b{i}".encode(), partition=i % 4)

    async def work(topic: str) -> None:
        async with consumer_for(kafka_bootstrap, topic, markers) as consumer:
            for message in await collect(consumer, per_topic):
                # Queued (no wait) and waited-for writes mixed: the waited one must not
                # overtake the ones queued before it.
                for n in range(3):
                    await message.extend(timedelta(seconds=60), wait=n == 1)
                await message.ack()
            await consumer.flush()

    await asyncio.gather(work(topic_a), work(topic_b))
    found = await read_markers(kafka_bootstrap, markers, at_least=2 * per_topic * 5)
    assert len(found) == 2 * per_topic * 5
    sequences: dict[MessageId, list[MarkerKind]] = collections.defaultdict(list)
    partitions: dict[MessageId, set[int]] = collections.defaultdict(set)
    for record in found:  # sorted by (partition, offset): the order the tracker reads them
        sequences[record.single.origin].append(record.single.kind)
        partitions[record.single.origin].add(record.partition)
    expected = [MarkerKind.START, *[MarkerKind.EXTEND] * 3, MarkerKind.ACK]
    assert len(sequences) == 2 * per_topic
    assert all(seq == expected for seq in sequences.values())
    for origin, used in partitions.items():
        assert used == {markers_partition(origin.topic, origin.partition, 5)}


async def test_a_delayed_message_is_not_handed_over_early(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=1)
    markers = await topic_factory(partitions=2)
    async with KmqProducer(kafka_bootstrap) as producer:
        sent_at = datetime.now(UTC)
        await producer.send(topic, b"later", delay=timedelta(minutes=30))
        await producer.send(topic, b"now")
    async with consumer_for(kafka_bootstrap, topic, markers) as consumer:
        handed = await collect(consumer, 1)
        assert [m.value for m in handed] == [b"now"], "the delayed message was handed over"
        assert consumer.deferred == 1
        await handed[0].ack()
        await consumer.flush()
    assert await committed_offset(kafka_bootstrap, f"group-{topic}", topic, 0) == 2

    found = await read_markers(kafka_bootstrap, markers, at_least=3)
    kinds = {r.single.offset: [] for r in found}  # type: dict[int, list[MarkerKind]]
    for r in found:
        kinds[r.single.offset].append(r.single.kind)
    assert kinds == {0: [MarkerKind.DELAY], 1: [MarkerKind.START, MarkerKind.ACK]}
    delay = next(r for r in found if r.single.kind is MarkerKind.DELAY)
    assert delay.single.reason == "deliver-at"
    # Relative to the marker's timestamp, the due time is ~30 minutes after the send.
    due_ms = delay.timestamp_ms + delay.single.delay_ms
    expected_ms = (sent_at + timedelta(minutes=30)).timestamp() * 1000
    assert abs(due_ms - expected_ms) < 5_000


async def test_a_delayed_message_read_after_its_due_time_is_handed_over(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=1)
    markers = await topic_factory(partitions=1)
    # A producer whose clock reads an hour ago: its 30-minute delay is already over now.
    an_hour_ago = ManualClock(datetime.now(UTC) - timedelta(hours=1))
    async with KmqProducer(kafka_bootstrap, clock=an_hour_ago) as producer:
        await producer.send(topic, b"was-delayed", delay=timedelta(minutes=30))
    async with consumer_for(kafka_bootstrap, topic, markers) as consumer:
        [message] = await collect(consumer, 1)
        assert message.value == b"was-delayed"
        assert consumer.deferred == 0
        assert message.header("kmq-deliver-at") is not None


async def test_redelivered_copies_expose_origin_attempt_key_headers_and_skip_other_groups(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=1)
    markers = await topic_factory(partitions=2)
    group = f"group-{topic}"
    origin = MessageId(topic, 0, 0)
    mine = KmqHeaders(origin=origin, attempt=3, group=group).to_headers()
    theirs = KmqHeaders(origin=origin, attempt=2, group="someone-else").to_headers()
    raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await raw.start()
    try:
        await raw.send_and_wait(topic, b"first", key=b"k1", headers=[("trace", b"x")])
        await raw.send_and_wait(topic, b"copy-theirs", key=b"k1", headers=theirs)
        await raw.send_and_wait(topic, b"copy-mine", key=b"k1", headers=[("trace", b"x"), *mine])
    finally:
        await raw.stop()
    async with consumer_for(kafka_bootstrap, topic, markers, group_id=group) as consumer:
        first, copy = await collect(consumer, 2)
        for message in (first, copy):
            await message.ack()
        await consumer.flush()
        assert consumer.skipped == 1
    assert (first.attempt, first.origin, first.is_redelivery) == (1, first.id, False)
    assert (copy.value, copy.attempt, copy.origin, copy.is_redelivery) == (
        b"copy-mine",
        3,
        origin,
        True,
    )
    assert copy.key == b"k1"
    assert copy.headers == (("trace", b"x"),)
    found = await read_markers(kafka_bootstrap, markers, at_least=4)
    assert len(found) == 4, "no marker is written for another group's copy"
    copy_markers = [r.single for r in found if r.single.offset == copy.offset]
    assert all(m.origin == origin and m.attempt == 3 for m in copy_markers)
    assert len({r.partition for r in found}) == 1, "copy and origin markers share a partition"


async def test_exact_duplicate_copies_are_dropped_when_dedup_is_on(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=1)
    markers = await topic_factory(partitions=1)
    headers = KmqHeaders(origin=MessageId(topic, 0, 0), attempt=2).to_headers()
    raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await raw.start()
    try:
        await raw.send_and_wait(topic, b"original")
        for _ in range(3):  # the tracker crashed twice before recording the copy as done
            await raw.send_and_wait(topic, b"copy", headers=headers)
        await raw.send_and_wait(topic, b"tail")
    finally:
        await raw.stop()
    async with consumer_for(
        kafka_bootstrap, topic, markers, dedup_window=timedelta(minutes=5)
    ) as consumer:
        messages = await collect(consumer, 3)
        assert [m.value for m in messages] == [b"original", b"copy", b"tail"]
        assert consumer.skipped == 2
        assert await consumer.getmany(timedelta(milliseconds=300)) == []


async def test_a_revoked_partitions_prefetched_batches_are_not_handed_over(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """A v2 consumer fetches ahead; a second member joins and takes a partition. What the
    first had fetched ahead of the rebalance is not handed to its application (the new owner
    reads the revoked partition from the committed offset, the first consumer its own), and
    every message is still processed."""
    topic = await topic_factory(partitions=2)
    markers = await topic_factory(partitions=2)
    per_partition = 60  # 6 batches each: both partitions are in what is fetched ahead
    async with KmqProducer(kafka_bootstrap) as producer:
        for p in range(2):
            for i in range(per_partition):
                await producer.send_nowait(topic, f"{p}-{i}".encode(), partition=p)
    group = f"prefetch-{topic}"
    first = consumer_for(
        kafka_bootstrap, topic, markers, group_id=group, marker_version=2, max_batch=10
    )  # small batches: many of them are prefetched
    processed: dict[str, list[tuple[int, int]]] = {"first": [], "second": []}
    loop = asyncio.get_running_loop()
    async with first:
        # A fast application: the pipeline measures it and fetches ahead.
        for _ in range(3):
            batch: Sequence[KmqMessage] = await collect(first, 1)
            processed["first"] += [(m.partition, m.offset) for m in batch]
            await first.ack_all()
        pipeline = first._ranges._pipeline
        assert pipeline is not None
        deadline = loop.time() + 30
        # Setup: everything not handed over yet waits in the pipeline, fetched ahead.
        while pipeline._queued < 2 * per_partition - len(processed["first"]):
            assert loop.time() < deadline, "the pipeline did not fetch ahead"
            await asyncio.sleep(0.01)
        second = consumer_for(kafka_bootstrap, topic, markers, group_id=group, marker_version=2)
        async with second:
            deadline = loop.time() + 60
            while len(first.assignment()) != 1 or len(second.assignment()) != 1:
                assert loop.time() < deadline, "the group did not rebalance"
                batch = await second.getmany(timedelta(milliseconds=100))
                processed["second"] += [(m.partition, m.offset) for m in batch]
                await second.ack_all()
            ((kept,),) = [{tp.partition for tp in first.assignment()}]
            total = 2 * per_partition
            deadline = loop.time() + 60
            # Until every message is processed and the first consumer has taken everything it
            # had fetched ahead (handed over or, for the revoked partition, dropped).
            while (
                len(set(processed["first"]) | set(processed["second"])) < total or pipeline._queued
            ):
                assert loop.time() < deadline, "not every message was processed"
                for name, consumer in (("first", first), ("second", second)):
                    batch = await consumer.getmany(timedelta(milliseconds=50))
                    if name == "first":
                        assert {m.partition for m in batch} <= {kept}, (
                            "a prefetched batch of a revoked partition was handed over"
                        )
                    processed[name] += [(m.partition, m.offset) for m in batch]
                    await consumer.ack_all()
    everything = {(p, o) for p in range(2) for o in range(per_partition)}
    assert set(processed["first"]) | set(processed["second"]) == everything


@pytest.mark.parametrize("version", [1, 2])
async def test_unacknowledged_markers_mean_no_hand_over_and_no_commit(
    kafka_bootstrap: str, topic_factory: TopicFactory, version: int
) -> None:
    """If the START markers cannot be written, the batch is neither committed nor handed over,
    and it is read again once markers can be written."""
    topic = await topic_factory(partitions=1)
    await produce(kafka_bootstrap, topic, [b"m0", b"m1", b"m2"])
    sink = InMemoryMarkerSink()
    sink.fail = True
    group = f"failing-{topic}"
    consumer = KmqConsumer(
        topic,
        group_id=group,
        bootstrap_servers=kafka_bootstrap,
        marker_sink=sink,
        marker_version=version,
        consumer_id="c-1",
    )
    async with consumer:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            assert loop.time() < deadline, "the batch never arrived"
            try:
                got = await consumer.getmany(timedelta(milliseconds=200))
            except MarkerWriteFailed:
                break
            assert got == []
        assert await committed_offset(kafka_bootstrap, group, topic, 0) is None
        sink.fail = False
        messages = await collect(consumer, 3)
        assert [m.value for m in messages] == [b"m0", b"m1", b"m2"]
        if version == 1:
            assert [m.kind for m in sink.markers] == [MarkerKind.START] * 3
        else:
            assert sink.markers == [RangeMarker.start(group, topic, 0, 0, 2, consumer="c-1")]
    assert await committed_offset(kafka_bootstrap, group, topic, 0) == 3


async def test_producer_refuses_bad_delays_and_reserved_headers(kafka_bootstrap: str) -> None:
    async with KmqProducer(kafka_bootstrap) as producer:
        with pytest.raises(InvalidDelay, match="naive"):
            await producer.send("t", b"x", deliver_at=datetime(2030, 1, 1))  # noqa: DTZ001
        with pytest.raises(InvalidDelay, match="positive"):
            await producer.send("t", b"x", delay=timedelta(seconds=-1))
        with pytest.raises(InvalidHeader, match="reserved prefix"):
            await producer.send("t", b"x", headers=[("kmq-attempt", b"9")])


async def test_a_missing_markers_topic_is_an_error_and_is_not_created(
    kafka_bootstrap: str, topic_factory: Callable[..., Awaitable[str]]
) -> None:
    """A consumer started before the tracker must not auto-create the markers topic: the
    broker would give it ``num.partitions`` and CreateTime, not what the tracker asks for."""
    topic = await topic_factory(partitions=1)
    markers = unique_topic("no-markers-yet")
    with pytest.raises(MarkerWriteFailed, match="does not exist: start the tracker first"):
        async with consumer_for(kafka_bootstrap, topic, markers):
            pass
    assert await topic_partitions(kafka_bootstrap, markers) is None
