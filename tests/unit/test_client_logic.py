"""Client rules without a broker: batch planning, headers, settling verbs, delay validation."""

from __future__ import annotations

import asyncio
import gc
import warnings
from datetime import datetime, timedelta, timezone

import pytest
from aiokafka.errors import KafkaTimeoutError
from support.records import RECORDS_AT, FakeRecord

from tracker.client.consumer import KmqConsumer, marker_consumer_id
from tracker.client.marker_sink import KafkaMarkerSink
from tracker.client.message import KmqMessage, MessageContext
from tracker.client.open_ranges import RangeBook
from tracker.client.planning import Action, SeenCopies, plan_batch
from tracker.client.producer import resolve_deliver_at
from tracker.clock import ManualClock
from tracker.errors import (
    AlreadySettled,
    InvalidDelay,
    InvalidHeader,
    MarkerError,
    MarkerWriteFailed,
)
from tracker.headers import KmqHeaders, format_deliver_at, without_kmq_headers
from tracker.ids import MessageId
from tracker.protocol import MAX_REASON_LENGTH, Marker, MarkerKind, encode_marker
from tracker.testing import InMemoryMarkerSink

pytestmark = pytest.mark.unit

NOW = RECORDS_AT


def copy_headers(origin: str, attempt: int, group: str | None = None) -> list[tuple[str, bytes]]:
    headers = [("kmq-origin", origin.encode()), ("kmq-attempt", str(attempt).encode())]
    if group is not None:
        headers.append(("kmq-group", group.encode()))
    return headers


def plan(records: list[FakeRecord], seen: SeenCopies | None = None):  # type: ignore[no-untyped-def]
    return plan_batch(
        records, group="billing", consumer_id="c1", timeout_ms=5000, now=NOW, seen=seen
    )


def test_first_deliveries_get_a_start_with_the_lease() -> None:
    [p] = plan([FakeRecord("orders", 2, 10)])
    assert p.action is Action.DELIVER
    assert p.marker is not None
    assert p.marker.kind is MarkerKind.START
    assert (p.marker.group, p.marker.timeout_ms, p.marker.consumer) == ("billing", 5000, "c1")
    assert p.marker.origin == p.marker.message == MessageId("orders", 2, 10)
    assert p.marker.attempt == 1


def test_copies_carry_origin_and_attempt_into_the_start() -> None:
    [p] = plan([FakeRecord("orders", 0, 99, copy_headers("orders/2/10", 3, "billing"))])
    assert p.action is Action.DELIVER
    assert p.marker is not None
    assert p.marker.origin == MessageId("orders", 2, 10)
    assert p.marker.attempt == 3
    assert p.marker.message == MessageId("orders", 0, 99)


def test_copies_for_another_group_are_skipped_without_markers() -> None:
    [p] = plan([FakeRecord("orders", 0, 99, copy_headers("orders/2/10", 2, "shipping"))])
    assert p.action is Action.SKIP
    assert p.marker is None


def test_not_yet_due_messages_are_deferred_with_the_remaining_delay() -> None:
    due = NOW + timedelta(minutes=90)
    [p] = plan([FakeRecord("orders", 1, 5, [("kmq-deliver-at", format_deliver_at(due))])])
    assert p.action is Action.DEFER
    assert p.marker is not None
    assert p.marker.kind is MarkerKind.DELAY
    assert p.marker.delay_ms == 90 * 60 * 1000
    assert not p.marker.policy_delay
    assert p.marker.deferred


def test_due_delayed_messages_are_delivered() -> None:
    due = NOW - timedelta(seconds=1)
    [p] = plan([FakeRecord("orders", 1, 5, [("kmq-deliver-at", format_deliver_at(due))])])
    assert p.action is Action.DELIVER


def test_unreadable_kmq_headers_are_tracked_as_new_not_dropped() -> None:
    [p] = plan([FakeRecord("orders", 1, 5, [("kmq-attempt", b"two")])])
    assert p.action is Action.DELIVER
    assert p.marker is not None
    assert p.marker.origin == MessageId("orders", 1, 5)


def test_dedup_skips_an_exact_duplicate_copy_only() -> None:
    ticks = [0.0]
    seen = SeenCopies(timedelta(seconds=60), monotonic=lambda: ticks[0])
    a = FakeRecord("orders", 0, 100, copy_headers("orders/2/10", 2))
    dup = FakeRecord("orders", 0, 101, copy_headers("orders/2/10", 2))
    next_attempt = FakeRecord("orders", 0, 102, copy_headers("orders/2/10", 3))
    actions = [p.action for p in plan([a, dup, next_attempt], seen)]
    assert actions == [Action.DELIVER, Action.SKIP, Action.DELIVER]
    ticks[0] = 61.0  # past the window: a copy is no longer remembered
    [late] = plan([FakeRecord("orders", 0, 103, copy_headers("orders/2/10", 2))], seen)
    assert late.action is Action.DELIVER


