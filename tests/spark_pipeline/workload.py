"""Workloads with known outcomes for the pipeline tests.

:class:`Script` writes markers and dead-letter records exactly as the tracker's clients do
(``encode_marker``, the markers partition of the origin, the tracker's DLQ headers) but with
chosen Kafka timestamps, so every duration in the expected ledger is known to the millisecond.
:func:`synthetic` builds one such workload covering every path of the ledger, with the rows it
must produce.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from support.broker import topic_partition_ids

from tracker import headers as h
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import Marker, encode_marker


@dataclass
class Record:
    topic: str
    partition: int
    timestamp_ms: int
    value: bytes | None
    key: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def dlq_headers(
    *,
    group: str,
    origin: MessageId,
    reason: str,
    attempts: int,
    first_seen_ms: int,
    at_ms: int,
    last_error: str = "",
    source: MessageId | None = None,
) -> list[tuple[str, bytes]]:
    """The headers the tracker puts on a dead letter (tracker/engine/redeliver.py)."""
    return [
        ("trace", b"abc"),
        (h.ORIGIN, str(origin).encode()),
        (h.GROUP, group.encode()),
        (h.FIRST_SEEN, str(first_seen_ms).encode()),
        (h.DLQ_REASON, reason.encode()),
        (h.DLQ_ATTEMPTS, str(attempts).encode()),
        (h.DLQ_FIRST_SEEN, str(first_seen_ms).encode()),
        (h.DLQ_AT, str(at_ms).encode()),
        (h.DLQ_LAST_ERROR, last_error.encode()),
        (h.DLQ_SOURCE, str(source or origin).encode()),
    ]


class Script:
    """Records to produce, in order (per partition that is their offset order)."""

    def __init__(self, markers_topic: str, markers_partitions: int) -> None:
        self.markers_topic = markers_topic
        self.partitions = markers_partitions
        self.records: list[Record] = []

    def marker(self, marker: Marker, at_ms: int) -> None:
        partition = markers_partition(marker.origin_topic, marker.origin_partition, self.partitions)
        self.records.append(
            Record(
                self.markers_topic,
                partition,
                at_ms,
                encode_marker(marker),
                marker_key(marker.origin_topic, marker.origin_partition),
            )
        )

    def raw_marker(self, value: bytes, at_ms: int, partition: int = 0) -> None:
        self.records.append(Record(self.markers_topic, partition, at_ms, value))

    def dead_letter(
        self,
        dlq_topic: str,
        *,
        at_ms: int,
        key: bytes | None = b"k",
        value: bytes = b"payload",
        headers: list[tuple[str, bytes]],
    ) -> None:
        self.records.append(Record(dlq_topic, 0, at_ms, value, key, headers))

    async def produce(self, bootstrap: str) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
        await producer.start()
        try:
            futures = [
                await producer.send(
                    r.topic,
                    value=r.value,
                    key=r.key,
                    partition=r.partition,
                    timestamp_ms=r.timestamp_ms,
                    headers=r.headers,
                )
                for r in self.records
            ]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        self.records = []


async def read_topic(
    bootstrap: str, topic: str, *, start: dict[int, int] | None = None
) -> list[Any]:
    """Every record of ``topic`` (from ``start`` offsets), read to the high watermark."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partition_ids(bootstrap, topic)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, (start or {}).get(tp.partition, 0))
        records: list[Any] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            for part in batch.values():
                records.extend(part)
            highwater = [consumer.highwater(tp) for tp in tps]
            positions = [await consumer.position(tp) for tp in tps]
            if None not in highwater and positions == highwater:
                return records
            assert loop.time() < deadline, f"could not read {topic} to its end"
    finally:
        await consumer.stop()


async def high_watermarks(bootstrap: str, topic: str) -> dict[int, int]:
    """``partition -> end offset`` from a fetch response (not ListOffsets; see testing.md)."""
    records = await read_topic(bootstrap, topic)
    ends: dict[int, int] = {}
    for r in records:
        ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)
    return ends


# --------------------------------------------------------------------------------------------
# The synthetic workload: every ledger path, with its expected rows


@dataclass(frozen=True)
class Expected:
    """The ledger columns a test checks for one message."""

    group: str
    offset: int  #: origin offset on partition 0 of the queue topic
    final_state: str
    attempts: int
    outcomes: tuple[str, ...]
    processing: tuple[int | None, ...]
    pending: str | None = None
    total_delay_ms: int | None = None
    end_to_end_ms: int | None = None
    last_reason: str | None = None
    dlq_reason: str | None = None


GROUP = "billing"
OTHER_GROUP = "audit-svc"
MINUTE = 60_000
HOUR = 3_600_000

