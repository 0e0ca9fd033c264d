"""Which fetched marker records ingest applies and which it refuses, and why.

A record is refused (and parked by ``tracker.engine.parking``) when it does not decode
(``malformed``), when a topic it names does not exist (``unknown_topic``, asked of the
:class:`MarkerCheck`), or when it is not on its origin's markers partition
(:data:`WRONG_PARTITION`). Every other marker is accepted, stamped with the time its
durations count from, and queued by ``tracker.engine.ingest`` for the coalescing window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from tracker.clock import Clock, to_millis
from tracker.engine.parking import Rejected
from tracker.engine.record_decoding import sort_records
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import AnyMarker
from tracker.store.port import PendingMarker

#: Category (``kmq_markers_invalid_total`` reason) of a marker not on its origin's partition.
WRONG_PARTITION = "wrong_partition"


class MarkerCheck(Protocol):
    """Checks decoded markers beyond the wire format (do their topics exist?)."""

    async def prepare(self, topics: Iterable[str]) -> None: ...

    def check(self, marker: AnyMarker) -> str | None: ...


class MarkerSorter:
    """Sorts one markers partition's fetched records into markers to apply and to refuse."""

    def __init__(
        self, *, consumer: Any, markers_topic: str, clock: Clock, check: MarkerCheck | None
    ) -> None:
        self._consumer = consumer
        self._topic = markers_topic
        self._clock = clock
        self._check = check

    async def sort(
        self, partition: int, records: list[Any]
    ) -> tuple[list[PendingMarker], list[Rejected]]:
        """Decode and check one partition's records: what to apply, what to refuse.

        Each distinct where (topics and partitions a marker names) is checked once, not each
        marker: a batch names few, and one refused where is the rare case that looks at the
        markers one by one.
        """
        decoded = sort_records(records, partition, to_millis(self._clock.now()))
        rejected: list[Rejected] = [
            Rejected(records[i], why, "malformed") for i, why in decoded.errors
        ]
        if self._check is not None and decoded.wheres:
            await self._check.prepare({t for w in decoded.wheres for t in (w[0], w[2])})
        total = self._markers_partitions()
        verdicts = [self._verdict(marker, partition, total) for marker in decoded.samples]
        if all(verdict is None for verdict in verdicts):
            return decoded.accepted, rejected
        accepted: list[PendingMarker] = []
        for pending, where, index in zip(
            decoded.accepted, decoded.where_of, decoded.record_indexes(), strict=True
        ):
            verdict = verdicts[where]
            if verdict is None:
                accepted.append(pending)
            else:
                rejected.append(Rejected(records[index], verdict[1], verdict[0]))
        return accepted, rejected

    def _markers_partitions(self) -> int:
        """How many partitions the markers topic has (the consumer's metadata; 0: unknown)."""
        return len(self._consumer.partitions_for_topic(self._topic) or ())

    def _verdict(self, marker: AnyMarker, partition: int, total: int) -> tuple[str, str] | None:
        """``(category, reason)`` if ``marker``, read on ``partition``, must be refused.

        A marker must sit on its origin's markers partition (docs/protocol.md, "The marker
        record"): only there is it ordered against that origin's other markers, and only there
        is the entry it writes filed under the partition whose owner fences and redelivers it.
        One on another partition is refused like a malformed one, whatever its kind (why:
        docs/protocol.md, "A marker on the wrong partition"). Metadata that does not know
        ``partition`` yet is stale (the topic just grew): nothing is refused for its partition
        until it is refreshed.
        """
        if self._check is not None:
            why = self._check.check(marker)
            if why is not None:
                return "unknown_topic", why
        if partition < total:
            expected = markers_partition(marker.origin_topic, marker.origin_partition, total)
            if expected != partition:
                key = marker_key(marker.origin_topic, marker.origin_partition).decode()
                return WRONG_PARTITION, (
                    f"on markers partition {partition}, but the markers of origin "
                    f"{marker.origin_topic}/{marker.origin_partition} belong on partition "
                    f"{expected} of {total} (murmur2 of the key {key!r}): it cannot be ordered "
                    "against that origin's other markers"
                )
        return None
