"""tracker.kafka against a real Kafka-protocol broker: reading originals back, admin helpers.

Every assertion here must hold on tansu and on Apache Kafka alike (see docs/testing.md). Paths
that only Kafka can produce (retention moving the log start, compaction, aborted transactions,
out-of-range fetches) cannot be made on tansu; the reader's bookkeeping for them is covered by
the pure-logic tests at the end.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import OffsetOutOfRangeError
from support.broker import LocalBroker, delete_topics, free_port, unique_topic

from tracker.errors import ClientClosed
from tracker.ids import MessageId
from tracker.kafka import (
    KafkaUnavailable,
    Missing,
    OriginalRecord,
    OriginalsReader,
    OriginalsUnavailable,
    TopicMismatch,
    TopicRejected,
    ensure_topic,
    topic_partitions,
    topic_retention_ms,
    topic_timestamp_type,
)
from tracker.kafka.partition_read import PartitionRead

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]
Expected = dict[MessageId, OriginalRecord]

#: Records per explicitly built producer batch: wanted offsets land in the middle of batches.
BATCH = 37


def record_for(partition: int, index: int, base_ms: int) -> OriginalRecord:
    """A distinctive record: every field depends on the position, and some are unusual."""
    key = None if index % 11 == 0 else f"k-{partition}-{index}".encode()
    value: bytes | None = f"v-{partition}-{index}-".encode() * (1 + index % 5)
    if index % 13 == 0:
        value = None  # tombstone
    elif index % 17 == 0:
        value = b""
    headers: tuple[tuple[str, bytes], ...] = ()
    if index % 3 == 0:
        headers = (("trace", f"{partition}:{index}".encode()), ("dup", b"1"), ("dup", b"2"))
    elif index % 7 == 0:
        headers = (("empty", b""),)
    return OriginalRecord(key=key, value=value, headers=headers, timestamp_ms=base_ms + index)


async def produce(
    bootstrap: str, topic: str, partitions: int, per_partition: int, *, batch: int = BATCH
) -> Expected:
    """Write ``per_partition`` records to every partition in batches of ``batch``.

    Returns the expected record for every position (offsets come from the broker's replies).
    Explicit timestamps, a little in the past, so each record's timestamp is known exactly.
    """
    base_ms = int(time.time() * 1000) - 60_000
    expected: Expected = {}
    async with AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0) as producer:
        for partition in range(partitions):
            index = 0
            while index < per_partition:
                builder = producer.create_batch()
                in_batch: list[OriginalRecord] = []
                while index < per_partition and len(in_batch) < batch:
                    record = record_for(partition, index, base_ms)
                    appended = builder.append(
                        timestamp=record.timestamp_ms,  # milliseconds (whatever its docstring says)
                        key=record.key,
                        value=record.value,
                        headers=list(record.headers),
                    )
                    if appended is None:  # batch full (size limit)
                        break
                    in_batch.append(record)
                    index += 1
                builder.close()
                metadata = await (await producer.send_batch(builder, topic, partition=partition))
                for relative, record in enumerate(in_batch):
                    expected[MessageId(topic, partition, metadata.offset + relative)] = record
    return expected


def subset(expected: Expected, positions: Iterable[MessageId]) -> Expected:
    return {position: expected[position] for position in positions}


async def topic_listed(bootstrap: str, name: str) -> bool:
    """Whether ``name`` exists, asked with an all-topics request (which creates nothing)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        return name in await admin.list_topics()
    finally:
        await admin.close()


# --------------------------------------------------------------------------------------------
# OriginalsReader
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_gap", [0, 1, 10, 500, 100_000])
async def test_fetch_returns_exact_records_for_dense_sparse_and_mid_batch_offsets(
    kafka_bootstrap: str, topic_factory: TopicFactory, max_gap: int
) -> None:
    topic = await topic_factory(4, prefix="originals")
    per_partition = 1200
    expected = await produce(kafka_bootstrap, topic, 4, per_partition)
    rng = random.Random(max_gap)
    by_partition = {
        # dense: every record
        0: [MessageId(topic, 0, offset) for offset in range(per_partition)],
        # sparse: far apart (more than most gaps), never on a batch boundary
        1: [MessageId(topic, 1, offset) for offset in range(5, per_partition, 211)],
        # random, with runs and holes
        2: [MessageId(topic, 2, o) for o in sorted(rng.sample(range(per_partition), 300))],
        # mid-batch only, plus the very first and the very last record
        3: [MessageId(topic, 3, o) for o in (0, BATCH // 2, 3 * BATCH + 5, per_partition - 1)],
    }
    wanted = [position for positions in by_partition.values() for position in positions]
    rng.shuffle(wanted)

    async with OriginalsReader(kafka_bootstrap, max_gap=max_gap) as reader:
        first = await reader.fetch(wanted)
        # The same reader again, with another subset: no state leaks from the previous call.
        again = await reader.fetch(by_partition[2][::3] + by_partition[1])

    assert first == subset(expected, wanted)
    assert again == subset(expected, by_partition[2][::3] + by_partition[1])


async def test_fetch_many_positions_is_fast(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """10k records over 8 partitions, asked for in random order with duplicates."""
    topic = await topic_factory(8, prefix="originals-bulk")
    expected = await produce(kafka_bootstrap, topic, 8, 1250, batch=500)
    assert len(expected) == 10_000
    wanted = list(expected)
    random.Random(7).shuffle(wanted)
    wanted += wanted[:500]  # duplicates collapse into one entry each

    async with OriginalsReader(kafka_bootstrap) as reader:
        started = time.perf_counter()
        found = await reader.fetch(wanted)
        elapsed = time.perf_counter() - started
        # Every 50th record: sparse reads (seek per position) across all partitions.
        sparse = wanted[:10_000:50]
        started = time.perf_counter()
        sparse_found = await reader.fetch(sparse)
        sparse_elapsed = time.perf_counter() - started

    print(f"\n10k dense: {elapsed * 1000:.0f} ms; 200 sparse: {sparse_elapsed * 1000:.0f} ms")
    assert found == expected
    assert sparse_found == subset(expected, sparse)
    # The target is well under a second on a local broker; the bound leaves room for a busy
    # two-core CI machine and a slower real Kafka.
    assert elapsed < 5.0, f"fetching 10k originals took {elapsed:.2f}s"


async def test_missing_positions_come_back_with_reasons(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(2, prefix="originals-missing")
    expected = await produce(kafka_bootstrap, topic, 2, 40)
    absent_topic = unique_topic("originals-absent")
    present = [MessageId(topic, 0, 3), MessageId(topic, 1, 39)]
    beyond = [MessageId(topic, 0, 40), MessageId(topic, 1, 57), MessageId(topic, 1, 10**12)]
    no_partition = [MessageId(topic, 9, 0), MessageId(topic, 2, 5)]
    no_topic = [MessageId(absent_topic, 0, 0), MessageId(absent_topic, 3, 12)]
    negative = MessageId(topic, 0, -1)

    async with OriginalsReader(kafka_bootstrap, fetch_timeout=10) as reader:
        found = await reader.fetch([*present, *beyond, *no_partition, *no_topic, negative])

    assert set(found) == {*present, *beyond, *no_partition, *no_topic, negative}
    for position in present:
        assert found[position] == expected[position]
    assert found[beyond[0]] == Missing(
        "offset 40 is beyond the end of the partition (end offset 40)"
    )
    assert found[beyond[1]] == Missing(
        "offset 57 is beyond the end of the partition (end offset 40)"
    )
    assert isinstance(found[beyond[2]], Missing)
    assert found[MessageId(topic, 9, 0)] == Missing(
        f"partition 9 of topic {topic!r} does not exist"
    )
    assert found[MessageId(topic, 2, 5)] == Missing(
        f"partition 2 of topic {topic!r} does not exist"
    )
    for position in no_topic:
        assert found[position] == Missing(f"topic {absent_topic!r} does not exist")
    assert found[negative] == Missing("offset -1 is not a valid offset")
    # Asking about an absent topic must not have created it (tansu and Kafka with
    # auto.create.topics.enable would, on a metadata request naming it).
    assert not await topic_listed(kafka_bootstrap, absent_topic)


async def test_fetch_only_missing_positions_and_empty_partition(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """No readable position at all (an empty partition, beyond the end): no read, no hang."""
    topic = await topic_factory(2, prefix="originals-empty")
    await produce(kafka_bootstrap, topic, 1, 5)  # partition 1 stays empty
    async with OriginalsReader(kafka_bootstrap, fetch_timeout=5) as reader:
        started = time.perf_counter()
        found = await reader.fetch([MessageId(topic, 1, 0), MessageId(topic, 0, 5)])
        elapsed = time.perf_counter() - started
    assert found == {
        MessageId(topic, 1, 0): Missing(
            "offset 0 is beyond the end of the partition (end offset 0)"
        ),
        MessageId(topic, 0, 5): Missing(
            "offset 5 is beyond the end of the partition (end offset 5)"
        ),
    }
    assert elapsed < 2.0


async def test_records_of_the_last_batch_are_found(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """The whole partition is one producer batch: its last record, and the end right after it.

    (tansu's end_offsets() reports 1 here, the last batch's base offset + 1; the reader must
    not take that for the end.)
    """
    topic = await topic_factory(1, prefix="originals-last-batch")
    expected = await produce(kafka_bootstrap, topic, 1, 20, batch=20)
    last, after = MessageId(topic, 0, 19), MessageId(topic, 0, 20)
    async with OriginalsReader(kafka_bootstrap, fetch_timeout=10) as reader:
        assert await reader.fetch([last, after]) == {
            last: expected[last],
            after: Missing("offset 20 is beyond the end of the partition (end offset 20)"),
        }
        assert await reader.fetch([MessageId(topic, 0, 10)]) == subset(
            expected, [MessageId(topic, 0, 10)]
        )


async def test_empty_input_returns_empty_fast(kafka_bootstrap: str) -> None:
    async with OriginalsReader(kafka_bootstrap) as reader:
        started = time.perf_counter()
        assert await reader.fetch([]) == {}
        assert await reader.fetch(iter(())) == {}
        assert time.perf_counter() - started < 0.05


async def test_concurrent_fetches_are_serialized_and_correct(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(3, prefix="originals-concurrent")
    expected = await produce(kafka_bootstrap, topic, 3, 300)
    positions = sorted(expected)
    chunks = [positions[i::5] for i in range(5)]
    async with OriginalsReader(kafka_bootstrap, max_gap=3) as reader:
        results = await asyncio.gather(*(reader.fetch(chunk) for chunk in chunks))
    for chunk, found in zip(chunks, results, strict=True):
        assert found == subset(expected, chunk)


async def test_reader_lifecycle_errors(kafka_bootstrap: str) -> None:
    reader = OriginalsReader(kafka_bootstrap)
    with pytest.raises(ClientClosed):
        await reader.fetch([MessageId("t", 0, 0)])
    await reader.start()
    await reader.start()  # idempotent
    await reader.stop()
    await reader.stop()  # idempotent
    with pytest.raises(ClientClosed):
        await reader.fetch([])
    with pytest.raises(ValueError, match="group_id"):
        OriginalsReader(kafka_bootstrap, client_config={"group_id": "g"})
    with pytest.raises(ValueError, match="max_gap"):
        OriginalsReader(kafka_bootstrap, max_gap=-1)


async def test_unreachable_broker_is_unavailable_not_lost() -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    reader = OriginalsReader(nowhere, fetch_timeout=1.0)
    started = time.perf_counter()
    with pytest.raises(OriginalsUnavailable, match="cannot connect"):
        await reader.start()
    assert time.perf_counter() - started < 5.0
    with pytest.raises(ClientClosed):
        await reader.fetch([MessageId("t", 0, 0)])

    started = time.perf_counter()
    with pytest.raises(KafkaUnavailable, match="did not answer within 1s"):
        await topic_partitions(nowhere, "anything", timeout=1.0)
    with pytest.raises(KafkaUnavailable):
        await ensure_topic(nowhere, "anything", partitions=1, timeout=1.0)
    assert time.perf_counter() - started < 5.0


async def test_unresponsive_or_dead_broker_is_unavailable(tmp_path: Path) -> None:
    """A private broker (so the session's is not disturbed) first freezes, then dies.

    Frozen (SIGSTOP): connections stay open, nothing answers; the reader must give up after
    ``fetch_timeout`` and work again once the broker answers. Dead: an immediate, clean
    failure. Either way nothing is reported as Missing, and ``stop()`` returns promptly. Uses
    tansu whatever ``KAFKA_BOOTSTRAP_SERVERS`` says: the reader's deadlines are under test, not
    the broker.
    """
    async with LocalBroker(log_dir=tmp_path, stop_timeout=1.0) as broker:
        bootstrap = broker.bootstrap_servers
        topic = unique_topic("originals-gone")
        await ensure_topic(bootstrap, topic, partitions=2)
        expected = await produce(bootstrap, topic, 2, 50)
        pid = broker.pid
        assert pid is not None
        reader = OriginalsReader(bootstrap, fetch_timeout=1.0)
        await reader.start()
        try:
            assert await reader.fetch(expected) == expected

            os.kill(pid, signal.SIGSTOP)
            try:
                started = time.perf_counter()
                with pytest.raises(
                    OriginalsUnavailable, match=r"did not answer|no progress"
                ) as frozen:
                    await reader.fetch(expected)
                frozen_for = time.perf_counter() - started
                started = time.perf_counter()
                with pytest.raises(KafkaUnavailable, match="did not answer within 1s"):
                    await topic_partitions(bootstrap, topic, timeout=1.0)
                assert time.perf_counter() - started < 3.0
            finally:
                os.kill(pid, signal.SIGCONT)
            print(f"\nfrozen broker: unavailable after {frozen_for:.2f}s: {frozen.value}")
            assert 0.9 < frozen_for < 5.0
            assert await reader.fetch(expected) == expected  # recovers by itself

            await broker.astop()
            started = time.perf_counter()
            with pytest.raises(OriginalsUnavailable):
                await reader.fetch(expected)
            assert time.perf_counter() - started < 5.0
        finally:
            started = time.perf_counter()
            await reader.stop()
            assert time.perf_counter() - started < 5.0


# --------------------------------------------------------------------------------------------
# Admin helpers
# --------------------------------------------------------------------------------------------


async def test_ensure_topic_creates_once_with_configs(kafka_bootstrap: str) -> None:
    name = unique_topic("ensure")
    try:
        created = await ensure_topic(
            kafka_bootstrap,
            name,
            partitions=3,
            configs={"retention.ms": "3600000", "message.timestamp.type": "LogAppendTime"},
        )
        assert created is True
        # Ready when it returns: the partitions are there, with leaders.
        assert await topic_partitions(kafka_bootstrap, name) == 3
        assert await ensure_topic(kafka_bootstrap, name, partitions=3) is False
        # Fewer partitions than the topic has: always fine.
        assert (
            await ensure_topic(kafka_bootstrap, name, partitions=1, require_partitions=True)
            is False
        )
        # More than it has: accepted, unless required.
        assert await ensure_topic(kafka_bootstrap, name, partitions=5) is False
        with pytest.raises(TopicMismatch, match="3 partitions, fewer than the 5 required"):
            await ensure_topic(kafka_bootstrap, name, partitions=5, require_partitions=True)
        assert await topic_partitions(kafka_bootstrap, name) == 3
        # Explicitly set configs are reported by both brokers.
        assert await topic_retention_ms(kafka_bootstrap, name) == 3_600_000
        assert await topic_timestamp_type(kafka_bootstrap, name) == "LogAppendTime"
    finally:
        await delete_topics(kafka_bootstrap, [name])


async def test_ensure_topic_concurrent_calls_create_once(kafka_bootstrap: str) -> None:
    name = unique_topic("ensure-race")
    try:
        outcomes = await asyncio.gather(
            *(ensure_topic(kafka_bootstrap, name, partitions=2) for _ in range(4))
        )
        assert sorted(outcomes) == [False, False, False, True]
        assert await topic_partitions(kafka_bootstrap, name) == 2
    finally:
        await delete_topics(kafka_bootstrap, [name])


async def test_ensure_topic_rejects_bad_requests_locally(kafka_bootstrap: str) -> None:
    # tansu accepts all of these; Kafka refuses them. Checked before asking either.
    for bad in ["has space", "x" * 250, "..", ""]:
        with pytest.raises(TopicRejected):
            await ensure_topic(kafka_bootstrap, bad, partitions=1)
    with pytest.raises(TopicRejected, match="partitions"):
        await ensure_topic(kafka_bootstrap, unique_topic("zero"), partitions=0)
    with pytest.raises(TopicRejected, match="replication"):
        await ensure_topic(kafka_bootstrap, unique_topic("rf"), partitions=1, replication_factor=0)


async def test_topic_queries_on_absent_topic_do_not_create_it(kafka_bootstrap: str) -> None:
    name = unique_topic("absent")
    assert await topic_partitions(kafka_bootstrap, name) is None
    assert await topic_retention_ms(kafka_bootstrap, name) is None
    assert await topic_timestamp_type(kafka_bootstrap, name) is None
    assert await topic_partitions(kafka_bootstrap, name) is None
    assert not await topic_listed(kafka_bootstrap, name)


async def test_topic_queries_on_existing_topic(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    plain = await topic_factory(5, prefix="plain")
    infinite = await topic_factory(1, prefix="infinite", configs={"retention.ms": "-1"})
    assert await topic_partitions(kafka_bootstrap, plain) == 5
    assert await topic_retention_ms(kafka_bootstrap, infinite) == -1
    # Not set explicitly: Kafka reports its effective default, tansu reports nothing.
    retention = await topic_retention_ms(kafka_bootstrap, plain)
    assert retention is None or retention == -1 or retention > 0
    assert await topic_timestamp_type(kafka_bootstrap, plain) in (None, "CreateTime")


# --------------------------------------------------------------------------------------------
# Reader bookkeeping for what tansu cannot produce (gaps from compaction / transactions)
# --------------------------------------------------------------------------------------------


def test_partition_read_advance_records_gaps_and_next_target() -> None:
    read = PartitionRead(tp=TopicPartition("t", 0), plan=[3, 4, 10, 20, 31], begin=0, listed_end=25)
    read.wanted = set(read.plan)
    results: dict[MessageId, OriginalRecord | Missing] = {}
    read.wanted.discard(3)  # found
    assert read.advance(3, results) == 3  # nothing passed yet
    assert read.advance(11, results) == 20  # 4 and 10 passed without being returned
    assert read.gaps == [4, 10]
    assert read.seek_target(20) == 20  # below the listed end: certainly there
    read.wanted.discard(20)
    # 31 is past the listed end and no fetch told the real end yet: approach from the last
    # listed record rather than seeking past the end.
    assert read.advance(21, results) == 31
    assert read.seek_target(31) == 24
    read.high_watermark = 30
    assert read.advance(25, results) is None
    assert read.done
    assert results == {
        MessageId("t", 0, 31): Missing(
            "offset 31 is beyond the end of the partition (end offset 30)"
        )
    }
    assert read.gaps == [4, 10]


def test_partition_read_seek_target_on_empty_partition() -> None:
    read = PartitionRead(tp=TopicPartition("t", 0), plan=[0, 7], begin=0, listed_end=0)
    assert read.seek_target(7) == 0
    read = PartitionRead(tp=TopicPartition("t", 0), plan=[12], begin=12, listed_end=12)
    assert read.seek_target(12) == 12


class _FakeConsumer:
    """Just enough of AIOKafkaConsumer for the out-of-range path (Kafka-only, see module doc)."""

    def __init__(self, begin: int, end: int) -> None:
        self.begin, self.end = begin, end
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.paused: list[TopicPartition] = []

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, self.begin)

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, self.end)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    def pause(self, *tps: TopicPartition) -> None:
        self.paused.extend(tps)


async def test_out_of_range_after_retention_reclassifies_and_resumes() -> None:
    """Kafka moved the log start to 100 mid-read: 40 and 90 are gone, 150 is read from there."""
    tp = TopicPartition("t", 0)
    read = PartitionRead(tp=tp, plan=[10, 40, 90, 150], begin=0, listed_end=200)
    read.wanted = {40, 90, 150}
    read.next_index = 1  # 10 was found already
    active = {tp: read}
    positions = {tp: 40}
    results: dict[MessageId, OriginalRecord | Missing] = {}
    consumer = _FakeConsumer(begin=100, end=200)
    reader = OriginalsReader("unused:9092")
    error = OffsetOutOfRangeError({tp: 40})

    assert await reader._out_of_range(consumer, error, active, positions, results) is True
    gone = Missing("deleted by retention: log start offset is 100")
    assert results == {MessageId("t", 0, 40): gone, MessageId("t", 0, 90): gone}
    assert consumer.seeks == [(tp, 150)]
    assert positions[tp] == 150
    assert active == {tp: read}

    # Refused again although the bounds did not move: nothing settled, so no progress (the
    # read loop's deadline then ends it instead of looping forever).
    assert await reader._out_of_range(consumer, error, active, positions, results) is False

    # Everything left is gone: the partition is finished and paused.
    consumer.begin = 180
    assert await reader._out_of_range(consumer, error, active, positions, results) is True
    assert results[MessageId("t", 0, 150)] == Missing(
        "deleted by retention: log start offset is 180"
    )
    assert active == {}
    assert consumer.paused == [tp]
