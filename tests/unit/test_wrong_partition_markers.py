"""Ingest refuses a marker that is not on its origin's markers partition (docs/protocol.md).

``MarkerIngest._sort`` is the step that splits a partition's fetched records into markers to
apply and records to park; these tests drive it with hand-made records, without a broker.
The end-to-end behaviour (parked, counted, visible in the API) is in
``tests/integration/test_wrong_partition_markers.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

import tracker.engine.marker_verdicts as verdicts_module
from tracker.clock import ManualClock
from tracker.engine.ingest import MarkerIngest
from tracker.engine.marker_verdicts import WRONG_PARTITION
from tracker.engine.partition_reading import PartitionReading
from tracker.ids import MessageId
from tracker.metrics import Metrics
from tracker.partitioning import markers_partition
from tracker.protocol import Marker, encode_marker

pytestmark = pytest.mark.unit

TOPIC = "markers"
PARTITIONS = 4


@dataclass(frozen=True)
class Record:
    """What ingest reads of a consumed record."""

    partition: int
    offset: int
    value: bytes | None
    timestamp: int = 1_700_000_000_000
    key: bytes | None = None


class MetadataOnly:
    """A consumer that only knows the markers topic's partitions (``None``: no metadata)."""

    def __init__(self, partitions: int | None) -> None:
        self._partitions = partitions

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        assert topic == TOPIC
        return None if self._partitions is None else set(range(self._partitions))


class NoSuchTopic:
    """A topic catalog that knows every topic but ``missing``."""

    def __init__(self, missing: str) -> None:
        self.missing = missing

    async def prepare(self, topics: Iterable[str]) -> None:
        return None

    def check(self, marker: Marker) -> str | None:
        if self.missing in (marker.topic, marker.origin_topic):
            return f"topic {self.missing!r} does not exist"
        return None


def ingest_with(consumer: Any, check: Any = None) -> MarkerIngest:
    return MarkerIngest(
        consumer=consumer,
        store=None,  # type: ignore[arg-type]  # not reached: nothing is flushed
        parker=None,  # type: ignore[arg-type]
        markers_topic=TOPIC,
        replica_id="r",
        policy_for=lambda _topic: None,  # type: ignore[arg-type,return-value]
        clock=ManualClock(datetime(2026, 1, 1, tzinfo=UTC)),
        metrics=Metrics(),
        coalesce_window=0.5,
        ack_grace_ms=0,
        max_records=1000,
        max_pending=1000,
        check_marker=check,
    )


def right_and_wrong(topic: str, partition: int, partitions: int = PARTITIONS) -> tuple[int, int]:
    right = markers_partition(topic, partition, partitions)
    return right, (right + 1) % partitions


async def sort(
    ingest: MarkerIngest, partition: int, values: list[bytes | None]
) -> tuple[list[Marker], list[tuple[str, str, int]]]:
    """``(markers accepted, (category, reason, offset) of each refused record)``."""
    records = [Record(partition, offset, value) for offset, value in enumerate(values)]
    out = await ingest._sort(partition, PartitionReading(epoch=1), records)
    accepted = [pending.marker for pending in out.accepted if isinstance(pending.marker, Marker)]
    rejected = [(r.category, r.reason, r.record.offset) for r in out.rejected]
    return accepted, rejected


async def test_markers_of_any_kind_on_another_partition_are_refused_with_where_they_belong() -> (
    None
):
    ingest = ingest_with(MetadataOnly(PARTITIONS))
    right, wrong = right_and_wrong("orders", 1)
    message = MessageId("orders", 1, 42)
    markers = [
        Marker.start("billing", message, timeout_ms=30_000),
        Marker.extend("billing", message, timeout_ms=60_000),
        Marker.delay("billing", message, delay_ms=1000, reason="busy"),
        Marker.reject("billing", message, reason="poison"),
        Marker.ack("billing", message),
    ]
    values: list[bytes | None] = [encode_marker(m) for m in markers]

    accepted, rejected = await sort(ingest, right, values)
    assert accepted == markers
    assert rejected == []

    accepted, rejected = await sort(ingest, wrong, values)
    assert accepted == []
    assert [(category, offset) for category, _, offset in rejected] == [
        (WRONG_PARTITION, offset) for offset in range(len(markers))
    ]
    why = rejected[0][1]
    assert f"on markers partition {wrong}" in why
    assert f"orders/1 belong on partition {right} of {PARTITIONS}" in why
    assert "'orders:1'" in why