def test_dedup_capacity_is_bounded() -> None:
    seen = SeenCopies(timedelta(hours=1), capacity=10, monotonic=lambda: 0.0)
    for offset in range(100):
        seen.check_and_add(MessageId("t", 0, offset), 1)
    assert len(seen) <= 10


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ([("kmq-origin", b"orders/1")], "topic/partition/offset"),
        ([("kmq-origin", b"bad topic/1/2")], "invalid topic"),
        ([("kmq-origin", b"t/1/x")], "non-numeric"),
        ([("kmq-attempt", b"0")], "out of range"),
        ([("kmq-attempt", b"3")], "without kmq-origin"),
        ([("kmq-deliver-at", b"-5")], "non-negative decimal"),
        ([("kmq-origin", b"\xff/1/2")], "not ASCII"),
    ],
)
def test_invalid_kmq_headers_say_why(headers: list[tuple[str, bytes]], error: str) -> None:
    with pytest.raises(InvalidHeader, match=error):
        KmqHeaders.parse(headers)


def test_headers_round_trip_and_application_headers_are_kept() -> None:
    kmq = KmqHeaders(MessageId("orders", 1, 2), 4, "billing", NOW)
    mixed = [("trace-id", b"abc"), *kmq.to_headers()]
    assert KmqHeaders.parse(mixed) == kmq
    assert without_kmq_headers(mixed) == [("trace-id", b"abc")]


def _message(sink: InMemoryMarkerSink, record: FakeRecord | None = None) -> KmqMessage:
    record = record or FakeRecord("orders", 0, 7, copy_headers("orders/3/1", 2))
    kmq = KmqHeaders.parse(record.headers)
    return KmqMessage(
        record,
        MessageContext("billing", sink, RangeBook(sink.send_later)),
        origin=kmq.origin or MessageId(record.topic, record.partition, record.offset),
        attempt=kmq.attempt,
    )


async def test_each_verb_writes_its_marker_with_identity() -> None:
    sink = InMemoryMarkerSink()
    for verb in ("ack", "retry", "reject"):
        msg = _message(sink)
        await msg.extend(timedelta(seconds=90))
        if verb == "ack":
            await msg.ack()
        elif verb == "retry":
            await msg.retry(timedelta(seconds=30), reason="db down")
        else:
            await msg.reject("bad payload")
    kinds = [m.kind for m in sink.v1]
    assert kinds == [
        MarkerKind.EXTEND,
        MarkerKind.ACK,
        MarkerKind.EXTEND,
        MarkerKind.DELAY,
        MarkerKind.EXTEND,
        MarkerKind.REJECT,
    ]
    for marker in sink.v1:
        assert marker.origin == MessageId("orders", 3, 1)
        assert marker.message == MessageId("orders", 0, 7)
        assert marker.attempt == 2
        assert marker.group == "billing"
    assert sink.v1[0].timeout_ms == 90_000
    assert (sink.v1[3].delay_ms, sink.v1[3].reason) == (30_000, "db down")
    assert sink.v1[5].reason == "bad payload"


async def test_retry_without_delay_leaves_it_to_the_policy() -> None:
    sink = InMemoryMarkerSink()
    await _message(sink).retry()
    assert sink.v1[0].policy_delay


async def test_a_message_settles_once() -> None:
    sink = InMemoryMarkerSink()
    msg = _message(sink)
    await msg.ack()
    with pytest.raises(AlreadySettled, match="already settled with ACK"):
        await msg.reject("late")
    with pytest.raises(AlreadySettled):
        await msg.extend(timedelta(seconds=1))
    assert len(sink.v1) == 1


async def test_a_failed_marker_write_leaves_the_message_unsettled() -> None:
    sink = InMemoryMarkerSink()
    msg = _message(sink)
    sink.fail = True
    with pytest.raises(Exception, match="told to fail"):
        await msg.ack(wait=True)
    assert msg.settled is None
    sink.fail = False
    await msg.ack(wait=True)
    assert msg.settled is MarkerKind.ACK
    assert [m.kind for m in sink.v1] == [MarkerKind.ACK]


