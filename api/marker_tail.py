"""The last records of the markers partitions, kept between message views.

The message view searches the last ``api_marker_history_scan`` records of a message's markers
partition for that message's markers (the markers topic is the history; SQL keeps none). Read
afresh for every view, that is the whole window (5,000 records by default) fetched and decoded
into aiokafka's per-record objects each time: the CPU of the view under load, spent again on
the same records for every message of the partition and every refresh of a page.

A :class:`MarkerTail` keeps each viewed partition's window as compact tuples and, on the next
view, reads only the records written since the previous one. A room of operators refreshing
message pages costs the broker the markers written in the meantime, not a window per view; a
partition viewed a moment ago is read on in a single fetch, its end taken from the response.
What a view answers is unchanged: the window ends at the partition's end as a fetch reports it
at the time of the view (so a marker an operator's action just wrote is in it).

Memory is bounded: at most ``window`` records for each of ``partitions`` partitions, the least
recently viewed dropped first. A partition not viewed within ``FRESH_S`` is read from its
offsets again (only its last window, however much was written since), as is one whose end went
backwards (the topic was deleted and created again).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from tracker.kafka.scan import PartitionScanner

#: Partitions kept at most: ~1 MB each at the default window of 5,000 markers.
DEFAULT_PARTITIONS = 16

#: A partition viewed within this many seconds is read on from where the last view ended, in
#: one fetch; one viewed longer ago is read from its offsets again (its log start, its end),
#: so a view after a long pause does not read everything written meanwhile.
FRESH_S = 5.0

#: ``(offset, timestamp, key, value)`` of one record of a markers partition.
TailRecord = tuple[int, int | None, bytes | None, bytes | None]


@dataclass(frozen=True)
class TailMatches:
    """The records of a window that have the asked key, and the window itself."""

    records: list[TailRecord]
    #: The window: offsets ``first <= offset < end`` were searched.
    first: int
    end: int
    #: The window starts at the partition's log start: no older record exists.
    complete: bool


class _PartitionTail:
    __slots__ = ("begin", "end", "lock", "read_at", "records")

    def __init__(self) -> None:
        self.records: deque[TailRecord] = deque()
        #: The offset after the last record read (-1: nothing read yet).
        self.end = -1
        #: The partition's log start when last asked.
        self.begin = 0
        #: When the last read ended (loop time).
        self.read_at = 0.0
        #: One read of a partition at a time: two views of it read the new records once.
        self.lock = asyncio.Lock()


class MarkerTail:
    """The last ``window`` records of each viewed partition of ``topic``, read incrementally."""

    def __init__(
        self,
        scanner: PartitionScanner,
        topic: str,
        window: int,
        *,
        partitions: int = DEFAULT_PARTITIONS,
    ) -> None:
        if window <= 0 or partitions <= 0:
            raise ValueError(f"window and partitions must be positive, not {window}, {partitions}")
        self.topic = topic
        self.window = window
        self._scanner = scanner
        self._limit = partitions
        self._tails: OrderedDict[int, _PartitionTail] = OrderedDict()

    @property
    def cached_partitions(self) -> int:
        return len(self._tails)

    def _tail(self, partition: int) -> _PartitionTail:
        tail = self._tails.get(partition)
        if tail is None:
            tail = self._tails[partition] = _PartitionTail()
            while len(self._tails) > self._limit:
                # A view still reading an evicted tail finishes with it; it is just not kept.
                self._tails.popitem(last=False)
        else:
            self._tails.move_to_end(partition)
        return tail

    async def search(self, partition: int, key: bytes) -> TailMatches:
        """The records with ``key`` among the last ``window`` of ``partition``, up to its end.

        Raises :class:`~tracker.kafka.original_records.OriginalsUnavailable` when Kafka does not
        answer; what was kept stays as it was.
        """
        tail = self._tail(partition)
        async with tail.lock:
            tp = TopicPartition(self.topic, partition)
            read: list[TailRecord] = []

            def keep(record: Any) -> None:
                read.append((record.offset, record.timestamp, record.key, record.value))

            loop = asyncio.get_running_loop()
            end = -1
            warm = tail.end >= 0 and loop.time() - tail.read_at < FRESH_S
            if warm:
                # Viewed a moment ago: one fetch from there to the end, no offset requests.
                end = await self._scanner.read_to_end(tp, tail.end, keep)
            if not warm or end < tail.end:
                # Nothing kept (or not lately), or a partition that restarted.
                read.clear()
                begin, end = (await self._scanner.bounds([tp]))[tp]
                tail.begin = begin
                start = max(begin, end - self.window)
                if not start <= tail.end <= end:
                    tail.records.clear()
                else:
                    start = tail.end
                await self._scanner.scan({tp: (start, end)}, keep)
            first = max(tail.begin, end - self.window)
            records = tail.records
            records.extend(read)
            tail.end = end
            tail.read_at = loop.time()
            while records and records[0][0] < first:
                records.popleft()
            found = [record for record in records if record[2] == key]
        # The log start as last asked: retention only moves it up, and the records it removed
        # since were read before, so the window still reaches back as far as it says.
        return TailMatches(found, first, end, complete=first <= tail.begin)
