"""Redelivery's read ahead (``tracker.engine.read_ahead``): originals of entries past their
deadline are read while ``ack_grace`` runs, held in bounded memory, handed to the round once.

The read ahead changes when a record is read, never what a round copies: these tests check
that a round gets the same record either way, that nothing is read twice, and that what is
held stays within its bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from support.engine_parts import FakeProducer, redeliverer_without_ingest
from support.waiting import until

from tracker.clock import ManualClock, to_millis
from tracker.domain.policy import ResolvedPolicy, TopicPolicy
from tracker.domain.range_claims import range_copies
from tracker.domain.tracked_range import TrackedRange
from tracker.engine.read_ahead import HeldOriginals, ReadAhead, record_size
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.metrics import Metrics
from tracker.protocol import Marker
from tracker.store.memory import InMemoryStore
from tracker.store.port import PartitionProgress, PendingMarker
from tracker.store.store_errors import StoreUnavailable

pytestmark = [pytest.mark.unit]

MARKERS = "kmq-markers"
GROUP, TOPIC = "billing", "orders"
LEASE_MS = 1_000


def at(offset: int) -> MessageId:
    return MessageId(TOPIC, 0, offset)


def record(value: bytes) -> OriginalRecord:
    return OriginalRecord(b"k", value, (("h", b"v"),), 1)


@dataclass
class CountingOriginals:
    """Originals by position; every position asked for is written down."""

    records: dict[MessageId, OriginalRecord] = field(default_factory=dict)
    asked: list[MessageId] = field(default_factory=list)
    unavailable: bool = False
    gate: asyncio.Event | None = None  #: set: reads wait for it

    async def fetch(
        self, positions: Sequence[MessageId]
    ) -> dict[MessageId, OriginalRecord | Missing]:
        if self.gate is not None:
            await self.gate.wait()
        if self.unavailable:
            raise OriginalsUnavailable("broker away")
        self.asked += positions
        return {p: self.records.get(p, Missing("no such record")) for p in positions}


def held_originals(source: CountingOriginals, **kwargs: float) -> HeldOriginals:
    return HeldOriginals(
        source, max_bytes=int(kwargs.pop("max_bytes", 1 << 20)), metrics=Metrics(), **kwargs
    )


async def test_a_record_read_ahead_is_handed_out_once_without_a_second_read() -> None:
    source = CountingOriginals({at(1): record(b"one"), at(2): record(b"two")})
    held = held_originals(source)
    assert await held.read_ahead([at(1), at(1), at(3)]) == 1  # at(3) is missing: not held
    assert source.asked == [at(1), at(3)]
    assert held.held == 1

    got = await held.fetch([at(1), at(2), at(3)])
    assert got[at(1)] == record(b"one")
    assert got[at(2)] == record(b"two")
    assert isinstance(got[at(3)], Missing), "a missing original is the round's to record"
    assert source.asked == [at(1), at(3), at(2), at(3)], "only what was not held is read"
    assert held.held == 0
    assert held.held_bytes == 0

    await held.fetch([at(1)])
    assert source.asked[-1] == at(1), "handed out once: a second round reads it again"


async def test_what_is_held_stays_within_its_bytes_keeping_the_earliest_due() -> None:
    records = {at(i): record(bytes(100)) for i in range(10)}
    size = record_size(records[at(0)])
    source = CountingOriginals(records)
    held = held_originals(source, max_bytes=3 * size)
    await held.read_ahead([at(0), at(1)])
    assert await held.read_ahead([at(2), at(3), at(4)]) == 1, "full after the first of them"
    assert held.held == 3
    assert held.held_bytes == 3 * size
    source.asked.clear()
    assert await held.read_ahead([at(5)]) == 0
    assert source.asked == [], "nothing is read while full"
    await held.fetch([at(i) for i in range(5)])
    assert source.asked == [at(3), at(4)], "the earliest asked for were kept"
    assert await held.read_ahead([at(5)]) == 1, "rounds took what was held: room again"


async def test_a_record_no_round_takes_is_dropped_after_the_hold_time() -> None:
    source = CountingOriginals({at(1): record(b"one"), at(2): record(b"two")})
    held = held_originals(source, hold_seconds=0.0)
    await held.read_ahead([at(1)])
    assert held.held == 1
    await held.read_ahead([at(2)])  # each read ahead first drops what is past its hold
    assert held.held == 1
    assert held.held_bytes == record_size(record(b"two"))


async def test_a_broker_that_cannot_be_read_leaves_the_read_to_the_round() -> None:
    source = CountingOriginals({at(1): record(b"one")}, unavailable=True)
    held = held_originals(source)
    assert await held.read_ahead([at(1)]) == 0
    assert held.held == 0
    with pytest.raises(OriginalsUnavailable):
        await held.fetch([at(1)])  # the round sees the outage, and retries as before


async def test_a_round_waits_for_the_read_ahead_under_way_instead_of_reading_twice() -> None:
    gate = asyncio.Event()
    source = CountingOriginals({at(1): record(b"one")}, gate=gate)
    held = held_originals(source)
    reading = asyncio.create_task(held.read_ahead([at(1)]))
    await until(lambda: held._reading is not None, what="the read ahead to start")
    fetching = asyncio.create_task(held.fetch([at(1)]))
    await asyncio.sleep(0)
    assert not fetching.done()
    gate.set()
    assert await reading == 1
    assert (await fetching)[at(1)] == record(b"one")
    assert source.asked == [at(1)]


def test_due_ranges_are_expanded_only_as_far_as_the_limit_reaches() -> None:
    first = TrackedRange(GROUP, TOPIC, 0, 0, 10, 0b1011, 5, 1, 1, "c", None)  # 10, 11, 13
    wide = TrackedRange(GROUP, TOPIC, 0, 0, 100, (1 << 65_536) - 1, 6, 1, 1, "c", None)
    assert range_copies([first, wide], 4) == [(5, at(10)), (5, at(11)), (5, at(13)), (6, at(100))]
    assert range_copies([first, wide], 2) == [(5, at(10)), (5, at(11))]
    assert range_copies([first, wide], 0) == []


class Rig:
    """One owned markers partition with a START, a read ahead and a redeliverer over it."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.store = InMemoryStore()
        self.source = CountingOriginals()
        self.epochs: dict[int, int] = {}
        self.held = held_originals(self.source)
        self.read_ahead = ReadAhead(
            store=self.store,
            originals=self.held,
            owned_partitions=lambda: self.epochs,
            clock=self.clock,
            max_idle=30.0,
        )
        self.producer = FakeProducer()
        self.redeliverer = redeliverer_without_ingest(
            store=self.store,
            producer=self.producer,
            originals=self.source,
            clock=self.clock,
            epochs=lambda: self.epochs,
            max_attempts=5,
            read_ahead=self.read_ahead,
        )

    def now_ms(self) -> int:
        return to_millis(self.clock.now())

    async def start(self, offsets: Iterable[int], *, written_ms: int | None = None) -> None:
        """Ingest applies START markers for ``offsets`` (written at ``written_ms``, now if
        not given)."""
        if not self.epochs:
            claims = await self.store.claim_partitions(MARKERS, [0], "a", self.now_ms())
            self.epochs = {0: claims[0].epoch}
        policy = ResolvedPolicy(30_000, TopicPolicy().backoff, 3_600_000)
        pendings = []
        for offset in offsets:
            self.source.records[at(offset)] = record(f"v{offset}".encode())
            marker = Marker.start(GROUP, at(offset), timeout_ms=LEASE_MS)
            written = self.now_ms() if written_ms is None else written_ms
            pendings.append(PendingMarker(marker, written, 0, offset))
        await self.store.apply(
            MARKERS,
            {0: PartitionProgress(self.epochs[0], pendings[-1].markers_offset + 1)},
            pendings,
            lambda _topic: policy,
            self.now_ms(),
        )


