"""The test harness itself: broker, topics, consumer groups and both databases work.

If these fail, every other integration test would fail for reasons that have nothing to do with
kmq-tracker, so they are the first thing to look at.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from support.broker import (
    BrokerStartupError,
    LocalBroker,
    TopicFactory,
    topic_partition_ids,
    unique_topic,
)

pytestmark = [pytest.mark.integration]

# Portable group timings: Apache Kafka rejects session timeouts below 6 s by default
# (group.min.session.timeout.ms); tansu completes a join after about half the session timeout.
GROUP_SETTINGS: dict[str, Any] = {
    "session_timeout_ms": 6_000,
    "heartbeat_interval_ms": 500,
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
}
WITHIN = 30.0  # seconds; generous deadline for every wait below


async def consume(consumer: Any, count: int, within: float = WITHIN) -> list[Any]:
    """Fetch until ``count`` records arrived; fail at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    records: list[Any] = []
    while len(records) < count:
        assert loop.time() < deadline, f"only {len(records)} of {count} records arrived"
        batches = await consumer.getmany(timeout_ms=200)
        for batch in batches.values():
            records.extend(batch)
    return records


async def test_round_trip_with_keys_and_headers(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=3, prefix="harness-roundtrip")
    messages = [
        (
            f"key-{i % 6}".encode(),
            f"value-{i}".encode(),
            [("kmq-attempt", str(i).encode()), ("kmq-origin", b"t/0/1"), ("empty", b"")],
        )
        for i in range(30)
    ]
    sent: dict[tuple[int, int], tuple[bytes, bytes, list[tuple[str, bytes]]]] = {}
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all") as producer:
        for key, value, headers in messages:
            meta = await producer.send_and_wait(topic, value, key=key, headers=headers)
            sent[(meta.partition, meta.offset)] = (key, value, headers)

    partitions_by_key: defaultdict[bytes, set[int]] = defaultdict(set)
    for (partition, _), (key, _, _) in sent.items():
        partitions_by_key[key].add(partition)
    assert all(len(parts) == 1 for parts in partitions_by_key.values()), partitions_by_key
    assert len({partition for partition, _ in sent}) > 1, "keys should spread over partitions"

    async with AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap, enable_auto_commit=False
    ) as consumer:
        assert await topic_partition_ids(kafka_bootstrap, topic) == [0, 1, 2]
        tps = [TopicPartition(topic, p) for p in range(3)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records = await consume(consumer, len(messages))

    received = {(r.partition, r.offset): (r.key, r.value, list(r.headers)) for r in records}
    assert received == sent
    for partition in range(3):
        offsets = [r.offset for r in records if r.partition == partition]
        assert offsets == sorted(offsets) == list(range(len(offsets)))


async def test_group_commit_is_read_back_by_a_new_consumer(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=3, prefix="harness-group")
    group = unique_topic("harness-group")
    tps = [TopicPartition(topic, p) for p in range(3)]
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all") as producer:
        for i in range(9):
            await producer.send_and_wait(topic, b"job-%d" % i, partition=i % 3)

        async with AIOKafkaConsumer(
            topic, bootstrap_servers=kafka_bootstrap, group_id=group, **GROUP_SETTINGS
        ) as first:
            assert len(await consume(first, 9)) == 9
            await first.commit()
        # stop() left the group; the committed offsets must outlive the member.

        async with AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False
        ) as reader:
            assert {tp: await reader.committed(tp) for tp in tps} == dict.fromkeys(tps, 3)

        new = await producer.send_and_wait(topic, b"after-commit", partition=1)

    # A consumer of the group resumes at the committed offsets, not at the beginning. (It uses
    # assign(), not subscribe(): on tansu a new member joining right after the last one left
    # waits for the old member's session to expire; see docs/testing.md.)
    async with AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False
    ) as second:
        second.assign(tps)
        records = await consume(second, 1)
        assert [(r.partition, r.offset, r.value) for r in records] == [
            (1, new.offset, b"after-commit")
        ]
        assert new.offset == 3
        positions = {tp.partition: await second.position(tp) for tp in tps}
        assert positions == {0: 3, 1: 4, 2: 3}


async def test_database_answers_select_one(database_url: str) -> None:
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as connection:
            assert (await connection.execute(text("select 1"))).scalar_one() == 1
            if engine.dialect.name == "postgresql":
                name = await connection.scalar(text("select current_database()"))
                assert str(name).startswith("kmq_test_")
    finally:
        await engine.dispose()
    assert database_url.startswith(("sqlite+aiosqlite:///", "postgresql+asyncpg://"))


def test_unique_topic_names_are_legal_and_unique() -> None:
    names = {unique_topic("odd prefix/with:chars") for _ in range(100)}
    assert len(names) == 100
    assert all(re.fullmatch(r"[a-zA-Z0-9._-]{1,249}", name) for name in names)
    assert all(
        re.fullmatch(r"[a-zA-Z0-9._-]{1,249}", unique_topic(p)) for p in ("", "..", "x" * 400)
    )


def test_broker_startup_failure_reports_the_log_tail() -> None:
    broker = LocalBroker(extra_args=["--no-such-flag"], startup_timeout=10)
    with pytest.raises(BrokerStartupError, match="no-such-flag") as failure:
        broker.start()
    assert "exited with code" in str(failure.value)
    assert not broker.running
