"""Marker ingest's loop on the in-memory store, with a fake markers consumer and producer.

The same loop runs against Kafka and SQL in ``tests/integration/test_engine.py`` and the
reliability suites; here it takes milliseconds, so what ingest decides (what it applies and
when, what it parks, how far it says a partition is applied, what it tells redelivery, what it
does when fenced or when the store is away) is checked without a broker or a database.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from aiokafka.errors import KafkaError, KafkaTimeoutError
from support.engine_parts import FakeMarkersConsumer, FakeProducer, RecordingListener
from support.waiting import until

from tracker.clock import ManualClock, to_millis
from tracker.domain.entries import State
from tracker.domain.policy import ResolvedPolicy, TopicPolicy
from tracker.engine.ingest import MarkerIngest
from tracker.engine.parking import InvalidMarkerParker
from tracker.headers import INVALID_CATEGORY, INVALID_SOURCE
from tracker.ids import MessageId
from tracker.metrics import Metrics
from tracker.protocol import Marker, encode_any
from tracker.protocol_v2 import RangeMarker
from tracker.store import StoreUnavailable
from tracker.store.memory import InMemoryStore, MemoryDatabase

pytestmark = [pytest.mark.unit]

MARKERS, INVALID = "kmq-markers", "kmq-markers-invalid"
GROUP, TOPIC = "billing", "orders"
LEASE_MS = 5_000
POLICY = ResolvedPolicy(30_000, TopicPolicy().backoff, 3_600_000)


class Replica:
    """One replica's ingest: its store on a shared database, its consumer on a shared log."""

    def __init__(
        self,
        database: MemoryDatabase,
        consumer: FakeMarkersConsumer,
        clock: ManualClock,
        *,
        name: str = "a",
        window: float = 0.0,
    ) -> None:
        self.store = InMemoryStore(database)
        self.consumer = consumer
        self.producer = FakeProducer()
        self.listener = RecordingListener()
        self.metrics = Metrics()
        self.ingest = MarkerIngest(
            consumer=consumer,
            store=self.store,
            parker=InvalidMarkerParker(self.producer, INVALID, MARKERS),
            markers_topic=MARKERS,
            replica_id=name,
            policy_for=lambda _topic: POLICY,
            clock=clock,
            metrics=self.metrics,
            coalesce_window=window,
            ack_grace_ms=0,
            max_records=500,
            max_pending=10_000,
            listener=self.listener,
        )

    async def own(self, *partitions: int) -> None:
        await self.consumer.assign(self.ingest.listener(), partitions)


class Rig:
    def __init__(self, *, window: float = 0.0) -> None:
        self.clock = ManualClock()
        self.database = MemoryDatabase()
        self.log = FakeMarkersConsumer(MARKERS)
        self.a = Replica(self.database, self.log, self.clock, window=window)

    def now_ms(self) -> int:
        return to_millis(self.clock.now())

    def write(self, *markers: Marker | RangeMarker | bytes) -> None:
        for marker in markers:
            value = marker if isinstance(marker, bytes) else encode_any(marker)
            self.log.append(value, self.now_ms())


def start(offset: int) -> Marker:
    return Marker.start(GROUP, MessageId(TOPIC, 0, offset), timeout_ms=LEASE_MS)


def ack(offset: int) -> Marker:
    return Marker.ack(GROUP, MessageId(TOPIC, 0, offset))


async def test_a_start_and_its_ack_applied_together_write_nothing_but_progress() -> None:
    rig = Rig()
    await rig.a.own(0)
    rig.write(start(1), ack(1))
    assert await rig.a.ingest.poll_once() == 2
    assert await rig.a.store.count_entries() == 0
    coalesced = rig.a.metrics.markers_coalesced._value.get()
    assert coalesced == 2, "they cancelled out in the fold: nothing was written for them"
    assert await rig.a.store.partition_offsets(MARKERS) == {0: (1, 2)}
    assert rig.log.committed == {0: 2}, "the markers' own offsets follow the store"
    assert rig.a.listener.dues == [], "nothing became due"


