"""Parked malformed markers: the newest records of the invalid-markers topic, and one in full.

The tracker parks every marker it refuses on ``invalid_markers_topic`` with why
(``kmq-invalid-*`` headers, see ``tracker/engine/parking.py``); the topic is the record, SQL
keeps none. The console reads its last records per partition through the API's bounded Kafka
reads, so the page answers within ``api_kafka_read_timeout`` even while Kafka is away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from tracker.headers import (
    INVALID_CATEGORY,
    INVALID_REASON,
    INVALID_SIZE,
    INVALID_SOURCE,
    INVALID_STUB,
    INVALID_TIMESTAMP,
)
from tracker.ids import MessageId
from tracker.kafka.original_records import OriginalRecord, OriginalsUnavailable

from ..context import ApiContext, not_served
from .render import hex_dump, printable

#: Newest parked records shown per partition of the invalid topic.
RECENT_PER_PARTITION = 25
#: Bytes of key and value shown in the listing (the record page shows up to the hex cap).
LISTING_BYTES = 32


@dataclass(frozen=True, slots=True)
class ParkedRecord:
    partition: int
    offset: int
    timestamp_ms: int
    reason: str
    category: str
    source: str  #: markers topic/partition/offset the refused record came from
    original_timestamp: str
    stub: str  #: why only a stub was parked (the broker refused the raw record), else ""
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, str]]

    @property
    def size(self) -> int:
        return len(self.key or b"") + len(self.value or b"")

    def key_dump(self) -> str:
        return hex_dump(self.key or b"")

    def value_dump(self) -> str:
        return hex_dump(self.value or b"")

    def glimpse(self) -> str:
        """The first bytes of the value as printable ASCII (dots for the rest)."""
        data = (self.value or b"")[:LISTING_BYTES]
        return printable(data) + ("…" if len(self.value or b"") > LISTING_BYTES else "")


@dataclass(frozen=True, slots=True)
class ParkedListing:
    topic: str
    records: list[ParkedRecord]  #: newest first
    total: int | None  #: records the topic keeps (None: unknown)
    error: str | None


def _text(headers: dict[str, bytes | None], name: str) -> str:
    value = headers.get(name)
    return value.decode("utf-8", "replace") if value is not None else ""


def _parked(partition: int, offset: int, record: OriginalRecord) -> ParkedRecord:
    headers = dict(record.headers)
    return ParkedRecord(
        partition=partition,
        offset=offset,
        timestamp_ms=record.timestamp_ms,
        reason=_text(headers, INVALID_REASON),
        category=_text(headers, INVALID_CATEGORY),
        source=_text(headers, INVALID_SOURCE),
        original_timestamp=_text(headers, INVALID_TIMESTAMP),
        stub=_text(headers, INVALID_STUB)
        + (f" ({_text(headers, INVALID_SIZE)} bytes)" if INVALID_SIZE in headers else ""),
        key=record.key,
        value=record.value,
        headers=[
            (name, value.decode("utf-8", "replace") if value is not None else "null")
            for name, value in record.headers
        ],
    )


async def recent_parked(context: ApiContext) -> ParkedListing:
    topic = context.settings.invalid_topic
    reads = context.reads
    scanner = reads.scanner

    async def read() -> tuple[list[ParkedRecord], int]:
        count = (await scanner.partition_counts([topic])).get(topic) or 0
        bounds = await scanner.bounds([TopicPartition(topic, p) for p in range(count)])
        ranges = {
            tp: (max(begin, end - RECENT_PER_PARTITION), end) for tp, (begin, end) in bounds.items()
        }
        found: list[ParkedRecord] = []

        def sink(record: Any) -> None:
            original = OriginalRecord(
                record.key, record.value, tuple(record.headers or ()), record.timestamp
            )
            found.append(_parked(record.partition, record.offset, original))

        await scanner.scan(ranges, sink)
        total = sum(end - begin for begin, end in bounds.values())
        return found, total

    try:
        records, total = await reads.history.run(("console", "parked"), read, reads.deadline())
    except OriginalsUnavailable as exc:
        return ParkedListing(topic, [], None, not_served(exc))
    records.sort(key=lambda r: (r.timestamp_ms, r.partition, r.offset), reverse=True)
    return ParkedListing(topic, records, total, None)


async def parked_record(context: ApiContext, partition: int, offset: int) -> ParkedRecord | None:
    target = MessageId(context.settings.invalid_topic, partition, offset)
    found = await context.reads.fetch(target, context.reads.deadline())
    if not isinstance(found, OriginalRecord):
        return None
    return _parked(partition, offset, found)
