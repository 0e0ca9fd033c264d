"""The crash-safety ledger's own accounting: a copy after a written ack is caught; the two
documented duplicates (a copy made before the ack was written, a copy of a re-read delivery)
are not. No broker: records are built as the watcher would read them."""

from __future__ import annotations

from tracker import headers as h
from tracker.ids import MessageId
from tracker.protocol import Marker, RangeMarker, encode_any

from .engine_support import Seen
from .workload import Ledger, MarkerLog, Reception, Worker

ORIGIN = MessageId("queue", 0, 11)
OTHER = MessageId("queue", 0, 12)


def marker(marker: Marker | RangeMarker, at: int) -> Seen:
    return Seen("markers", 0, at, at, None, encode_any(marker), [])


def copy(origin: MessageId, attempt: int, at: int) -> Seen:
    headers = [(h.ORIGIN, str(origin).encode()), (h.ATTEMPT, str(attempt).encode())]
    return Seen("queue", origin.partition, 100 + at, at, None, b"m1", headers)


def worker_that_acked(*origins: MessageId) -> Worker:
    worker = Worker("unused:9092", "queue", "g", "markers", lambda _: True)
    worker.received = [Reception(o, o, 1, 1, True, 0.0) for o in origins]
    return worker


def ledger(copies: list[Seen], acked: tuple[MessageId, ...] = (ORIGIN,)) -> Ledger:
    sent = {ORIGIN: 1, OTHER: 2}
    originals = [Seen("queue", 0, o.offset, 0, None, b"m", []) for o in sent]
    return Ledger.build(sent, [*originals, *copies], worker_that_acked(*acked))


def test_a_copy_after_the_written_ack_is_caught() -> None:
    log = MarkerLog.read(
        [
            marker(Marker.start("g", ORIGIN, timeout_ms=2000), 1_000),
            marker(Marker.ack("g", ORIGIN), 1_500),
        ]
    )
    assert ledger([copy(ORIGIN, 2, 3_500)]).acked_then_copied(log) == [(ORIGIN, 1)]


def test_a_range_settle_counts_as_the_ack() -> None:
    log = MarkerLog.read(
        [
            marker(RangeMarker.start("g", "queue", 0, 11, 12, timeout_ms=2000), 1_000),
            marker(RangeMarker.settle("g", "queue", 0, 11, 12), 1_500),
        ]
    )
    found = ledger([copy(ORIGIN, 2, 3_500)], (ORIGIN, OTHER)).acked_then_copied(log)
    assert found == [(ORIGIN, 1)]


def test_an_ack_that_never_reached_the_markers_topic_is_caught() -> None:
    log = MarkerLog.read([marker(Marker.start("g", ORIGIN, timeout_ms=2000), 1_000)])
    assert ledger([copy(ORIGIN, 2, 3_500)]).acked_then_copied(log) == [(ORIGIN, 1)]


def test_a_copy_made_before_the_ack_was_written_is_a_duplicate() -> None:
    # STARTed, the commit failed at a rebalance; the lease ran out (copy at 3.2 s) before the
    # next owner read the batch again (range START at 4 s) and acked it.
    log = MarkerLog.read(
        [
            marker(Marker.start("g", ORIGIN, timeout_ms=2000), 1_000),
            marker(RangeMarker.start("g", "queue", 0, 11, 11, timeout_ms=2000), 4_000),
            marker(RangeMarker.settle("g", "queue", 0, 11, 11), 4_100),
        ]
    )
    assert ledger([copy(ORIGIN, 2, 3_200)]).acked_then_copied(log) == []


def test_a_copy_of_a_delivery_read_again_after_the_ack_is_a_duplicate() -> None:
    # Acked at 1.5 s; the commit was lost, so the next owner read it again (START at 2 s)
    # and never settled that delivery: its lease ran out (copy at 4.2 s).
    log = MarkerLog.read(
        [
            marker(Marker.start("g", ORIGIN, timeout_ms=2000), 1_000),
            marker(Marker.ack("g", ORIGIN), 1_500),
            marker(Marker.start("g", ORIGIN, timeout_ms=2000), 2_000),
        ]
    )
    assert ledger([copy(ORIGIN, 2, 4_200)]).acked_then_copied(log) == []
