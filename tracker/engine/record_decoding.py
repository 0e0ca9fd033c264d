"""One markers partition's fetched records, decoded in one pass into markers to apply.

Ingest's acked path costs about what a raw read of the markers topic costs only if nothing
after the fetch does work per record that can be done per batch. Per record, all that is
needed is the marker, its reference time and its position; whether a marker may be applied
(its topics exist, it sits on its origin's markers partition) depends only on *where* it
points, and a fetched batch names few wheres (one, mostly). So the pass returns each distinct
where once, and the caller checks those, not every marker
(``tracker.engine.marker_verdicts``).

The C extension (``tracker/_speedups.c`` ``sort_records``) does the pass without a Python
object per record beyond the marker and its :class:`PendingMarker`; :func:`py_sort_records`
is the reference it must agree with (``tests/unit/test_record_decoding.py``), used when the
extension is not built.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tracker.protocol import AnyMarker, c_sort_records, decode_batch
from tracker.store.port import PendingMarker

#: Where a marker points: (topic, partition, origin topic, origin partition).
Where = tuple[str, int, str, int]


@dataclass(frozen=True, slots=True)
class DecodedRecords:
    """What one pass over a partition's fetched records found."""

    accepted: list[PendingMarker]  #: every record that decoded, in record order
    errors: list[tuple[int, str]]  #: (record index, why) of each record that did not
    wheres: list[Where]  #: the distinct wheres of ``accepted``, in the order first seen
    samples: list[AnyMarker]  #: the first marker of each where (what a check looks at)
    where_of: Sequence[int]  #: per accepted marker, the index of its where in ``wheres``

    def record_indexes(self) -> list[int]:
        """Per accepted marker, the index of its record (those not in ``errors``)."""
        refused = {i for i, _ in self.errors}
        total = len(self.accepted) + len(refused)
        return [i for i in range(total) if i not in refused]


def marker_where(marker: AnyMarker) -> Where:
    return (marker.topic, marker.partition, marker.origin_topic, marker.origin_partition)


def py_sort_records(records: Sequence[Any], markers_partition: int, now_ms: int) -> DecodedRecords:
    """The reference pass: decode ``records`` (aiokafka ``ConsumerRecord``s) of one markers
    partition; a reference time in the future or unknown counts as ``now_ms``."""
    decoded = decode_batch([r.value for r in records])
    accepted: list[PendingMarker] = []
    wheres: dict[Where, int] = {}
    samples: list[AnyMarker] = []
    ids = array("i")
    for record, marker in zip(records, decoded.markers, strict=True):
        if marker is None:
            continue
        where = marker_where(marker)
        known = wheres.get(where)
        if known is None:
            known = wheres[where] = len(wheres)
            samples.append(marker)
        ids.append(known)
        # Durations count from the record's timestamp, but never from the future: a writer
        # whose clock runs ahead must not make us redeliver early.
        ts = record.timestamp
        ref_ms = now_ms if ts < 0 or ts > now_ms else ts
        accepted.append(PendingMarker(marker, ref_ms, markers_partition, record.offset))
    return DecodedRecords(accepted, decoded.errors, list(wheres), samples, ids)


def _c_sort_records() -> Callable[[Sequence[Any], int, int], DecodedRecords] | None:
    sort = c_sort_records
    if sort is None:
        return None

    def sort_in_c(records: Sequence[Any], markers_partition: int, now_ms: int) -> DecodedRecords:
        accepted, errors, wheres, samples, ids = sort(
            records, markers_partition, now_ms, PendingMarker
        )
        return DecodedRecords(accepted, errors, wheres, samples, memoryview(ids).cast("i"))

    return sort_in_c


#: The pass ingest runs: the C one when the extension is built, else the reference.
sort_records: Callable[[Sequence[Any], int, int], DecodedRecords] = (
    _c_sort_records() or py_sort_records
)
