"""The tracker reading range markers (protocol v2) end to end: real broker, SQLite and PostgreSQL.

The markers are written here byte for byte (``encode_any`` on the origin's markers partition,
as any writer must), so these tests hold whatever the Python client does.
"""

from __future__ import annotations

import struct

import pytest
from aiokafka import AIOKafkaProducer
from support.broker import topic_partition_ids

from tracker import headers as h
from tracker.client import KmqProducer
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import AnyMarker, Marker, encode_any
from tracker.protocol_v2 import RangeMarker

from .engine_support import TopicWatcher, eventually
from .test_engine import copies, env, running_tracker

pytestmark = [pytest.mark.integration]

__all__ = ["env"]  # the fixture, shared with test_engine


async def _write(raw: AIOKafkaProducer, markers_topic: str, items: list[AnyMarker]) -> None:
    for marker in items:
        await raw.send_and_wait(
            markers_topic,
            encode_any(marker),
            key=marker_key(marker.origin_topic, marker.origin_partition),
            partition=markers_partition(marker.origin_topic, marker.origin_partition, 4),
        )


async def test_an_expired_range_redelivers_exactly_its_unsettled_offsets(
    env: dict[str, str],
) -> None:
    topic, markers, group = env["topic"], env["markers"], env["group"]
    raw = AIOKafkaProducer(bootstrap_servers=env["bootstrap"], acks="all")
    await raw.start()
    try:
        async with (
            running_tracker(env) as tracker,
            KmqProducer(env["bootstrap"]) as producer,
            TopicWatcher(env["bootstrap"], topic) as watcher,
        ):
            sent = [await producer.send(topic, f"job-{i}".encode(), partition=0) for i in range(20)]
            first, last = sent[0].offset, sent[-1].offset
            assert last - first == 19
            not_acked = {first + 3, first + 11, first + 19}
            retried = first + 7
            exceptions = sum(1 << (o - first) for o in (*not_acked, retried))
            await _write(
                raw,
                markers,
                [
                    RangeMarker.start(group, topic, 0, first, last, timeout_ms=1_500, consumer="c"),
                    Marker.delay(group, MessageId(topic, 0, retried), delay_ms=500, reason="later"),
                    RangeMarker.settle(group, topic, 0, first, last, exceptions=exceptions),
                ],
            )
            await watcher.wait_for(
                lambda _: len(copies(watcher, topic)) >= 4, what="4 copies (3 expired, 1 retry)"
            )
            made = copies(watcher, topic)
            assert sorted(int((c.header(h.ORIGIN) or b"").split(b"/")[2]) for c in made) == sorted(
                [*not_acked, retried]
            )
            assert {c.header(h.ATTEMPT) for c in made} == {b"2"}

            async def nothing_left() -> bool:
                return not await tracker.store.list_entries(group=group)

            # Every copy is out and nothing is tracked any more (the copies have no consumer
            # yet): the 16 acked offsets can never come back.
            await eventually(nothing_left, what="no entry and no range left")
            assert await tracker.store.list_ranges() == []
            assert len(copies(watcher, topic)) == 4
    finally:
        await raw.stop()


_BAD_V2 = {
    "reversed range": (struct.pack(">BBBiqqH", 2, 2, 0, 0, 10, 9, 6) + b"orders" + b"\x00\x01g"),
    "absurd width": (
        struct.pack(">BBBiqqH", 2, 2, 0, 0, 0, 10_000_000, 6) + b"orders" + b"\x00\x01g"
    ),
    "exceptions longer than the range": (
        struct.pack(">BBBiqqH", 2, 2, 1, 0, 0, 7, 6)
        + b"orders"
        + b"\x00\x01g"
        + struct.pack(">I", 2)
        + b"\x01\x00"
    ),
    "unknown version": b"\x07" + bytes(40),
    "truncated": encode_any(RangeMarker.start("g", "orders", 0, 0, 9, consumer="c"))[:-3],
}


async def test_malformed_range_markers_are_parked_and_never_stall_valid_ones(
    env: dict[str, str],
) -> None:
    topic, markers, group = env["topic"], env["markers"], env["group"]
    invalid = f"{markers}.invalid"
    raw = AIOKafkaProducer(bootstrap_servers=env["bootstrap"], acks="all")
    await raw.start()
    try:
        async with (
            running_tracker(env) as tracker,
            KmqProducer(env["bootstrap"]) as producer,
        ):
            partitions = await topic_partition_ids(env["bootstrap"], markers)
            for i, junk in enumerate(_BAD_V2.values()):
                await raw.send_and_wait(markers, junk, partition=partitions[i % len(partitions)])
            sent = [await producer.send(topic, b"x", partition=1) for _ in range(5)]
            first, last = sent[0].offset, sent[-1].offset
            await _write(
                raw, markers, [RangeMarker.start(group, topic, 1, first, last, timeout_ms=60_000)]
            )

            async def tracked() -> bool:
                return len(await tracker.store.list_entries(group=group)) == 5

            await eventually(tracked, what="the 5 valid offsets in flight")
            async with TopicWatcher(env["bootstrap"], invalid) as parked:
                await parked.wait_for(lambda r: len(r) == len(_BAD_V2), what="every bad record")
            assert tracker.metrics.markers_invalid.labels("malformed")._value.get() == len(_BAD_V2)
    finally:
        await raw.stop()
    reasons = sorted((r.header("kmq-invalid-reason") or b"").decode() for r in parked.records)
    assert any("before first offset" in why for why in reasons), reasons
    assert any("wider than" in why for why in reasons), reasons
    assert any("bitmap" in why for why in reasons), reasons
    assert any("unsupported marker version 7" in why for why in reasons), reasons
    assert any("truncated" in why for why in reasons), reasons