async def test_entries_are_read_once_as_their_deadline_passes_and_the_round_copies_them() -> None:
    rig = Rig()
    await rig.start([5, 6])
    stopping = asyncio.Event()
    loop = asyncio.create_task(rig.read_ahead.run(stopping))
    try:
        await until(lambda: rig.read_ahead.looks >= 1, what="the first look")
        assert rig.source.asked == []
        assert rig.held.held == 0
        rig.clock.advance(timedelta(milliseconds=LEASE_MS))
        rig.redeliverer.notify_due(rig.now_ms())  # as ingest does: wakes the read ahead too
        await until(lambda: rig.held.held == 2, what="both originals read ahead")
        assert rig.source.asked == [at(5), at(6)]
        rig.clock.advance(timedelta(milliseconds=200))
        looks = rig.read_ahead.looks
        await until(lambda: rig.read_ahead.looks >= looks + 2, what="two more looks")
        assert rig.source.asked == [at(5), at(6)]

        assert await rig.redeliverer.run_round() == 2
        assert rig.source.asked == [at(5), at(6)], "the round read nothing itself"
        assert sorted(value or b"" for _, value, _ in rig.producer.logs[TOPIC]) == [b"v5", b"v6"]
        assert rig.held.held == 0
    finally:
        stopping.set()
        await loop


