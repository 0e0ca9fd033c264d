"""Redelivery's decisions on the in-memory store, with a fake producer and fake originals.

The same rounds run against Kafka and SQL in ``tests/integration/test_redelivery_rounds.py``;
here they take milliseconds, so the engine's logic (next attempt, dead letter after the last
one, lost originals, what is recorded) is checked without a broker or a database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from aiokafka.errors import KafkaTimeoutError
from support.engine_parts import FakeProducer, redeliverer_without_ingest

from tracker import headers as h
from tracker.clock import ManualClock, to_millis
from tracker.domain.entries import EntryKey, State
from tracker.domain.policy import ResolvedPolicy, TopicPolicy
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord
from tracker.metrics import Metrics
from tracker.protocol import Marker, RangeMarker
from tracker.store.memory import InMemoryStore
from tracker.store.port import PartitionProgress, PendingMarker

pytestmark = [pytest.mark.unit]

MARKERS = "kmq-markers"
GROUP, TOPIC = "billing", "orders"
LEASE_MS = 1_000


@dataclass
class FakeOriginals:
    records: dict[MessageId, OriginalRecord | Missing] = field(default_factory=dict)

    async def fetch(
        self, positions: Sequence[MessageId]
    ) -> dict[MessageId, OriginalRecord | Missing]:
        return {p: self.records.get(p, Missing("no such record")) for p in positions}


class Rig:
    """One owned markers partition, a store, and a redeliverer acting on it."""

    def __init__(self, max_attempts: int = 5) -> None:
        self.clock = ManualClock()
        self.store = InMemoryStore()
        self.producer = FakeProducer()
        self.originals = FakeOriginals()
        self.epochs: dict[int, int] = {}
        self.pending: set[EntryKey] = set()  #: keys with markers in the coalescing window
        self.markers_offset = 0
        self.metrics = Metrics()
        self.redeliverer = redeliverer_without_ingest(
            store=self.store,
            producer=self.producer,
            originals=self.originals,
            clock=self.clock,
            epochs=lambda: self.epochs,
            max_attempts=max_attempts,
            pending=lambda keys: {k for k in keys if k in self.pending},
            metrics=self.metrics,
        )

    def now_ms(self) -> int:
        return to_millis(self.clock.now())

    async def start(self, offset: int, *, attempt: int = 1) -> MessageId:
        """A START for ``orders/0/offset``, whose original is readable."""
        if not self.epochs:
            claims = await self.store.claim_partitions(MARKERS, [0], "a", self.now_ms())
            self.epochs = {0: claims[0].epoch}
        at = MessageId(TOPIC, 0, offset)
        self.originals.records[at] = OriginalRecord(b"k", b"v", (("app", b"1"),), self.now_ms())
        marker = Marker.start(GROUP, at, attempt=attempt, timeout_ms=LEASE_MS)
        policy = ResolvedPolicy(30_000, TopicPolicy().backoff, 3_600_000)
        await self.store.apply(
            MARKERS,
            {0: PartitionProgress(self.epochs[0], offset + 1)},
            [PendingMarker(marker, self.now_ms(), 0, offset)],
            lambda _topic: policy,
            self.now_ms(),
        )
        return at

    async def start_range(
        self, first: int, last: int, headers: tuple[tuple[str, bytes | None], ...] = ()
    ) -> list[MessageId]:
        """A RANGE_START of ``orders/0/first..last``, whose originals are readable."""
        if not self.epochs:
            claims = await self.store.claim_partitions(MARKERS, [0], "a", self.now_ms())
            self.epochs = {0: claims[0].epoch}
        positions = [MessageId(TOPIC, 0, offset) for offset in range(first, last + 1)]
        for at in positions:
            value = b"v%d" % at.offset
            self.originals.records[at] = OriginalRecord(b"k", value, headers, self.now_ms())
        marker = RangeMarker.start(GROUP, TOPIC, 0, first, last, timeout_ms=LEASE_MS)
        policy = ResolvedPolicy(30_000, TopicPolicy().backoff, 3_600_000)
        self.markers_offset += 1
        await self.store.apply(
            MARKERS,
            {0: PartitionProgress(self.epochs[0], self.markers_offset)},
            [PendingMarker(marker, self.now_ms(), 0, self.markers_offset - 1)],
            lambda _topic: policy,
            self.now_ms(),
        )
        return positions


async def test_an_expired_lease_is_redelivered_as_the_next_attempt() -> None:
    rig = Rig()
    await rig.start(7)
    assert await rig.redeliverer.run_round() == 0, "nothing is due before the lease ends"
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    assert await rig.redeliverer.run_round() == 1
    [(key, value, headers)] = rig.producer.logs[TOPIC]
    assert (key, value) == (b"k", b"v")
    assert headers[h.ATTEMPT] == b"2"
    assert headers[h.ORIGIN] == b"orders/0/7"
    assert headers[h.GROUP] == GROUP.encode()
    assert headers["app"] == b"1"
    assert await rig.store.count_entries() == 0, "the copy's own START will track it"


async def test_the_last_attempt_goes_to_the_dead_letter_topic_and_is_recorded() -> None:
    rig = Rig(max_attempts=3)
    await rig.start(8, attempt=3)
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    assert await rig.redeliverer.run_round() == 1
    assert TOPIC not in rig.producer.logs
    [(_, _, headers)] = rig.producer.logs[f"{TOPIC}.dlq"]
    assert headers[h.DLQ_ATTEMPTS] == b"3"
    assert b"max attempts reached" in (headers[h.DLQ_REASON] or b"")
    [dead] = await rig.store.list_dead_letters()
    assert (dead["origin_offset"], dead["dlq_topic"], dead["attempts"]) == (8, "orders.dlq", 3)
    assert await rig.store.count_entries() == 0


async def test_an_unreadable_original_is_kept_as_lost_with_its_reason() -> None:
    rig = Rig()
    at = await rig.start(9)
    rig.originals.records[at] = Missing("deleted by retention: log start offset is 100")
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    assert await rig.redeliverer.run_round() == 1
    assert rig.producer.logs == {}
    [entry] = await rig.store.list_entries()
    assert entry.state is State.LOST
    assert "deleted by retention" in entry.reason
    assert entry.due_at_ms is None, "a lost entry is never due again"


async def test_an_expired_range_is_copied_as_per_message_entries_are() -> None:
    rig = Rig()
    # Originals that are themselves copies: their kmq headers are replaced, and an earlier
    # first sighting they carry is kept.
    carried = (("app", b"1"), (h.ATTEMPT, b"9"), (h.FIRST_SEEN, b"1000"))
    await rig.start_range(10, 14, headers=carried)
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    assert await rig.redeliverer.run_round() == 5
    copies = rig.producer.logs[TOPIC]
    assert [(key, value) for key, value, _ in copies] == [(b"k", b"v%d" % o) for o in range(10, 15)]
    for offset, (_, _, headers) in zip(range(10, 15), copies, strict=True):
        assert headers == {
            "app": b"1",
            h.ORIGIN: b"orders/0/%d" % offset,
            h.GROUP: GROUP.encode(),
            h.FIRST_SEEN: b"1000",
            h.ATTEMPT: b"2",
        }
    assert await rig.store.count_entries() == 0, "the copies' own STARTs will track them"
    assert await rig.store.list_ranges() == []


async def test_a_range_copy_and_an_entry_copy_carry_the_same_headers() -> None:
    rig = Rig()
    await rig.start(3)
    rig.markers_offset = 4
    await rig.start_range(4, 4, headers=(("app", b"1"),))
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    assert await rig.redeliverer.run_round() == 2
    by_origin = {hs[h.ORIGIN]: hs for _, _, hs in rig.producer.logs[TOPIC]}
    entry_copy, range_copy = by_origin[b"orders/0/3"], by_origin[b"orders/0/4"]
    assert {**entry_copy, h.ORIGIN: b""} == {**range_copy, h.ORIGIN: b""}


async def test_a_range_offset_whose_original_is_gone_is_lost_alone() -> None:
    rig = Rig()
    await rig.start_range(20, 24)
    rig.originals.records[MessageId(TOPIC, 0, 22)] = Missing("deleted by retention: log start")
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    assert await rig.redeliverer.run_round() == 5
    origins = [hs[h.ORIGIN] for _, _, hs in rig.producer.logs[TOPIC]]
    assert origins == [b"orders/0/%d" % o for o in (20, 21, 23, 24)]
    [entry] = await rig.store.list_entries()
    assert (entry.origin_offset, entry.state, entry.due_at_ms) == (22, State.LOST, None)
    assert entry.reason == "original orders/0/22 unreadable: deleted by retention: log start"
    assert await rig.store.list_ranges() == []


async def test_a_range_on_a_topic_of_one_delivery_is_dead_lettered_message_by_message() -> None:
    rig = Rig(max_attempts=1)
    await rig.start_range(30, 32)
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    assert await rig.redeliverer.run_round() == 3
    assert TOPIC not in rig.producer.logs
    dead = await rig.store.list_dead_letters()
    assert [(d["origin_offset"], d["attempts"], d["dlq_topic"]) for d in dead] == [
        (30, 1, "orders.dlq"),
        (31, 1, "orders.dlq"),
        (32, 1, "orders.dlq"),
    ]
    assert len(rig.producer.logs["orders.dlq"]) == 3
    assert await rig.store.count_entries() == 0


@pytest.mark.parametrize("waiting", [{41}, {40, 44}], ids=["inside", "at-both-ends"])
async def test_range_offsets_with_markers_pending_wait_for_them_alone(waiting: set[int]) -> None:
    rig = Rig()
    await rig.start_range(40, 44)
    rig.pending = {(GROUP, TOPIC, 0, o) for o in waiting}  # their SETTLE, say, not applied yet
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    now = rig.now_ms()
    assert await rig.redeliverer.run_round() == 5 - len(waiting)
    origins = [hs[h.ORIGIN] for _, _, hs in rig.producer.logs[TOPIC]]
    assert origins == [b"orders/0/%d" % o for o in range(40, 45) if o not in waiting]
    entries = await rig.store.list_entries()
    assert [e.origin_offset for e in entries] == sorted(waiting)
    for entry in entries:
        assert (entry.state, entry.claim_token) == (State.IN_FLIGHT, None)
        assert entry.due_at_ms is not None
        assert entry.due_at_ms >= now + 100, "looked at again once its markers are applied"
    assert rig.metrics.redeliveries.labels(TOPIC)._value.get() == 5 - len(waiting)


async def test_a_range_whose_copies_the_broker_refuses_is_put_back_whole() -> None:
    rig = Rig()
    rig.producer.hold_acks = True
    await rig.start_range(50, 53)
    rig.clock.advance(timedelta(milliseconds=LEASE_MS + 1))
    now = rig.now_ms()
    round_ = asyncio.create_task(rig.redeliverer.run_round())
    for _ in range(100):  # the round queues its batch, then waits for the broker
        if rig.producer.held:
            break
        await asyncio.sleep(0)
    assert rig.producer.acknowledge(KafkaTimeoutError()) == 1
    assert await round_ == 4
    entries = await rig.store.list_entries()
    assert [e.origin_offset for e in entries] == [50, 51, 52, 53]
    for entry in entries:
        assert (entry.state, entry.attempt, entry.claim_token) == (State.IN_FLIGHT, 1, None)
        assert entry.due_at_ms == now + 5_000, "tried again later, not lost"
    assert await rig.store.list_ranges() == []
