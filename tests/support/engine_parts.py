"""Stand-ins for what one engine loop talks to, for tests that run it on its own in
milliseconds: the engine's internal signals, aiokafka's producer, and the markers consumer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from tracker.clock import ManualClock, to_millis
from tracker.domain.entries import EntryKey
from tracker.domain.policy import TopicPolicy
from tracker.engine.read_ahead import ReadAhead
from tracker.engine.redeliver import Redeliverer
from tracker.metrics import Metrics
from tracker.ports import OriginalsSource
from tracker.store.port import TrackerStore


def _nothing_pending(_keys: Iterable[EntryKey]) -> set[EntryKey]:
    return set()


@dataclass
class FixedProgress:
    """An ``IngestProgress`` whose answers the test gives (redelivery without ingest)."""

    owned: Callable[[], dict[int, int]]
    safe: Callable[[], dict[int, int]]
    pending: Callable[[Iterable[EntryKey]], set[EntryKey]] = _nothing_pending

    def owned_epochs(self) -> dict[int, int]:
        return self.owned()

    def safe_until(self) -> dict[int, int]:
        return self.safe()

    def pending_keys(self, keys: Iterable[EntryKey]) -> set[EntryKey]:
        return self.pending(keys)


@dataclass
class RecordingListener:
    """An ``IngestListener`` that writes down what ingest told it."""

    dues: list[int] = field(default_factory=list)
    horizons: list[int] = field(default_factory=list)
    ownership_changes: int = 0

    def due(self, due_ms: int) -> None:
        self.dues.append(due_ms)

    def caught_up(self, safe_ms: int) -> None:
        self.horizons.append(safe_ms)

    def ownership_changed(self) -> None:
        self.ownership_changes += 1


@dataclass
class _Batch:
    records: list[tuple[bytes | None, bytes | None, list[Any]]] = field(default_factory=list)

    def append(
        self, *, key: bytes | None, value: bytes | None, timestamp: None, headers: list[Any]
    ) -> SimpleNamespace:
        self.records.append((key, value, headers))
        return SimpleNamespace(offset=len(self.records) - 1)

    def close(self) -> None:
        pass


@dataclass
class FakeProducer:
    """What redelivery asks of aiokafka's producer: partitions, batches, sends.

    With ``hold_acks`` set, a batch sent is acknowledged (or refused) only when the test calls
    :meth:`acknowledge`: what the caller does while a produce is in flight can be checked.
    """

    logs: dict[str, list[tuple[bytes | None, bytes | None, dict[str, bytes | None]]]] = field(
        default_factory=dict
    )
    hold_acks: bool = False
    held: list[tuple[str, _Batch, asyncio.Future[Any]]] = field(default_factory=list)

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    def create_batch(self) -> _Batch:
        return _Batch()

    async def send_batch(self, batch: _Batch, topic: str, *, partition: int) -> asyncio.Future[Any]:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.hold_acks:
            self.held.append((topic, batch, done))
        else:
            self._write(topic, batch, done)
        return done

    def acknowledge(self, error: BaseException | None = None) -> int:
        """Settle the held batches: written and acknowledged, or refused with ``error``."""
        held, self.held = self.held, []
        for topic, batch, done in held:
            if error is None:
                self._write(topic, batch, done)
            else:
                done.set_exception(error)
        return len(held)

    def _write(self, topic: str, batch: _Batch, done: asyncio.Future[Any]) -> None:
        log = self.logs.setdefault(topic, [])
        done.set_result(SimpleNamespace(offset=len(log)))
        log += [(key, value, dict(hs)) for key, value, hs in batch.records]

    async def send(
        self, topic: str, *, value: bytes | None, headers: list[Any], key: bytes | None = None
    ) -> asyncio.Future[Any]:
        batch = self.create_batch()
        batch.append(key=key, value=value, timestamp=None, headers=headers)
        return await self.send_batch(batch, topic, partition=0)


@dataclass
class FakeMarkersConsumer:
    """What ingest asks of aiokafka's consumer, over an in-memory markers log.

    Records are appended with :meth:`append`; :meth:`assign` and :meth:`revoke` play the
    group's rebalances through ingest's listener. Paused partitions are not fetched.
    """

    topic: str
    partitions: int = 1
    logs: dict[int, list[SimpleNamespace]] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)  #: the assigned partitions
    paused: set[int] = field(default_factory=set)
    committed: dict[int, int] = field(default_factory=dict)
    polled_at: dict[int, float] = field(default_factory=dict)

    def append(self, value: bytes, timestamp_ms: int, partition: int = 0) -> int:
        log = self.logs.setdefault(partition, [])
        log.append(
            SimpleNamespace(
                topic=self.topic,
                partition=partition,
                offset=len(log),
                key=None,
                value=value,
                timestamp=timestamp_ms,
                headers=(),
            )
        )
        return len(log) - 1

    async def assign(self, listener: Any, partitions: Iterable[int]) -> None:
        tps = set()
        for p in partitions:
            self.positions[p] = self.committed.get(p, 0)
            tps.add(TopicPartition(self.topic, p))
        await listener.on_partitions_assigned(tps)

    async def revoke(self, listener: Any, partitions: Iterable[int]) -> None:
        tps = {TopicPartition(self.topic, p) for p in partitions}
        await listener.on_partitions_revoked(tps)
        for tp in tps:
            self.positions.pop(tp.partition, None)

    async def getmany(
        self, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[SimpleNamespace]]:
        await asyncio.sleep(0)  # a fetch lets the loop run, as a real one does
        fetched: dict[TopicPartition, list[SimpleNamespace]] = {}
        for p, position in self.positions.items():
            if p in self.paused:
                continue
            log = self.logs.get(p, [])
            end = len(log) if max_records is None else min(len(log), position + max_records)
            self.polled_at[p] = time.time() * 1000
            if end > position:
                fetched[TopicPartition(self.topic, p)] = log[position:end]
                self.positions[p] = end
        return fetched

    def pause(self, *tps: TopicPartition) -> None:
        self.paused |= {tp.partition for tp in tps}

    def resume(self, *tps: TopicPartition) -> None:
        self.paused -= {tp.partition for tp in tps}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp.partition] = offset

    def highwater(self, tp: TopicPartition) -> int | None:
        """The log's end as of the last fetch (None before any, as aiokafka answers)."""
        if tp.partition not in self.polled_at:
            return None
        return len(self.logs.get(tp.partition, []))

    def last_poll_timestamp(self, tp: TopicPartition) -> float | None:
        return self.polled_at.get(tp.partition)

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp.partition]

    async def commit(self, offsets: dict[TopicPartition, Any]) -> None:
        self.committed.update({tp.partition: meta.offset for tp, meta in offsets.items()})

    def partitions_for_topic(self, topic: str) -> set[int]:
        return set(range(self.partitions)) if topic == self.topic else set()

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(self.topic, p) for p in self.positions}


def redeliverer_without_ingest(
    *,
    store: TrackerStore,
    producer: Any,
    originals: OriginalsSource,
    clock: ManualClock,
    epochs: Callable[[], dict[int, int]],
    max_attempts: int,
    read_ahead: ReadAhead | None = None,
    pending: Callable[[Iterable[EntryKey]], set[EntryKey]] = _nothing_pending,
    metrics: Metrics | None = None,
) -> Redeliverer:
    """A redeliverer over markers partition 0 whose safe horizon is the clock (no ingest):
    every entry due by the test's clock may be acted on. ``pending``: the keys with markers
    in a coalescing window, as ingest would answer."""
    policy = TopicPolicy(max_attempts=max_attempts)
    return Redeliverer(
        store=store,
        producer=producer,
        originals=originals,
        markers_topic="kmq-markers",
        progress=FixedProgress(
            owned=lambda: dict(epochs()), safe=lambda: {0: to_millis(clock.now())}, pending=pending
        ),
        policy_for=lambda _topic: policy,
        clock=clock,
        metrics=metrics or Metrics(),
        batch=100,
        claim_lease_ms=30_000,
        max_idle=1.0,
        read_ahead=read_ahead,
    )
