"""Which entries have markers waiting in ingest's coalescing window.

Markers read but not yet applied to the store are invisible to the store's due claims, so
redelivery asks ingest about the entries it is about to act on (``pending_keys``) and leaves
those for later. Ingest registers every polled batch here when it queues it and takes it out
when it applies or drops it.

Registering is O(1) per batch: most batches leave the window before anyone asks (redelivery
asks only when a claim found due entries), so their markers are counted per key only when
``pending_keys`` is called, and only once: v1 markers per entry key, v2 range markers per lane
and span. Counting every marker in and out on the hot path cost more than a third of acked
ingest's time in the window (docs/benchmarks.md, change 37).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tracker.domain.entries import EntryKey
from tracker.domain.ranges import lane_of, touched
from tracker.domain.tracked_range import LaneKey
from tracker.engine.partition_reading import PendingBatch
from tracker.protocol import RangeMarker


class CoalescingIndex:
    """The batches in the coalescing window, with their markers counted per key on demand."""

    def __init__(self) -> None:
        #: batches queued and not counted yet; every other queued batch is counted below
        self._unindexed: set[PendingBatch] = set()
        #: v1 markers of the counted batches, per entry key
        self._pending_keys: Counter[EntryKey] = Counter()
        #: v2 range markers of the counted batches, per lane and span
        self._pending_spans: dict[LaneKey, Counter[tuple[int, int]]] = {}

    def add(self, batch: PendingBatch) -> None:
        """``batch`` entered the window."""
        self._unindexed.add(batch)

    def remove(self, batch: PendingBatch) -> None:
        """``batch`` (added before, removed once) left the window (applied, or its partition
        dropped)."""
        if batch in self._unindexed:
            self._unindexed.discard(batch)
        else:
            self._count(batch, -1)

    def pending_keys(self, keys: Iterable[EntryKey]) -> set[EntryKey]:
        """The keys among ``keys`` that have markers waiting in the coalescing window."""
        asked = list(keys)
        if not asked:
            return set()
        while self._unindexed:
            self._count(self._unindexed.pop(), 1)
        pending, lanes = self._pending_keys, self._pending_spans
        found: set[EntryKey] = set()
        for key in asked:
            if key in pending:
                found.add(key)
            elif lanes:
                spans = lanes.get((key[0], key[1], key[2]))
                if spans and any(first <= key[3] <= last for first, last in spans):
                    found.add(key)
        return found

    def _count(self, batch: PendingBatch, delta: int) -> None:
        """Count ``batch``'s markers in (``delta`` 1) or out of (-1) the index."""
        keys = self._pending_keys
        v1: list[EntryKey] = []
        for pending in batch.markers:
            m = pending.marker
            if isinstance(m, RangeMarker):
                self._count_span(m, delta)
            else:
                v1.append((m.group, m.origin_topic, m.origin_partition, m.origin_offset))
        if delta > 0:
            keys.update(v1)
            return
        for key in v1:
            left = keys[key] - 1
            if left > 0:
                keys[key] = left
            else:
                del keys[key]

    def _count_span(self, marker: RangeMarker, delta: int) -> None:
        lane = lane_of(marker)
        span = touched(marker)
        spans = self._pending_spans.get(lane)
        if spans is None:
            spans = self._pending_spans[lane] = Counter()
        left = spans[span] + delta
        if left > 0:
            spans[span] = left
        else:
            del spans[span]
            if not spans:
                del self._pending_spans[lane]