async def test_an_entry_written_already_due_is_read_ahead_at_once() -> None:
    rig = Rig()
    await rig.start([5])
    stopping = asyncio.Event()
    loop = asyncio.create_task(rig.read_ahead.run(stopping))
    try:
        await until(lambda: rig.read_ahead.looks >= 1, what="the first look")
        rig.clock.advance(timedelta(milliseconds=LEASE_MS))
        rig.redeliverer.notify_due(rig.now_ms())
        await until(lambda: rig.held.held == 1, what="the first entry read ahead")
        rig.clock.advance(timedelta(seconds=5))
        looks = rig.read_ahead.looks
        rig.redeliverer.notify_due(rig.now_ms())
        await until(lambda: rig.read_ahead.looks > looks, what="a look covering the last 5 s")
        # A START ingest reads late (a backlog): its lease ran out 4 s ago, before that look.
        written = rig.now_ms() - 5 * LEASE_MS
        await rig.start([7], written_ms=written)
        rig.redeliverer.notify_due(written + LEASE_MS)  # as ingest does after the write
        await until(lambda: rig.held.held == 2, what="the late entry read ahead")
        assert rig.source.asked == [at(5), at(7)]
    finally:
        stopping.set()
        await loop


async def test_a_look_back_the_store_could_not_answer_is_done_after_the_pause() -> None:
    """An entry written already due sends the next look back for it; if the store is away
    then, the look after the pause still goes back for it."""
    rig = Rig()
    await rig.start([5])
    lookups = rig.store.copies_falling_due
    failing = {"armed": False}

    async def away_once(*args: Any) -> Any:
        if failing["armed"]:
            failing["armed"] = False
            raise StoreUnavailable("database restarting")
        return await lookups(*args)

    rig.store.copies_falling_due = away_once  # type: ignore[method-assign,assignment]
    stopping = asyncio.Event()
    loop = asyncio.create_task(rig.read_ahead.run(stopping))
    try:
        await until(lambda: rig.read_ahead.looks >= 1, what="the first look")
        rig.clock.advance(timedelta(seconds=5))
        looks = rig.read_ahead.looks
        rig.redeliverer.notify_due(rig.now_ms())
        await until(lambda: rig.read_ahead.looks > looks, what="a look covering the last 5 s")
        assert rig.source.asked == [at(5)]
        written = rig.now_ms() - 5 * LEASE_MS
        await rig.start([7], written_ms=written)
        failing["armed"] = True
        rig.redeliverer.notify_due(written + LEASE_MS)
        await until(lambda: not failing["armed"], what="the look back refused")
        await until(lambda: rig.held.held == 2, what="the late entry read ahead after the pause")
        assert rig.source.asked == [at(5), at(7)]
    finally:
        stopping.set()
        await loop


async def test_while_rounds_claim_whole_batches_the_read_ahead_stands_aside() -> None:
    """A claim of a whole batch means a backlog: the rounds read their own originals and the
    read ahead stays off the event loop until a claim takes less."""
    rig = Rig()
    await rig.start(range(150))  # the redeliverer claims 100 at a time
    stopping = asyncio.Event()
    loop = asyncio.create_task(rig.read_ahead.run(stopping))
    try:
        await until(lambda: rig.read_ahead.looks >= 1, what="the first look")
        rig.clock.advance(timedelta(milliseconds=LEASE_MS))
        assert await rig.redeliverer.run_round() == 100
        assert rig.read_ahead.standing_aside
        looks = rig.read_ahead.looks
        rig.redeliverer.notify_due(rig.now_ms())
        await until(lambda: rig.read_ahead.looks > looks, what="a look that stands aside")
        assert rig.held.held == 0, "nothing read ahead during the backlog"
        assert await rig.redeliverer.run_round() == 50
        assert not rig.read_ahead.standing_aside, "caught up"
        assert len(rig.source.asked) == 150, "each original read once, by its round"

        await rig.start([200])
        rig.clock.advance(timedelta(milliseconds=LEASE_MS))
        rig.redeliverer.notify_due(rig.now_ms())
        await until(lambda: rig.held.held == 1, what="read ahead again once caught up")
        assert rig.source.asked[-1] == at(200)
    finally:
        stopping.set()
        await loop


async def test_partitions_taken_over_are_looked_at_at_once() -> None:
    rig = Rig()  # owns nothing yet
    stopping = asyncio.Event()
    loop = asyncio.create_task(rig.read_ahead.run(stopping))
    try:
        await until(lambda: rig.read_ahead.looks == 0 and rig.read_ahead._wake_at_ms is not None)
        await rig.start([5])  # takes partition 0 over, with an entry due in a second
        rig.clock.advance(timedelta(milliseconds=LEASE_MS))
        rig.redeliverer.notify_ownership()  # not a due time: the takeover alone wakes it
        await until(lambda: rig.held.held == 1, what="the taken-over entry read ahead")
    finally:
        stopping.set()
        await loop


async def test_a_read_ahead_that_fails_stops_redelivery_with_its_error() -> None:
    rig = Rig()
    await rig.start([5])

    async def broken(*_args: object) -> list[tuple[int, MessageId]]:
        raise RuntimeError("a bug in the read ahead")

    rig.store.copies_falling_due = broken  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError, match="a bug in the read ahead"):
        await asyncio.wait_for(rig.redeliverer.run(asyncio.Event()), 5)
