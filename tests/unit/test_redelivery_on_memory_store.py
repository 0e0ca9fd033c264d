"""Redelivery's decisions on the in-memory store, with a fake producer and fake originals.

The same rounds run against Kafka and SQL in ``tests/integration/test_redelivery_rounds.py``;
here they take milliseconds, so the engine's logic (next attempt, dead letter after the last
one, lost originals, what is recorded) is checked without a broker or a database.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from support.engine_parts import FakeProducer, redeliverer_without_ingest

from tracker import headers as h
from tracker.clock import ManualClock, to_millis
from tracker.domain.entries import State
from tracker.domain.policy import ResolvedPolicy, TopicPolicy
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord
from tracker.protocol import Marker
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
        self.redeliverer = redeliverer_without_ingest(
            store=self.store,
            producer=self.producer,
            originals=self.originals,
            clock=self.clock,
            epochs=lambda: self.epochs,
            max_attempts=max_attempts,
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
