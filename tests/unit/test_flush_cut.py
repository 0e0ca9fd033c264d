"""Where a flush cuts a partition's queue (``tracker.engine.flush_cut``).

The cut decides only what a flush writes (a START and its SETTLE taken together cancel out in
memory), never what the store ends up holding; so what is checked here is that pairs stay
together where a boundary allows it, and that the cut stays where the window put it when none
does.
"""

from __future__ import annotations

from collections import deque

import pytest

from tracker.engine.flush_cut import cut
from tracker.engine.partition_reading import PendingBatch
from tracker.ids import MessageId
from tracker.protocol import Marker
from tracker.protocol_v2 import RangeMarker
from tracker.store.port import PendingMarker

pytestmark = [pytest.mark.unit]

GROUP, TOPIC = "billing", "orders"
CUTOFF, REACH = 10.0, 0.2


def queue(*batches: tuple[float, list[Marker | RangeMarker]]) -> deque[PendingBatch]:
    out: deque[PendingBatch] = deque()
    offset = 0
    for arrived, markers in batches:
        pending = []
        for marker in markers:
            pending.append(PendingMarker(marker, 0, 0, offset))
            offset += 1
        out.append(PendingBatch(arrived, pending))
    return out


def range_start(first: int, last: int, partition: int = 0, exceptions: int = 0) -> RangeMarker:
    return RangeMarker.start(GROUP, TOPIC, partition, first, last, exceptions=exceptions)


def range_settle(first: int, last: int, partition: int = 0, exceptions: int = 0) -> RangeMarker:
    return RangeMarker.settle(GROUP, TOPIC, partition, first, last, exceptions=exceptions)


def start(offset: int) -> Marker:
    return Marker.start(GROUP, MessageId(TOPIC, 0, offset), timeout_ms=5_000)


def ack(offset: int) -> Marker:
    return Marker.ack(GROUP, MessageId(TOPIC, 0, offset))


def test_the_window_alone_cuts_when_nothing_taken_waits_for_a_settle() -> None:
    pending = queue(
        (CUTOFF - 0.05, [range_start(0, 9), range_settle(0, 9)]),
        (CUTOFF + 0.05, [range_start(10, 19)]),
    )
    assert cut(pending, CUTOFF, REACH) == 1


def test_a_range_start_taken_brings_its_settle_read_after_the_cut() -> None:
    pending = queue(
        (CUTOFF - 0.01, [range_start(0, 9)]),
        (CUTOFF + 0.03, [range_start(100, 109, partition=1)]),  # another lane, settled too
        (CUTOFF + 0.05, [range_settle(0, 9), range_settle(100, 109, partition=1)]),
        (CUTOFF + 0.06, [range_start(10, 19)]),  # not taken: nothing before it waits
    )
    assert cut(pending, CUTOFF, REACH) == 3


def test_a_range_settled_in_parts_is_taken_up_to_its_last_part() -> None:
    pending = queue(
        (CUTOFF - 0.01, [range_start(0, 9, exceptions=0b10)]),  # offset 1 is not this group's
        (CUTOFF + 0.02, [range_settle(0, 4)]),
        (CUTOFF + 0.04, [range_settle(5, 9)]),
        (CUTOFF + 0.06, [range_start(10, 19)]),
    )
    assert cut(pending, CUTOFF, REACH) == 3


def test_a_per_message_marker_settles_its_offset_of_a_range() -> None:
    pending = queue(
        (CUTOFF - 0.01, [range_start(0, 3)]),
        (CUTOFF + 0.02, [range_settle(0, 3, exceptions=0b100)]),  # offset 2 not acked ...
        (
            CUTOFF + 0.03,
            [Marker.reject(GROUP, MessageId(TOPIC, 0, 2), reason="bad")],
        ),  # ... but rejected
        (CUTOFF + 0.06, [range_start(4, 9)]),
    )
    assert cut(pending, CUTOFF, REACH) == 3


