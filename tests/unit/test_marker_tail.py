"""The message views' kept tail of the markers partitions (:class:`api.marker_tail.MarkerTail`).

A fake partition scanner (a list of records per partition, with a log start) counts what each
view reads: a view after another reads only the records written in between, and answers the
same window as a read from scratch would. The real scanner is exercised by the API tests on
the broker (``test_message_detail_with_payload_previews_and_marker_history``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from aiokafka import TopicPartition

from api import marker_tail
from api.marker_tail import MarkerTail
from tracker.kafka.original_records import OriginalsUnavailable
from tracker.kafka.scan import PartitionScanner, RecordSink

TOPIC = "markers"


@dataclass
class _Record:
    offset: int
    timestamp: int
    key: bytes
    value: bytes


@dataclass
class _FakeScanner:
    """Partitions as lists of records from ``begin``; counts the records each scan reads."""

    logs: dict[int, list[_Record]] = field(default_factory=dict)
    begins: dict[int, int] = field(default_factory=dict)
    scanned: list[tuple[int, int, int]] = field(default_factory=list)
    fail: bool = False

    bounds_calls: int = 0

    def write(self, partition: int, *keys: bytes) -> None:
        log = self.logs.setdefault(partition, [])
        for key in keys:
            offset = self.begins.get(partition, 0) + len(log)
            log.append(_Record(offset, 1000 + offset, key, b"marker-%d" % offset))

    def truncate(self, partition: int, begin: int) -> None:
        """Retention: records below ``begin`` are gone."""
        old = self.begins.get(partition, 0)
        self.logs[partition] = self.logs[partition][begin - old :]
        self.begins[partition] = begin

    def recreate(self, partition: int) -> None:
        self.logs[partition] = []
        self.begins[partition] = 0

    async def bounds(self, tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        if self.fail:
            raise OriginalsUnavailable("no broker")
        self.bounds_calls += 1
        out = {}
        for tp in tps:
            begin = self.begins.get(tp.partition, 0)
            out[tp] = (begin, begin + len(self.logs.get(tp.partition, [])))
        return out

    async def scan(
        self, ranges: Mapping[TopicPartition, tuple[int, int]], sink: RecordSink
    ) -> None:
        for tp, (start, end) in ranges.items():
            if end <= start:
                continue
            self.scanned.append((tp.partition, start, end))
            for record in self.logs.get(tp.partition, []):
                if start <= record.offset < end:
                    sink(record)

    async def read_to_end(self, tp: TopicPartition, start: int, sink: RecordSink) -> int:
        if self.fail:
            raise OriginalsUnavailable("no broker")
        begin = self.begins.get(tp.partition, 0)
        log = self.logs.get(tp.partition, [])
        end = begin + len(log)
        if end < start:
            return end
        if end > start:
            self.scanned.append((tp.partition, max(start, begin), end))
        for record in log:
            if record.offset >= start:
                sink(record)
        return end


def _tail(scanner: _FakeScanner, window: int, partitions: int = 4) -> MarkerTail:
    return MarkerTail(cast(PartitionScanner, scanner), TOPIC, window, partitions=partitions)


def _offsets(found: Any) -> list[int]:
    return [record[0] for record in found.records]


async def test_a_view_after_another_reads_only_the_new_records() -> None:
    scanner = _FakeScanner()
    scanner.write(0, b"a", b"b", b"a", b"c")
    tail = _tail(scanner, window=10)

    first = await tail.search(0, b"a")
    assert _offsets(first) == [0, 2]
    assert (first.first, first.end, first.complete) == (0, 4, True)
    assert first.records[0] == (0, 1000, b"a", b"marker-0")

    scanner.write(0, b"a", b"b")
    second = await tail.search(0, b"b")
    assert _offsets(second) == [1, 5]
    assert (second.first, second.end) == (0, 6)
    # The first view read the partition, the second only the two records written since.
    assert scanner.scanned == [(0, 0, 4), (0, 4, 6)]

    # Nothing new: nothing is read, the answer is the same window.
    again = await tail.search(0, b"a")
    assert _offsets(again) == [0, 2, 4]
    assert scanner.scanned == [(0, 0, 4), (0, 4, 6)]
    # Only the first view asked for the partition's offsets: the others read on to the end.
    assert scanner.bounds_calls == 1


async def test_a_partition_not_viewed_lately_is_read_from_its_offsets_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(marker_tail, "FRESH_S", 0.0)  # every view comes too late
    scanner = _FakeScanner()
    scanner.write(0, b"a", b"b")
    tail = _tail(scanner, window=10)
    await tail.search(0, b"a")
    scanner.write(0, b"a")
    found = await tail.search(0, b"a")
    assert _offsets(found) == [0, 2]
    assert scanner.bounds_calls == 2
    assert scanner.scanned == [(0, 0, 2), (0, 2, 3)]  # still only what is new


async def test_the_window_slides_and_says_whether_it_reaches_the_log_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scanner = _FakeScanner()
    scanner.write(0, *[b"a"] * 5)
    tail = _tail(scanner, window=4)

    found = await tail.search(0, b"a")
    assert _offsets(found) == [1, 2, 3, 4]
    assert (found.first, found.end, found.complete) == (1, 5, False)

    scanner.write(0, b"a", b"a")
    found = await tail.search(0, b"a")
    assert _offsets(found) == [3, 4, 5, 6]  # the same as a read from scratch
    assert scanner.scanned[-1] == (0, 5, 7)

    # Retention removed records inside the window. Read a moment ago, they are still shown
    # (they were written); the next time the log start is asked, the window starts there.
    scanner.truncate(0, 5)
    found = await tail.search(0, b"a")
    assert _offsets(found) == [3, 4, 5, 6]
    monkeypatch.setattr(marker_tail, "FRESH_S", 0.0)
    found = await tail.search(0, b"a")
    assert _offsets(found) == [5, 6]
    assert (found.first, found.end, found.complete) == (5, 7, True)


async def test_a_view_long_after_the_last_reads_the_window_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scanner = _FakeScanner()
    scanner.write(0, b"a", b"a")
    tail = _tail(scanner, window=3)
    await tail.search(0, b"a")
    scanner.write(0, *[b"a"] * 10)  # more than a window since the last view
    monkeypatch.setattr(marker_tail, "FRESH_S", 0.0)  # and it was a while ago

    found = await tail.search(0, b"a")
    assert _offsets(found) == [9, 10, 11]
    assert scanner.scanned[-1] == (0, 9, 12)  # not from 2: those records would be dropped


async def test_a_recreated_partition_is_read_afresh() -> None:
    scanner = _FakeScanner()
    scanner.write(0, b"a", b"a", b"a")
    tail = _tail(scanner, window=10)
    await tail.search(0, b"a")

    scanner.recreate(0)
    scanner.write(0, b"b")
    found = await tail.search(0, b"a")
    assert found.records == []  # nothing of the old partition is kept
    assert (found.first, found.end) == (0, 1)
    assert _offsets(await tail.search(0, b"b")) == [0]


async def test_a_failed_read_keeps_what_was_kept() -> None:
    scanner = _FakeScanner()
    scanner.write(0, b"a")
    tail = _tail(scanner, window=10)
    await tail.search(0, b"a")

    scanner.write(0, b"a")
    scanner.fail = True
    with pytest.raises(OriginalsUnavailable):
        await tail.search(0, b"a")
    scanner.fail = False
    assert _offsets(await tail.search(0, b"a")) == [0, 1]
    assert scanner.scanned == [(0, 0, 1), (0, 1, 2)]


async def test_memory_is_bounded_to_the_most_recently_viewed_partitions() -> None:
    scanner = _FakeScanner()
    for partition in range(3):
        scanner.write(partition, b"a", b"a")
    tail = _tail(scanner, window=10, partitions=2)

    await tail.search(0, b"a")
    await tail.search(1, b"a")
    await tail.search(0, b"a")  # 0 is now the most recently viewed
    await tail.search(2, b"a")  # drops 1, the least recently viewed
    assert tail.cached_partitions == 2
    scanner.scanned.clear()
    await tail.search(0, b"a")
    await tail.search(1, b"a")
    assert scanner.scanned == [(1, 0, 2)]  # 0 was kept, 1 read again


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        _tail(_FakeScanner(), window=0)