async def test_markers_nobody_waits_for_settle_at_once_in_order() -> None:
    sink = InMemoryMarkerSink()
    first, second = _message(sink), _message(sink)
    await first.ack()
    await second.retry(timedelta(seconds=5), reason="busy")
    assert first.settled is MarkerKind.ACK
    assert second.settled is MarkerKind.DELAY
    assert [m.kind for m in sink.v1] == [MarkerKind.ACK, MarkerKind.DELAY]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda m: m.retry(timedelta(seconds=-1)), "at least 0 ms"),
        (lambda m: m.extend(timedelta(0)), "at least 1 ms"),
        (lambda m: m.extend(timedelta(days=60)), "longer than the protocol allows"),
        (lambda m: m.retry(5), "must be a datetime.timedelta"),
    ],
)
async def test_bad_durations_are_refused(call, error) -> None:  # type: ignore[no-untyped-def]
    sink = InMemoryMarkerSink()
    msg = _message(sink)
    with pytest.raises(InvalidDelay, match=error):
        await call(msg)
    assert sink.v1 == []
    assert msg.settled is None


async def test_processing_acks_on_success_and_retries_on_error() -> None:
    sink = InMemoryMarkerSink()
    ok = _message(sink)
    async with ok.processing():
        pass
    failing = _message(sink)
    with pytest.raises(ValueError, match="boom"):
        async with failing.processing():
            raise ValueError("boom")
    suppressed = _message(sink)
    async with suppressed.processing(retry_delay=timedelta(seconds=5), suppress=True):
        raise KeyError("x")
    rejected = _message(sink)
    async with rejected.processing():
        await rejected.reject("nope")
    assert [m.kind for m in sink.v1] == [
        MarkerKind.ACK,
        MarkerKind.DELAY,
        MarkerKind.DELAY,
        MarkerKind.REJECT,
    ]
    assert sink.v1[1].reason == "ValueError: boom"
    assert sink.v1[1].policy_delay
    assert sink.v1[2].delay_ms == 5000


async def test_long_reasons_are_truncated_on_a_character_boundary() -> None:
    sink = InMemoryMarkerSink()
    await _message(sink).reject("é" * 5000)
    reason = sink.v1[0].reason
    assert len(reason.encode()) <= 4096
    assert set(reason) == {"é"}


async def test_nul_characters_in_a_reason_are_replaced_not_refused() -> None:
    """An exception's text may quote binary data; the protocol refuses U+0000 in text (no
    PostgreSQL text holds it), so the client replaces it rather than lose the retry."""
    sink = InMemoryMarkerSink()
    await _message(sink).retry(reason="ValueError: bad byte \x00 at 3")
    assert sink.v1[0].reason == "ValueError: bad byte \ufffd at 3"


