"""The client's protocol v2 planning, hand-over and settling, without a broker.

A fetched partition batch becomes ranges and *runs* (``plan_ranges``), the runs become
messages (``MessageBatch``), acks become bytes and then RANGE_SETTLEs (``RangeBook``). The fast
path (a batch of consecutive first deliveries, planned without a look at each record) and the
general one (gaps, copies, other groups' copies, delayed messages) must hand over and cover
exactly the same messages: what is handed over is what a START covers, what is acked is what a
SETTLE covers, nothing more.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.records import RECORDS_AT, FakeRecord

from tracker.client.message import KmqMessage, MessageContext
from tracker.client.message_batch import MessageBatch, each_once
from tracker.client.open_ranges import OPEN, RangeBook
from tracker.client.planning import plan_ranges
from tracker.errors import AlreadySettled
from tracker.headers import KmqHeaders
from tracker.ids import MessageId
from tracker.protocol import Marker, MarkerKind
from tracker.protocol_v2 import RangeKind, RangeMarker
from tracker.testing import InMemoryMarkerSink

pytestmark = pytest.mark.unit

NOW = RECORDS_AT
GROUP = "billing"

#: What a fetched record is, for the client: a first delivery (with or without application
#: headers), a copy for this group, a copy for another group, a delayed message not due yet.
KINDS = ("first", "first-with-headers", "copy", "other-group", "deferred")


def _record(offset: int, kind: str) -> FakeRecord:
    origin = MessageId("orders", 9, offset)
    headers: list[tuple[str, bytes]] = {
        "first": [],
        "first-with-headers": [("trace-id", b"abc")],
        "copy": KmqHeaders(origin, 2, GROUP).to_headers(),
        "other-group": KmqHeaders(origin, 2, "shipping").to_headers(),
        "deferred": KmqHeaders(deliver_at=NOW + timedelta(minutes=5)).to_headers(),
    }[kind]
    return FakeRecord("orders", 3, offset, headers)


def _plan(records: list[FakeRecord]):  # type: ignore[no-untyped-def]
    return plan_ranges(records, group=GROUP, consumer_id="c1", timeout_ms=5000, now=NOW)


def _context() -> tuple[InMemoryMarkerSink, RangeBook, MessageContext]:
    sink = InMemoryMarkerSink()
    book = RangeBook(sink.send_later)
    return sink, book, MessageContext(GROUP, sink, book)


def _covered(marker: RangeMarker) -> set[int]:
    return set(marker.offsets())


def test_a_batch_of_consecutive_first_deliveries_is_one_range_and_one_run() -> None:
    records = [_record(100 + i, "first") for i in range(500)]
    plan = _plan(records)
    [opened] = plan.ranges
    assert (opened.first, opened.last) == (100, 599)
    assert set(opened.flags) == {OPEN}
    [(in_range, run, origin, attempt)] = plan.deliver
    assert (in_range, run, origin, attempt) == (opened, records, None, 1)
    start = opened.start("c1", 5000)
    assert start.kind is RangeKind.RANGE_START
    assert start.exceptions == 0
    assert plan.markers == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(min_value=1, max_value=3), st.sampled_from(KINDS)),
        min_size=1,
        max_size=80,
    )
)
def test_what_is_handed_over_is_exactly_what_is_covered(spec: list[tuple[int, str]]) -> None:
    offset, records, kinds = 1_000, [], {}
    for gap, kind in spec:
        offset += gap
        records.append(_record(offset, kind))
        kinds[offset] = kind
    plan = _plan(records)
    _, _, context = _context()
    loose: list[KmqMessage] = []
    messages = MessageBatch(plan.deliver, context, loose)

    handed = [o for o, kind in kinds.items() if kind in ("first", "first-with-headers", "copy")]
    firsts = {o for o, kind in kinds.items() if kind.startswith("first")}
    copies = [o for o, kind in kinds.items() if kind == "copy"]
    assert [m.offset for m in messages] == handed, "fetch order, nothing else"
    assert [m.offset for m in loose] == copies
    starts = [opened.start("c1", 5000) for opened in plan.ranges]
    covered = [o for start in starts for o in _covered(start)]
    assert sorted(covered) == sorted(firsts), "each first delivery in exactly one START"
    for start in starts:
        assert start.first_offset in firsts, "a range starts at a message it covers"
    assert {m.offset: (m.attempt, m.is_redelivery) for m in messages} == {
        o: ((2, True) if o in copies else (1, False)) for o in handed
    }
    v1 = [m for m in plan.markers if isinstance(m, Marker)]
    assert sorted((m.message.offset, m.kind) for m in v1) == sorted(
        [(o, MarkerKind.START) for o in copies]
        + [(o, MarkerKind.DELAY) for o, kind in kinds.items() if kind == "deferred"]
    )
    assert plan.deferred == sum(kind == "deferred" for kind in kinds.values())
    assert plan.skipped == sum(kind == "other-group" for kind in kinds.values())


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=300), st.data())
def test_a_settle_covers_exactly_the_acked_messages(size: int, data: st.DataObject) -> None:
    gaps = data.draw(st.booleans())
    offsets = [5 + (3 * i if gaps else i) for i in range(size)]
    acked = data.draw(st.sets(st.sampled_from(offsets)))
    diverged = data.draw(st.sets(st.sampled_from(offsets))) - acked
    once = data.draw(st.booleans())  # as ``async for`` reads a batch, or as a sequence

    async def scenario() -> list[RangeMarker]:
        sink, book, context = _context()
        plan = _plan([_record(o, "first") for o in offsets])
        batch = MessageBatch(plan.deliver, context, [])
        for opened in plan.ranges:
            book.add(opened)
        for message in each_once(batch) if once else batch:
            if message.offset in acked:
                await message.ack()
                assert message.settled is MarkerKind.ACK
            elif message.offset in diverged:
                await message.retry(timedelta(seconds=1))
        await context.sink.flush()
        book.flush()
        book.close()
        return [m for m in sink.markers if isinstance(m, RangeMarker)]

    settles = asyncio.run(scenario())
    assert all(m.kind is RangeKind.RANGE_SETTLE for m in settles)
    settled = [o for m in settles for o in _covered(m)]
    assert sorted(settled) == sorted(acked), "each ack in exactly one SETTLE, nothing else"


def test_a_batch_is_a_sequence_that_shows_the_same_message_objects_every_time() -> None:
    _, _, context = _context()
    offsets = [*range(40, 45), 47, 48]
    records = [_record(o, "first") for o in offsets] + [_record(49, "copy")]
    plan = _plan(records)
    loose: list[KmqMessage] = []
    batch = MessageBatch(plan.deliver, context, loose)
    assert len(batch) == 8
    assert [m.offset for m in loose] == [49], "a copy is settled on its own"
    first = batch[0]
    assert batch[0] is first
    assert batch[-1] is loose[0]
    assert [m.offset for m in batch] == [*offsets, 49]
    assert list(batch) == batch[:]
    assert all(a is b for a, b in zip(batch, batch, strict=True))
    assert batch == list(batch)
    assert batch != list(batch)[1:]
    assert batch != "not a batch"
    assert list(each_once(batch)) == list(batch), "once the batch made them, the same ones"
    assert MessageBatch([], context, []) == []


def test_a_batch_read_once_makes_each_message_as_it_is_reached() -> None:
    sink, book, context = _context()
    plan = _plan([_record(o, "first") for o in range(10, 20)] + [_record(20, "copy")])
    loose: list[KmqMessage] = []
    batch = MessageBatch(plan.deliver, context, loose)
    once = list(each_once(batch))
    assert [m.offset for m in once] == list(range(10, 21))
    assert once[-1] is loose[0], "the copy is the one ``ack_all`` acks"
    again = list(each_once(batch))
    assert again[0] is not once[0], "not kept: read once, each message is freed when dropped"
    for opened in plan.ranges:
        book.add(opened)
    asyncio.run(once[3].ack())
    assert again[3].settled is MarkerKind.ACK, "the settled state is the range's byte"
    with pytest.raises(AlreadySettled):
        asyncio.run(again[3].ack())
    book.flush()
    [settle] = [m for m in sink.markers if isinstance(m, RangeMarker)]
    assert list(settle.offsets()) == [13]


async def test_a_second_ack_of_a_range_message_is_refused_and_sends_nothing() -> None:
    sink, book, context = _context()
    plan = _plan([_record(o, "first") for o in range(10, 20)])
    messages = MessageBatch(plan.deliver, context, [])
    await messages[3].ack()
    with pytest.raises(AlreadySettled):
        await messages[3].ack()
    with pytest.raises(AlreadySettled):
        await messages[3].reject("too late")
    book.flush()
    [settle] = [m for m in sink.markers if isinstance(m, RangeMarker)]
    assert list(settle.offsets()) == [13]
    assert sink.v1 == []
