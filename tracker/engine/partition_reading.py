"""What ingest keeps per markers partition it owns, and what one poll read of it.

A :class:`PartitionReading` lives as long as this replica owns its partition: the markers read
and still in the coalescing window (queued per polled batch, as :class:`PendingBatch`), how
far the partition was read and how far the store has it applied, and the broker ends its safe
horizon waits for. It is apart from ``tracker.engine.ingest`` because several parts share it:
ownership creates and drops it (``tracker.engine.markers_ownership``), the flush takes markers
from it (``tracker.engine.marker_flush``) and the fetch responses advance its horizon
(``tracker.engine.fetch_responses``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tracker.engine.fetch_responses import MAX_ENDS
from tracker.engine.parking import Rejected
from tracker.store.port import PendingMarker


@dataclass(eq=False, slots=True)
class PendingBatch:
    """The valid markers of one polled batch of one partition, in offset order, never empty.

    The window queues and releases whole batches: every marker of a batch arrived at the same
    moment, so a flush takes all of a batch or none of it. Queuing a marker costs nothing of
    its own, and a flush takes a batch's markers with one list extend (docs/benchmarks.md,
    change 37). Compared by identity: the coalescing index keeps a set of them.
    """

    arrived: float  #: ``time.monotonic()`` when the batch was read
    markers: list[PendingMarker]


@dataclass(slots=True)
class PartitionReading:
    """What a replica knows about one markers partition it owns."""

    epoch: int
    pending: deque[PendingBatch] = field(default_factory=deque)
    pending_markers: int = 0  #: how many markers the batches in ``pending`` hold
    seen_next: int | None = None  #: offset after the last record read
    applied_next: int | None = None  #: offset recorded in the store by the last flush
    #: tracker-clock time at which we had read everything the broker had (None: not yet)
    caught_up_ms: int | None = None
    #: (high watermark, wall-clock ms of the fetch response that reported it), oldest first:
    #: the broker's end at moments we have not read up to yet
    ends: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_ENDS))


@dataclass(frozen=True, slots=True)
class SortedRecords:
    """One partition's fetched records, sorted into markers to apply and records to refuse."""

    partition: int
    state: PartitionReading
    records: list[Any]
    arrived: float  #: ``time.monotonic()`` when they were sorted
    accepted: list[PendingMarker]
    rejected: list[Rejected]