async def test_a_start_alone_is_tracked_to_its_lease_and_redelivery_is_told() -> None:
    rig = Rig()
    await rig.a.own(0)
    written_ms = rig.now_ms()
    rig.write(start(7))
    rig.clock.advance(timedelta(seconds=1))  # applied later than written
    await rig.a.ingest.poll_once()
    [entry] = await rig.a.store.list_entries()
    assert (entry.origin_offset, entry.state) == (7, State.IN_FLIGHT)
    assert entry.due_at_ms == written_ms + LEASE_MS, "the lease counts from the marker's time"
    assert rig.a.listener.dues == [written_ms + LEASE_MS]
    assert rig.a.listener.ownership_changes == 1
    assert rig.a.listener.horizons, "having read to the end, ingest tells how far it is safe"


async def test_malformed_markers_are_parked_and_the_valid_ones_around_them_applied() -> None:
    rig = Rig()
    await rig.a.own(0)
    rig.write(b"\x00garbage", start(3), b"\xff")
    assert await rig.a.ingest.poll_once() == 3
    parked = rig.a.producer.logs[INVALID]
    assert [value for _, value, _ in parked] == [b"\x00garbage", b"\xff"], "raw bytes kept"
    assert [headers[INVALID_SOURCE] for _, _, headers in parked] == [
        f"{MARKERS}/0/0".encode(),
        f"{MARKERS}/0/2".encode(),
    ]
    assert {headers[INVALID_CATEGORY] for _, _, headers in parked} == {b"malformed"}
    [entry] = await rig.a.store.list_entries()
    assert entry.origin_offset == 3
    assert await rig.a.store.partition_offsets(MARKERS) == {0: (1, 3)}, "nothing read again"


def _invalid_counted(replica: Replica, category: str) -> float:
    value: float = replica.metrics.markers_invalid.labels(category)._value.get()
    return value


async def test_parking_overlaps_the_poll_and_no_offset_passes_an_unparked_record() -> None:
    rig = Rig(window=60.0)
    await rig.a.own(0)
    rig.a.producer.hold_acks = True  # the broker has not acknowledged the parked copy yet
    rig.write(start(1), b"\x00garbage", start(3))
    assert await rig.a.ingest.poll_once() == 3, "the poll returned with the parking in flight"
    await until(lambda: bool(rig.a.producer.held), what="the parking produce")
    draining = asyncio.create_task(rig.a.ingest.drain())
    done, _ = await asyncio.wait({draining}, timeout=0.05)
    assert not done, "the flush waits for the parked copy"
    assert await rig.a.store.count_entries() == 0, "nothing applied past an unparked record"
    assert rig.log.committed == {}
    assert _invalid_counted(rig.a, "malformed") == 0, "counted once parked, not before"
    rig.a.producer.acknowledge()
    await draining
    assert [value for _, value, _ in rig.a.producer.logs[INVALID]] == [b"\x00garbage"]
    assert sorted(e.origin_offset for e in await rig.a.store.list_entries()) == [1, 3]
    assert await rig.a.store.partition_offsets(MARKERS) == {0: (1, 3)}
    assert _invalid_counted(rig.a, "malformed") == 1


async def test_a_refused_parking_applies_nothing_past_it_and_is_parked_again() -> None:
    rig = Rig()
    await rig.a.own(0)
    rig.a.producer.hold_acks = True
    rig.write(start(1), b"\x00garbage", start(3))
    polling = asyncio.create_task(rig.a.ingest.poll_once())
    await until(lambda: bool(rig.a.producer.held), what="the parking produce")
    rig.a.producer.acknowledge(KafkaTimeoutError())
    with pytest.raises(KafkaError):
        await polling
    assert await rig.a.store.count_entries() == 0, "the valid markers wait for the parking"
    assert rig.log.committed == {}, "no offset moved past the refused record"
    assert INVALID not in rig.a.producer.logs
    # The next poll's flush parks it again, from memory: nothing dropped, nothing read twice.
    polling = asyncio.create_task(rig.a.ingest.poll_once())
    await until(lambda: bool(rig.a.producer.held), what="the parking to be tried again")
    rig.a.producer.acknowledge()
    assert await polling == 0, "nothing new was read"
    assert [value for _, value, _ in rig.a.producer.logs[INVALID]] == [b"\x00garbage"]
    assert sorted(e.origin_offset for e in await rig.a.store.list_entries()) == [1, 3]
    assert await rig.a.store.partition_offsets(MARKERS) == {0: (1, 3)}
    assert _invalid_counted(rig.a, "malformed") == 1


