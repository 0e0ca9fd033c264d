"""Producing a redelivery round's records as record batches.

A round produces up to ``redelivery_batch`` copies and dead letters. One
``AIOKafkaProducer.send`` per record cost about a quarter of a round's CPU in the burst
profile (a future and an accumulator append each); appending to one ``BatchBuilder`` per
target partition and queueing each full batch with ``send_batch`` costs a fraction of that,
and the broker receives the same batches.

Partitions are chosen as the producer would: keyed records by the murmur2 hash of the key
over all the topic's partitions (Kafka's default partitioner, so a copy lands where the
application's own producer puts that key), keyless records on one partition per topic and
round, picked at random (Kafka's sticky partitioning, per round).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from tracker.domain.value_records import value_record

_partitioner = DefaultPartitioner()


@dataclass(slots=True)
class _Batch:
    topic: str
    partition: int
    builder: Any
    future: asyncio.Future[Any] | None = None  #: set once queued
    outcome: Any = None  #: the batch's RecordMetadata or exception, once sent


@value_record
class Produced:
    """Where a record went."""

    topic: str
    partition: int
    offset: int


@dataclass(slots=True)
class CopyBatches:
    """Records of one round, grouped into record batches per target partition.

    ``add`` returns a ticket; after ``send``, ``result(ticket)`` is the record's
    :class:`Produced` position or the exception that failed its batch.
    """

    producer: Any
    _open: dict[tuple[str, int], _Batch] = field(default_factory=dict)
    _batches: list[_Batch] = field(default_factory=list)
    _tickets: list[tuple[_Batch, int]] = field(default_factory=list)
    _partitions: dict[str, list[int]] = field(default_factory=dict)
    _sticky: dict[str, int] = field(default_factory=dict)

    async def add(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[Any]
    ) -> int:
        """Queue one record; raises ``KafkaError`` if the topic's partitions are unknown."""
        partition = await self._partition(topic, key)
        batch = self._open.get((topic, partition))
        if batch is None:
            batch = self._new(topic, partition)
        appended = batch.builder.append(key=key, value=value, timestamp=None, headers=headers)
        if appended is None:  # full: queue it, start the next one
            await self._queue(batch)
            batch = self._new(topic, partition)
            appended = batch.builder.append(key=key, value=value, timestamp=None, headers=headers)
            if appended is None:
                raise MessageSizeTooLargeError(f"a record for {topic} does not fit in a batch")
        self._tickets.append((batch, appended.offset))
        return len(self._tickets) - 1

    async def send(self) -> None:
        """Queue the open batches and wait for every batch's acknowledgement (or failure)."""
        await self.queue()
        await self.wait()

    async def queue(self) -> None:
        """Hand the open batches to the producer (they go out without waiting for ``wait``)."""
        for batch in list(self._open.values()):
            await self._queue(batch)

    async def wait(self) -> None:
        """Wait for every queued batch's acknowledgement or failure."""
        queued = [(b, b.future) for b in self._batches if b.future is not None]
        outcomes = await asyncio.gather(*(f for _, f in queued), return_exceptions=True)
        for (batch, _), outcome in zip(queued, outcomes, strict=True):
            batch.outcome = outcome

    def failure(self, ticket: int) -> BaseException | None:
        """What failed the record's batch, or None if the broker took it (no position built:
        a copy's position is only kept for a dead letter)."""
        outcome = self._tickets[ticket][0].outcome
        if outcome is None:
            return RuntimeError("the record's batch was not sent")
        return outcome if isinstance(outcome, BaseException) else None

    def result(self, ticket: int) -> Produced | BaseException:
        batch, relative = self._tickets[ticket]
        outcome = batch.outcome
        if outcome is None:
            return RuntimeError("the record's batch was not sent")
        if isinstance(outcome, BaseException):
            return outcome
        return Produced(batch.topic, batch.partition, outcome.offset + relative)

    def _new(self, topic: str, partition: int) -> _Batch:
        batch = _Batch(topic, partition, self.producer.create_batch())
        self._open[(topic, partition)] = batch
        self._batches.append(batch)
        return batch

    async def _queue(self, batch: _Batch) -> None:
        """Hand a batch to the producer; if it refuses, the batch's records fail (retried)."""
        self._open.pop((batch.topic, batch.partition), None)
        batch.builder.close()
        try:
            batch.future = await self.producer.send_batch(
                batch.builder, batch.topic, partition=batch.partition
            )
        except KafkaError as exc:
            batch.outcome = exc

    async def _partition(self, topic: str, key: bytes | None) -> int:
        partitions = self._partitions.get(topic)
        if partitions is None:
            partitions = self._partitions[topic] = sorted(await self.producer.partitions_for(topic))
        if key is not None:
            return int(_partitioner(key, partitions, partitions))
        sticky = self._sticky.get(topic)
        if sticky is None:
            sticky = self._sticky[topic] = random.choice(partitions)  # noqa: S311 - not crypto
        return sticky
