"""Which entries have markers waiting in ingest's coalescing window.

Markers read but not yet applied to the store are invisible to the store's due claims, so
redelivery asks ingest about the entries it is about to act on (``pending_keys``) and leaves
those for later. Ingest counts every marker into this index when it queues it and out when it
applies or drops it: v1 markers per entry key, v2 range markers per lane and span.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tracker.domain.entries import EntryKey
from tracker.domain.ranges import lane_of, touched
from tracker.domain.tracked_range import LaneKey
from tracker.protocol import AnyMarker, RangeMarker


class CoalescingIndex:
    """Counts of the markers waiting in the coalescing window, per entry key and per span."""

    def __init__(self) -> None:
        #: v1 markers waiting in the coalescing window, per entry key
        self._pending_keys: Counter[EntryKey] = Counter()
        #: v2 range markers waiting in the coalescing window, per lane and span
        self._pending_spans: dict[LaneKey, Counter[tuple[int, int]]] = {}

    def pending_keys(self, keys: Iterable[EntryKey]) -> set[EntryKey]:
        """The keys among ``keys`` that have markers waiting in the coalescing window."""
        pending, lanes = self._pending_keys, self._pending_spans
        found: set[EntryKey] = set()
        for key in keys:
            if key in pending:
                found.add(key)
            elif lanes:
                spans = lanes.get((key[0], key[1], key[2]))
                if spans and any(first <= key[3] <= last for first, last in spans):
                    found.add(key)
        return found

    def hold(self, marker: AnyMarker, delta: int) -> None:
        """Count ``marker`` in (``delta`` 1) or out of (-1) the coalescing window."""
        if not isinstance(marker, RangeMarker):
            key = (marker.group, marker.origin_topic, marker.origin_partition, marker.origin_offset)
            left = self._pending_keys[key] + delta
            if left > 0:
                self._pending_keys[key] = left
            else:
                del self._pending_keys[key]
            return
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