#: Ledger parameters the synthetic expectations assume.
DEFAULT_TIMEOUT_MS = 60_000
GRACE_MS = MINUTE
STUCK_AFTER_MS = HOUR


def synthetic(
    script: Script, topic: str, as_of_ms: int, *, only: Sequence[int] | None = None
) -> list[Expected]:
    """Add the synthetic workload to ``script``; returns the rows the ledger must have.

    ``only`` restricts it to some scenarios (by number) for incremental tests.
    """
    dlq = f"{topic}.dlq"
    base = as_of_ms - HOUR
    out: list[Expected] = []

    def origin(n: int) -> MessageId:
        return MessageId(topic, 0, n)

    def copy(n: int, attempt: int) -> MessageId:
        return MessageId(topic, 1, 100 * n + attempt)

    def wanted(n: int) -> bool:
        return only is None or n in only

    m = script.marker
    if wanted(0):  # acked at once
        m(Marker.start(GROUP, origin(0), timeout_ms=30_000, consumer="w1"), base)
        m(Marker.ack(GROUP, origin(0)), base + 120)
        out.append(Expected(GROUP, 0, "acked", 1, ("acked",), (120,), end_to_end_ms=120))
        # The same message for another group is another logical message.
        m(Marker.start(OTHER_GROUP, origin(0), timeout_ms=30_000), base + 50)
        m(Marker.ack(OTHER_GROUP, origin(0)), base + 80)
        out.append(Expected(OTHER_GROUP, 0, "acked", 1, ("acked",), (30,), end_to_end_ms=30))
    if wanted(1):  # retried with a delay, then acked
        t = base + 1000
        m(Marker.start(GROUP, origin(1), timeout_ms=30_000), t)
        m(Marker.delay(GROUP, origin(1), delay_ms=2000, reason="busy"), t + 50)
        c = copy(1, 2)
        m(Marker.start(GROUP, c, attempt=2, origin=origin(1), timeout_ms=30_000), t + 2100)
        m(Marker.ack(GROUP, c, attempt=2, origin=origin(1)), t + 2400)
        out.append(
            Expected(
                GROUP,
                1,
                "acked",
                2,
                ("retried", "acked"),
                (50, 300),
                total_delay_ms=2000,
                end_to_end_ms=2400,
                last_reason="busy",
            )
        )
    if wanted(2):  # lease expired, redelivered, acked
        t = base + 5000
        m(Marker.start(GROUP, origin(2), timeout_ms=1000), t)
        c = copy(2, 2)
        m(Marker.start(GROUP, c, attempt=2, origin=origin(2), timeout_ms=1000), t + 1500)
        m(Marker.ack(GROUP, c, attempt=2, origin=origin(2)), t + 1600)
        out.append(
            Expected(GROUP, 2, "acked", 2, ("timed_out", "acked"), (None, 100), end_to_end_ms=1600)
        )
    if wanted(3):  # rejected, dead-lettered
        t = base + 7000
        m(Marker.start(GROUP, origin(3), timeout_ms=30_000), t)
        m(Marker.reject(GROUP, origin(3), reason="bad json"), t + 10)
        script.dead_letter(
            dlq,
            at_ms=t + 500,
            headers=dlq_headers(
                group=GROUP,
                origin=origin(3),
                reason="rejected by the consumer: bad json",
                attempts=1,
                first_seen_ms=t,
                at_ms=t + 500,
                last_error="bad json",
            ),
        )
        out.append(
            Expected(
                GROUP,
                3,
                "dead_lettered",
                1,
                ("rejected",),
                (10,),
                end_to_end_ms=500,
                last_reason="bad json",
                dlq_reason="rejected by the consumer: bad json",
            )
        )
    if wanted(4):  # retried until max attempts, dead-lettered
        t = base + 8000
        m(Marker.start(GROUP, origin(4), timeout_ms=30_000), t)
        m(Marker.delay(GROUP, origin(4), delay_ms=None, reason="flaky"), t + 10)
        c = copy(4, 2)
        m(Marker.start(GROUP, c, attempt=2, origin=origin(4), timeout_ms=30_000), t + 1000)
        m(
            Marker.delay(GROUP, c, attempt=2, origin=origin(4), delay_ms=500, reason="flakier"),
            t + 1020,
        )
        reason = "max attempts reached (2 of 2; last: retried)"
        script.dead_letter(
            dlq,
            at_ms=t + 1600,
            headers=dlq_headers(
                group=GROUP,
                origin=origin(4),
                reason=reason,
                attempts=2,
                first_seen_ms=t,
                at_ms=t + 1600,
                last_error="flakier",
                source=c,
            ),
        )
        out.append(
            Expected(
                GROUP,
                4,
                "dead_lettered",
                2,
                ("retried", "retried"),
                (10, 20),
                total_delay_ms=500,
                end_to_end_ms=1600,
                last_reason="flakier",
                dlq_reason=reason,
            )
        )
    if wanted(5):  # in flight
        m(Marker.start(GROUP, origin(5), timeout_ms=30_000), as_of_ms - 5000)
        out.append(Expected(GROUP, 5, "in_flight", 1, ("open",), (None,), pending="processing"))
    if wanted(6):  # overdue by 10 minutes: stuck
        m(Marker.start(GROUP, origin(6), timeout_ms=1000), as_of_ms - 10 * MINUTE)
        out.append(Expected(GROUP, 6, "stuck", 1, ("open",), (None,), pending="processing"))
    if wanted(7):  # overdue by 2 hours: lost
        m(Marker.start(GROUP, origin(7), timeout_ms=1000), as_of_ms - 2 * HOUR)
        out.append(Expected(GROUP, 7, "lost", 1, ("open",), (None,), pending="processing"))
    if wanted(8):  # timeout 0: the topic policy (the ledger's default timeout, 60 s)
        m(Marker.start(GROUP, origin(8)), as_of_ms - 20_000)
        out.append(Expected(GROUP, 8, "in_flight", 1, ("open",), (None,), pending="processing"))
    if wanted(9):  # a short lease, renewed: in flight, not stuck
        m(Marker.start(GROUP, origin(9), timeout_ms=1000), as_of_ms - 120_000)
        m(Marker.extend(GROUP, origin(9), timeout_ms=600_000), as_of_ms - 119_000)
        out.append(Expected(GROUP, 9, "in_flight", 1, ("open",), (None,), pending="processing"))
    if wanted(10):  # a delayed message read early (deferred), delivered when due, acked
        t = base + 10_000
        m(Marker.delay(GROUP, origin(10), delay_ms=3000, reason="deliver-at", deferred=True), t)
        c = copy(10, 1)
        m(Marker.start(GROUP, c, origin=origin(10), timeout_ms=30_000), t + 3050)
        m(Marker.ack(GROUP, c, origin=origin(10)), t + 3100)
        out.append(Expected(GROUP, 10, "acked", 1, ("acked",), (50,), end_to_end_ms=50))
    if wanted(11):  # rejected a moment ago, DLQ record not written yet: in flight
        m(Marker.start(GROUP, origin(11), timeout_ms=30_000), as_of_ms - 10_000)
        m(Marker.reject(GROUP, origin(11), reason="nope"), as_of_ms - 9000)
        out.append(
            Expected(
                GROUP,
                11,
                "in_flight",
                1,
                ("rejected",),
                (1000,),
                pending="dead_letter",
                last_reason="nope",
            )
        )
    if wanted(12):  # rejected 30 minutes ago and never dead-lettered: stuck
        m(Marker.start(GROUP, origin(12), timeout_ms=30_000), as_of_ms - 30 * MINUTE)
        m(Marker.reject(GROUP, origin(12), reason="nope"), as_of_ms - 30 * MINUTE + 10)
        out.append(
            Expected(
                GROUP,
                12,
                "stuck",
                1,
                ("rejected",),
                (10,),
                pending="dead_letter",
                last_reason="nope",
            )
        )
    if wanted(13):  # a retry due in ten minutes: in flight
        m(Marker.start(GROUP, origin(13), timeout_ms=30_000), as_of_ms - 5000)
        m(Marker.delay(GROUP, origin(13), delay_ms=10 * MINUTE, reason="later"), as_of_ms - 4000)
        out.append(
            Expected(
                GROUP,
                13,
                "in_flight",
                1,
                ("retried",),
                (1000,),
                pending="redelivery",
                total_delay_ms=10 * MINUTE,
                last_reason="later",
            )
        )
    if wanted(14):  # noise: a refused marker, a foreign DLQ record, an orphan dead letter
        script.raw_marker(b"\x09 not a marker", base)
        script.dead_letter(dlq, at_ms=base, headers=[("x", b"1")])
        script.dead_letter(
            dlq,
            at_ms=base,
            headers=dlq_headers(
                group=GROUP,
                origin=MessageId(topic, 0, 999),
                reason="rejected",
                attempts=1,
                first_seen_ms=base,
                at_ms=base,
            ),
        )
    return out


#: The scenarios whose chain is broken at the synthetic as-of (stuck or lost).
BROKEN = {6: "stuck", 7: "lost", 12: "stuck"}