@pytest.mark.parametrize(
    ("group_id", "consumer_id", "error"),
    [
        ("", None, "group_id must be 1 to 255 bytes"),
        ("é" * 128, None, "group_id must be 1 to 255 bytes"),
        ("bill\x00ing", None, "without NUL"),
        ("billing", "worker\x001", "consumer_id must not contain NUL"),
    ],
)
def test_a_consumer_refuses_names_no_marker_can_carry(
    group_id: str, consumer_id: str | None, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        KmqConsumer(
            "orders", group_id=group_id, consumer_id=consumer_id, bootstrap_servers="127.0.0.1:9"
        )


async def test_a_consumer_never_started_closes_its_clients_when_stopped() -> None:
    """Stopping a consumer that was never started (a start that was never reached) closes
    the aiokafka consumer and producer it made: collected unstopped, they warn, and under
    ``filterwarnings = error`` the warning fails the test. Stopping again does nothing."""
    consumer = KmqConsumer("orders", group_id="billing", bootstrap_servers="127.0.0.1:9")
    await consumer.stop()
    await consumer.stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del consumer
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_a_long_consumer_id_is_cut_to_what_a_marker_carries() -> None:
    """255 bytes of UTF-8, cut on a character (a cut by characters left 510 bytes of "é",
    which every START then failed to encode)."""
    consumer_id = marker_consumer_id("é" * 300)
    assert consumer_id == "é" * 127
    encode_marker(Marker.start("billing", MessageId("orders", 0, 0), consumer=consumer_id))


def test_message_exposes_identity_key_and_application_headers() -> None:
    record = FakeRecord(
        "orders", 0, 7, [("trace", b"t1"), *copy_headers("orders/3/1", 2, "billing")]
    )
    msg = _message(InMemoryMarkerSink(), record)
    assert msg.id == MessageId("orders", 0, 7)
    assert msg.origin == MessageId("orders", 3, 1)
    assert msg.is_redelivery
    assert msg.attempt == 2
    assert msg.key == b"k"
    assert msg.headers == (("trace", b"t1"),)
    assert msg.header("kmq-group") == b"billing"
    assert msg.timestamp == NOW


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"delay": timedelta(0)}, "must be positive"),
        ({"delay": timedelta(seconds=-3)}, "must be positive"),
        ({"deliver_at": datetime(2030, 1, 1)}, "naive datetime"),  # noqa: DTZ001
        ({"deliver_at": NOW - timedelta(seconds=1)}, "not in the future"),
        ({"deliver_at": NOW}, "not in the future"),
        ({"delay": timedelta(days=4000)}, "limit"),
        ({"delay": timedelta(1), "deliver_at": NOW + timedelta(1)}, "not both"),
    ],
)
def test_bad_delays_are_refused_clearly(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(InvalidDelay, match=error):
        resolve_deliver_at(NOW, **kwargs)  # type: ignore[arg-type]


def test_delays_resolve_against_the_clock_in_any_timezone() -> None:
    clock = ManualClock(NOW)
    assert resolve_deliver_at(clock.now(), delay=timedelta(hours=2), deliver_at=None) == (
        NOW + timedelta(hours=2)
    )
    tokyo = timezone(timedelta(hours=9))
    at = datetime(2026, 11, 22, 9, 0, tzinfo=tokyo)
    assert resolve_deliver_at(NOW, delay=None, deliver_at=at) == at
    assert resolve_deliver_at(NOW, delay=None, deliver_at=None) is None


async def test_an_invalid_marker_nobody_waits_for_is_refused_to_its_writer() -> None:
    """Queued markers are encoded when queued: a bad one raises to the caller at once instead
    of failing a later batch (and the markers queued with it) in the background."""
    sink = KafkaMarkerSink(producer=None, markers_topic="kmq-markers")
    bad = Marker.reject("billing", MessageId("orders", 0, 7), reason="x" * (MAX_REASON_LENGTH + 1))
    with pytest.raises(MarkerError, match="reason"):
        sink.send_later(bad)
    assert sink._open == {}
    assert sink._pending_start == []


class _BatchStub:
    """What the sink uses of aiokafka's batch builder: it takes every record."""

    def append(self, **_: object) -> object:
        return object()

    def close(self) -> None:
        pass


class _RefusingProducer:
    """A producer whose broker refuses every batch (the delivery future fails)."""

    class _Cluster:
        def partitions_for_topic(self, _topic: str) -> set[int]:
            return {0}

    def __init__(self) -> None:
        self.client = self
        self.refuse = True

    async def fetch_all_metadata(self) -> _Cluster:
        return self._Cluster()

    async def partitions_for(self, _topic: str) -> set[int]:
        return {0}

    def create_batch(self) -> _BatchStub:
        return _BatchStub()

    async def send_batch(self, *_: object, **__: object) -> asyncio.Future[object]:
        delivered: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.refuse:
            delivered.set_exception(KafkaTimeoutError())
        else:
            delivered.set_result(object())
        return delivered

    async def flush(self) -> None:
        pass


async def test_a_flush_raises_when_a_marker_nobody_waited_for_was_refused() -> None:
    """``send_later`` cannot raise a broker failure, so ``flush`` must: a flush that returned
    after a refused ACK told its caller the message was settled when the tracker will in fact
    redeliver it. The failure is reported once, whether it came before or during the flush."""
    producer = _RefusingProducer()
    sink = KafkaMarkerSink(producer=producer, markers_topic="kmq-markers")
    ack = Marker.ack("billing", MessageId("orders", 0, 7))
    sink.send_later(ack)  # the flush waits for it
    with pytest.raises(MarkerWriteFailed, match="not acknowledged"):
        await sink.flush()
    await sink.flush()  # reported once; nothing new is queued

    sink.send_later(ack)
    for _ in range(10):  # let the refusal settle before anyone flushes
        await asyncio.sleep(0)
    assert sink._unsettled == set()
    with pytest.raises(MarkerWriteFailed, match="not acknowledged"):
        await sink.flush()

    producer.refuse = False
    sink.send_later(ack)
    await sink.flush()


async def test_the_in_memory_sink_reports_a_lost_marker_at_the_next_flush() -> None:
    """The fake keeps the Kafka sink's contract (the test above)."""
    sink = InMemoryMarkerSink()
    sink.fail = True
    sink.send_later(Marker.ack("billing", MessageId("orders", 0, 7)))
    sink.fail = False
    with pytest.raises(MarkerWriteFailed):
        await sink.flush()
    await sink.flush()
