"""A redelivery round's records go out as record batches: where each lands, and failures.

The copies must land where Kafka's default partitioner puts their key (an application that
relies on per-key order finds a key's copies on the key's partition), each ticket must name
the exact offset its record got (dead letters are recorded by position, and redrive reads
them back from there), and a batch the producer refuses must fail only its own records.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError
from support.broker import TopicFactory

from tracker.engine.copies import CopyBatches, Produced

pytestmark = [pytest.mark.integration]

PARTITIONS = 4


async def read_exactly(bootstrap: str, topic: str, count: int) -> dict[tuple[int, int], Any]:
    """``count`` records of ``topic`` by (partition, offset); fails after a deadline."""
    out: dict[tuple[int, int], Any] = {}
    async with AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False) as c:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        async with asyncio.timeout(30):
            while len(out) < count:
                for records in (await c.getmany(timeout_ms=500)).values():
                    out.update({(r.partition, r.offset): r for r in records})
    return out


async def test_each_record_lands_on_its_keys_partition_at_the_offset_its_ticket_names(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=PARTITIONS, prefix="copies")
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        batches = CopyBatches(producer)
        sent: list[tuple[int, bytes | None, bytes, list[tuple[str, bytes]]]] = []
        for i in range(600):  # several full batches per partition (16 KiB each)
            key = None if i % 5 == 0 else f"key-{i % 37}".encode()
            value = f"value-{i}".encode() * 10
            headers = [("kmq-origin", f"orders/0/{i}".encode())]
            sent.append((await batches.add(topic, key, value, headers), key, value, headers))
        await batches.send()
        results = {ticket: batches.result(ticket) for ticket, *_ in sent}
        assert all(isinstance(r, Produced) for r in results.values()), results

        # Where the producer itself would put each key (Kafka's default partitioner).
        expected_partition: dict[bytes, int] = {}
        for key in {k for _, k, _, _ in sent if k is not None}:
            metadata = await producer.send_and_wait(topic, b"probe", key=key)
            expected_partition[key] = metadata.partition
    finally:
        await producer.stop()

    on_broker = await read_exactly(kafka_bootstrap, topic, len(sent) + len(expected_partition))
    keyless_partitions = set()
    for ticket, key, value, headers in sent:
        produced = results[ticket]
        assert isinstance(produced, Produced)
        assert produced.topic == topic
        record = on_broker[(produced.partition, produced.offset)]
        assert (record.key, record.value) == (key, value)
        assert [(k, bytes(v)) for k, v in record.headers] == headers
        if key is None:
            keyless_partitions.add(produced.partition)
        else:
            assert produced.partition == expected_partition[key], key
    assert len(keyless_partitions) == 1, "keyless records of a round stick to one partition"


class RefusingProducer:
    """A real producer, except that queueing a batch for ``refused`` fails."""

    def __init__(self, producer: AIOKafkaProducer, refused: str) -> None:
        self._producer = producer
        self._refused = refused

    def create_batch(self) -> Any:
        return self._producer.create_batch()

    async def partitions_for(self, topic: str) -> set[int]:
        return await self._producer.partitions_for(topic)  # type: ignore[no-any-return]

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        if topic == self._refused:
            raise KafkaConnectionError("no connection to the leader")
        return await self._producer.send_batch(batch, topic, partition=partition)


async def test_a_refused_batch_fails_only_its_records(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    good = await topic_factory(partitions=PARTITIONS, prefix="copies-good")
    bad = await topic_factory(partitions=PARTITIONS, prefix="copies-bad")
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        batches = CopyBatches(RefusingProducer(producer, refused=bad))
        tickets = {
            topic: [await batches.add(topic, f"k{i}".encode(), b"v", []) for i in range(20)]
            for topic in (good, bad)
        }
        await batches.send()
    finally:
        await producer.stop()
    assert all(isinstance(batches.result(t), Produced) for t in tickets[good])
    failures = [batches.result(t) for t in tickets[bad]]
    assert all(isinstance(f, KafkaConnectionError) for f in failures), failures