def test_a_v1_start_brings_its_ack_and_an_extend_settles_nothing() -> None:
    pending = queue(
        (CUTOFF - 0.01, [start(5)]),
        (CUTOFF + 0.02, [Marker.extend(GROUP, MessageId(TOPIC, 0, 5), timeout_ms=5_000)]),
        (CUTOFF + 0.04, [ack(5)]),
        (CUTOFF + 0.05, [start(6)]),
    )
    assert cut(pending, CUTOFF, REACH) == 3


def test_under_steady_traffic_the_cut_stays_where_the_window_put_it() -> None:
    # A pipelined client: each batch settles the one before and starts the next, so a START
    # is always open; no boundary within reach keeps every pair together.
    batches: list[tuple[float, list[Marker | RangeMarker]]] = [(CUTOFF - 0.01, [range_start(0, 9)])]
    for i in range(1, 30):
        first = i * 10
        batches.append(
            (
                CUTOFF + i * 0.01,
                [range_settle(first - 10, first - 1), range_start(first, first + 9)],
            )
        )
    assert cut(queue(*batches), CUTOFF, REACH) == 1


def test_a_settle_beyond_reach_or_in_another_group_is_not_waited_for() -> None:
    late = queue(
        (CUTOFF - 0.01, [range_start(0, 9)]), (CUTOFF + REACH + 0.01, [range_settle(0, 9)])
    )
    assert cut(late, CUTOFF, REACH) == 1
    other = queue(
        (CUTOFF - 0.01, [range_start(0, 9)]),
        (CUTOFF + 0.02, [RangeMarker.settle("audit", TOPIC, 0, 0, 9)]),
    )
    assert cut(other, CUTOFF, REACH) == 1


def test_a_start_read_long_before_the_cut_is_work_in_progress_not_a_pair_to_keep() -> None:
    pending = queue(
        (CUTOFF - REACH - 0.01, [range_start(0, 9)]),  # a slow consumer's batch
        (CUTOFF - 0.01, [range_start(10, 19, partition=1)]),
        (CUTOFF + 0.02, [range_settle(10, 19, partition=1)]),
        (CUTOFF + 0.03, [range_start(20, 29, partition=1)]),
    )
    assert cut(pending, CUTOFF, REACH) == 3


def test_nothing_moves_the_cut_when_the_window_took_nothing_or_everything_or_reach_is_zero() -> (
    None
):
    pending = queue((CUTOFF - 0.01, [range_start(0, 9)]), (CUTOFF + 0.01, [range_settle(0, 9)]))
    assert cut(pending, CUTOFF - 1, REACH) == 0
    assert cut(pending, CUTOFF + 1, REACH) == 2
    assert cut(pending, CUTOFF, 0.0) == 1


def test_the_cut_looks_at_a_bounded_number_of_markers_and_keeps_the_time_cut_past_it() -> None:
    # A v1 consumer at full speed: batches of many markers. Looking through all of them at
    # every flush blocked the event loop for tens of ms, so past the budget the time cut holds.
    many: list[Marker | RangeMarker] = [m for o in range(100, 105) for m in (start(o), ack(o))]
    pending = queue(
        (CUTOFF - 0.01, [range_start(0, 9)]),
        (CUTOFF + 0.02, many),
        (CUTOFF + 0.03, [range_settle(0, 9)]),
    )
    assert cut(pending, CUTOFF, REACH, budget=100) == 3
    assert cut(pending, CUTOFF, REACH, budget=5) == 1, "a batch after the cut is over budget"
    pending = queue(
        (CUTOFF - 0.01, [range_start(0, 9)]),
        (CUTOFF + 0.03, [range_settle(0, 9), *many]),
    )
    assert cut(pending, CUTOFF, REACH, budget=100) == 2
    assert cut(pending, CUTOFF, REACH, budget=5) == 1
    before = queue(
        (CUTOFF - 0.02, [range_start(0, 9), *many]),
        (CUTOFF + 0.03, [range_settle(0, 9)]),
    )
    assert cut(before, CUTOFF, REACH, budget=100) == 2
    assert cut(before, CUTOFF, REACH, budget=5) == 1, "the batch before the cut is over budget"
