"""The coalescing index answers as if it counted every queued marker, though it counts lazily.

Batches are registered without looking at their markers and counted only when redelivery asks
(``pending_keys``); a batch may leave before or after it was counted. Whatever the order of
queuing, asking and leaving, the answer must be the keys that a marker of a batch still in the
window touches.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from support.range_model import (
    GROUP,
    MARKERS_PARTITION,
    PARTITION,
    TOPIC,
    WINDOW,
    range_markers,
    single_markers,
)

from tracker.domain.entries import EntryKey
from tracker.domain.ranges import touched
from tracker.engine.coalescing_index import CoalescingIndex
from tracker.engine.partition_reading import PendingBatch
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker
from tracker.store.port import PendingMarker

ALL_KEYS: list[EntryKey] = [(GROUP, TOPIC, PARTITION, offset) for offset in range(WINDOW)]


def batch_of(markers: list[AnyMarker]) -> PendingBatch:
    return PendingBatch(
        0.0, [PendingMarker(m, 0, MARKERS_PARTITION, i) for i, m in enumerate(markers)]
    )


def expected(live: list[PendingBatch], asked: list[EntryKey]) -> set[EntryKey]:
    found: set[EntryKey] = set()
    for batch in live:
        for pending in batch.markers:
            m = pending.marker
            first, last = touched(m)
            lane = (m.group, m.origin_topic, m.origin_partition)
            found |= {k for k in asked if k[:3] == lane and first <= k[3] <= last}
    return found


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("queue"),
            st.lists(st.one_of(single_markers(), range_markers()), min_size=1, max_size=6),
        ),
        st.tuples(st.just("leave"), st.integers(0, 10)),
        st.tuples(st.just("ask"), st.lists(st.sampled_from(ALL_KEYS), max_size=8)),
    ),
    max_size=30,
)


@given(operations)
def test_pending_keys_are_the_keys_of_the_batches_still_queued(
    ops: list[tuple[str, object]],
) -> None:
    index = CoalescingIndex()
    live: list[PendingBatch] = []
    for op, arg in ops:
        if op == "queue":
            assert isinstance(arg, list)
            live.append(batch_of(arg))
            index.add(live[-1])
        elif op == "leave" and live:
            assert isinstance(arg, int)
            index.remove(live.pop(arg % len(live)))
        elif op == "ask":
            assert isinstance(arg, list)
            assert index.pending_keys(iter(arg)) == expected(live, arg)
    assert index.pending_keys(ALL_KEYS) == expected(live, ALL_KEYS)
    for batch in live:
        index.remove(batch)
    assert index.pending_keys(ALL_KEYS) == set()


def test_a_key_stays_pending_while_any_batch_still_holds_a_marker_for_it() -> None:
    index = CoalescingIndex()
    message = MessageId(TOPIC, PARTITION, 3)
    start = batch_of([Marker.start(GROUP, message, attempt=1, timeout_ms=1_000)])
    ack = batch_of([Marker.ack(GROUP, message, attempt=1)])
    key = (GROUP, TOPIC, PARTITION, 3)
    index.add(start)
    assert index.pending_keys([key]) == {key}  # counts the START
    index.add(ack)  # queued after the count: counted at the next question
    index.remove(start)
    assert index.pending_keys([key]) == {key}, "the ACK still waits"
    index.remove(ack)
    assert index.pending_keys([key]) == set()