async def test_markers_in_the_coalescing_window_are_pending_until_flushed() -> None:
    rig = Rig(window=60.0)
    await rig.a.own(0)
    rig.write(start(4))
    await rig.a.ingest.poll_once()
    await rig.a.ingest.poll_once()  # the first poll's background flush has run by now
    key = (GROUP, TOPIC, 0, 4)
    assert rig.a.ingest.pending_keys([key]) == {key}, "redelivery must not act on it yet"
    assert await rig.a.store.count_entries() == 0, "still in the window: not applied"
    assert rig.log.committed.get(0, 0) == 0, "no offset moves past the held marker"
    await rig.a.ingest.drain()
    assert rig.a.ingest.pending_keys([key]) == set()
    assert await rig.a.store.count_entries() == 1


async def test_a_range_start_and_a_settle_with_an_exception_leave_one_offset_open() -> None:
    rig = Rig()
    await rig.a.own(0)
    rig.write(
        RangeMarker.start(GROUP, TOPIC, 0, 100, 199, timeout_ms=LEASE_MS),
        RangeMarker.settle(GROUP, TOPIC, 0, 100, 199, exceptions=1 << 50),
    )
    await rig.a.ingest.poll_once()
    [entry] = await rig.a.store.list_entries()
    assert (entry.origin_offset, entry.state) == (150, State.IN_FLIGHT)
    [kept] = await rig.a.store.list_ranges()
    assert (kept.base_offset, kept.open_count) == (150, 1), "one range, not a row per offset"
    assert rig.database.entries == {}


async def test_a_store_outage_holds_markers_back_until_the_store_is_back() -> None:
    rig = Rig()
    await rig.a.own(0)
    rig.write(start(1), start(2))
    rig.database.unavailable = True
    with pytest.raises(StoreUnavailable):
        await rig.a.ingest.poll_once()
    assert rig.log.committed == {}, "no offset moves past markers that were not applied"
    assert rig.a.ingest.pending_keys([(GROUP, TOPIC, 0, 1)]) == {(GROUP, TOPIC, 0, 1)}
    rig.database.unavailable = False
    rig.write(ack(1))
    await rig.a.ingest.poll_once()
    [entry] = await rig.a.store.list_entries()
    assert entry.origin_offset == 2, "the markers read during the outage were kept and applied"
    assert await rig.a.store.partition_offsets(MARKERS) == {0: (1, 3)}


async def test_a_fenced_replica_stops_and_the_new_owner_resumes_where_it_was_applied() -> None:
    rig = Rig()
    await rig.a.own(0)
    rig.write(start(1))
    await rig.a.ingest.poll_once()
    # Replica b takes the partition over without a's consent (a missed its revocation); the
    # group's committed offset is behind (a lost commit): the store's position is the one.
    b_log = FakeMarkersConsumer(MARKERS, logs=rig.log.logs, committed={0: 0})
    b = Replica(rig.database, b_log, rig.clock, name="b")
    await b.own(0)
    rig.write(ack(1), start(2))
    await rig.a.ingest.poll_once()
    assert rig.a.ingest.owned_epochs() == {}, "fenced: a gives the partition up"
    assert 0 in rig.log.paused, "and stops reading it"
    assert rig.a.listener.ownership_changes == 2
    assert [e.origin_offset for e in await rig.a.store.list_entries()] == [1], "a wrote nothing"
    assert await b.ingest.poll_once() == 2, "b resumed at the store's offset 1, not at 0"
    assert b.ingest.owned_epochs() == {0: 2}
    [entry] = await b.store.list_entries()
    assert entry.origin_offset == 2, "b read the markers a could not apply"
    assert await b.store.partition_offsets(MARKERS) == {0: (2, 3)}
