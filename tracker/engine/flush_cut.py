"""Where a flush cuts a partition's queue of markers: after the window, between pairs.

A START and the marker that settles it cancel out in memory only when one flush applies both
(the fold, ``tracker.domain.ranges``); applied apart, the START writes a row and the SETTLE
deletes it. A flush takes whole polled batches that have spent the coalescing window, so a
cut by time alone falls between a START and its SETTLE whenever the START left the window and
the SETTLE, read one poll later, had not yet. That happened to a share of pairs that grows
with the gap between the two (a client queues SETTLEs every 50 ms) over the time between
flushes, and with how often polls return: a broker that answers a fetch as soon as markers
arrive (Kafka does; the test broker does when its wait runs out) puts the two in different
polls.

So the cut moves forward, past the time cut, to the first batch boundary where no START
taken in the last moments before the cut is still waiting for a SETTLE already read, and at
most ``reach`` seconds past the time cut: batches taken early have spent at least the window
less ``reach``. Under steady traffic a pipelined client always has a START open (the next
batch's, written while it works on the current one); then no such boundary comes within
``reach`` and the cut stays where time put it, as before. Where a flush cuts changes what the
store writes, never what it ends up holding: every batch is applied, in order, exactly once.

The cut looks at no more than ``MARKERS_LOOKED_AT`` markers on each side of the time cut: it
runs on the event loop at every flush, and a v1 consumer at full speed puts tens of
thousands of markers in 200 ms (looking at all of them took 10-40 ms per flush; with the
bound, at most ~1.5 ms). Past that it keeps the time cut. v2 traffic is a few range markers
per fetched batch and never gets near it.

Matching is per range for v2 (the open offsets of each RANGE_START, cleared by the SETTLEs
and per-message markers that follow) and per entry for v1 (a START, closed by the ACK, DELAY
or REJECT of its message); an EXTEND settles nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import islice
from typing import cast

from tracker.domain.entries import entry_key
from tracker.engine.partition_reading import PendingBatch
from tracker.protocol import Marker, MarkerKind
from tracker.protocol_v2 import RangeKind, RangeMarker

#: a v2 RANGE_START by lane and first offset; a v1 START by lane and origin offset
_OpenKey = tuple[str, str, int, int]

_V1_SETTLING = frozenset({MarkerKind.ACK, MarkerKind.DELAY, MarkerKind.REJECT})

#: Most markers the cut looks at before the time cut, and again after it.
MARKERS_LOOKED_AT = 2048


def cut(
    pending: deque[PendingBatch], cutoff: float, reach: float, budget: int = MARKERS_LOOKED_AT
) -> int:
    """How many of ``pending``'s batches (oldest first) a flush takes, given the time cut
    (batches that arrived at ``cutoff`` or before have spent the window)."""
    n = 0
    for queued in pending:
        if queued.arrived > cutoff:
            break
        n += 1
    if n == 0 or n == len(pending) or reach <= 0:
        return n
    # Only STARTs read shortly before the cut can have their SETTLE just after it; one read
    # longer ago belongs to work still running (its SETTLE is not read yet, or not written).
    first, left = n, budget
    while first > 0:
        queued = pending[first - 1]
        if queued.arrived <= cutoff - reach or len(queued.markers) > left:
            break
        left -= len(queued.markers)
        first -= 1
    opened = _OpenStarts()
    for queued in islice(pending, first, n):
        opened.read(queued)
    if not opened:
        return n
    left = budget
    for taken, queued in enumerate(islice(pending, n, None), start=n + 1):
        if queued.arrived > cutoff + reach or len(queued.markers) > left:
            break
        left -= len(queued.markers)
        opened.read(queued)
        if not opened:
            return taken
    return n


class _OpenStarts:
    """STARTs read and not settled by what was read after them, by lane and offset."""

    def __init__(self) -> None:
        #: v2: a RANGE_START's covered offsets not settled yet, as bits from its first offset
        self._ranges: dict[_OpenKey, int] = {}
        #: v1: STARTs not settled yet
        self._singles: set[_OpenKey] = set()

    def __bool__(self) -> bool:
        return bool(self._ranges or self._singles)

    def read(self, batch: PendingBatch) -> None:
        for pending in batch.markers:
            marker = pending.marker
            if type(marker) is RangeMarker:
                self._range(marker)
            else:
                self._single(cast(Marker, marker))

    def _range(self, marker: RangeMarker) -> None:
        kind = marker.kind
        if kind is RangeKind.RANGE_START:
            key = (marker.group, marker.topic, marker.partition, marker.first_offset)
            self._ranges[key] = marker.covered
        elif kind is RangeKind.RANGE_SETTLE and self._ranges:
            self._clear(
                marker.group, marker.topic, marker.partition, marker.first_offset, marker.covered
            )

    def _single(self, marker: Marker) -> None:
        kind = marker.kind
        key = entry_key(marker)
        if kind is MarkerKind.START:
            self._singles.add(key)
        elif kind in _V1_SETTLING:
            self._singles.discard(key)
            if self._ranges:
                self._clear(key[0], key[1], key[2], key[3], 1)

    def _clear(self, group: str, topic: str, partition: int, first: int, bits: int) -> None:
        """Clear ``bits`` (from offset ``first``) in every open range of the lane."""
        for key in _lane_keys(self._ranges, group, topic, partition):
            start = key[3]
            frame = bits << (first - start) if first >= start else bits >> (start - first)
            left = self._ranges[key] & ~frame
            if left:
                self._ranges[key] = left
            else:
                del self._ranges[key]


def _lane_keys(
    ranges: dict[_OpenKey, int], group: str, topic: str, partition: int
) -> Iterable[_OpenKey]:
    """The open ranges of one lane (a copy: the caller deletes as it goes)."""
    return [k for k in ranges if k[2] == partition and k[1] == topic and k[0] == group]