async def test_a_copy_belongs_with_its_origin_not_with_its_own_position() -> None:
    ingest = ingest_with(MetadataOnly(PARTITIONS))
    right, wrong = right_and_wrong("orders", 1)
    # A copy whose own position would route to ``wrong``: a writer keying by the copy errs.
    copy_partition = next(
        p for p in range(64) if markers_partition("orders.retry", p, PARTITIONS) == wrong
    )
    origin = MessageId("orders", 1, 42)
    copy = MessageId("orders.retry", copy_partition, 7)
    ack = Marker.ack("billing", copy, attempt=2, origin=origin)

    accepted, _ = await sort(ingest, right, [encode_marker(ack)])
    assert accepted == [ack]
    accepted, rejected = await sort(ingest, wrong, [encode_marker(ack)])
    assert accepted == []
    assert [category for category, _, _ in rejected] == [WRONG_PARTITION]


async def test_valid_malformed_unknown_and_misplaced_markers_are_told_apart() -> None:
    ingest = ingest_with(MetadataOnly(PARTITIONS), check=NoSuchTopic("gone"))
    right, _ = right_and_wrong("orders", 0)
    # An origin whose markers belong elsewhere than ``right``.
    elsewhere = next(p for p in range(64) if markers_partition("orders", p, PARTITIONS) != right)
    mine = Marker.start("g", MessageId("orders", 0, 1))
    misplaced = Marker.start("g", MessageId("orders", elsewhere, 1))
    # Unknown topic wins over the partition check (its partition is no evidence of anything).
    unknown = Marker.start("g", MessageId("gone", 0, 1))
    values: list[bytes | None] = [
        encode_marker(mine),
        b"\x01garbage",
        encode_marker(misplaced),
        encode_marker(unknown),
        encode_marker(mine),
    ]
    accepted, rejected = await sort(ingest, right, values)
    assert accepted == [mine, mine]
    assert [(category, offset) for category, _, offset in rejected] == [
        ("malformed", 1),
        (WRONG_PARTITION, 2),
        ("unknown_topic", 3),
    ]


async def test_one_markers_partition_holds_every_origin() -> None:
    ingest = ingest_with(MetadataOnly(1))
    markers = [Marker.start("g", MessageId("orders", p, 1)) for p in range(20)]
    accepted, rejected = await sort(ingest, 0, [encode_marker(m) for m in markers])
    assert accepted == markers
    assert rejected == []


@pytest.mark.parametrize("partitions", [None, 2], ids=["no metadata", "stale metadata"])
async def test_without_a_partition_count_that_knows_the_partition_nothing_is_refused(
    partitions: int | None,
) -> None:
    """No metadata for the markers topic, or metadata older than the partition read from (the
    topic just grew): the expected partition is unknown, and the marker is not refused for it.
    """
    ingest = ingest_with(MetadataOnly(partitions))
    markers = [Marker.start("g", MessageId("orders", p, 1)) for p in range(20)]
    accepted, rejected = await sort(ingest, 3, [encode_marker(m) for m in markers])
    assert accepted == markers
    assert rejected == []


async def test_the_partition_is_computed_once_per_origin_per_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ingest is a hot path: a batch of thousands of markers names a few origins."""
    calls: list[tuple[str, int, int]] = []

    def counting(topic: str, partition: int, partitions: int) -> int:
        calls.append((topic, partition, partitions))
        return markers_partition(topic, partition, partitions)

    monkeypatch.setattr(verdicts_module, "markers_partition", counting)
    ingest = ingest_with(MetadataOnly(PARTITIONS))
    right, _ = right_and_wrong("orders", 0)
    same = [p for p in range(64) if markers_partition("orders", p, PARTITIONS) == right][:3]
    markers = [Marker.start("g", MessageId("orders", same[i % len(same)], i)) for i in range(3000)]
    accepted, rejected = await sort(ingest, right, [encode_marker(m) for m in markers])
    assert len(accepted) == 3000
    assert rejected == []
    assert sorted(calls) == sorted(("orders", p, PARTITIONS) for p in same)
