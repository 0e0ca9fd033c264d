"""Parking refused markers: a bounded number of log lines, however much garbage arrives; what
reaches the invalid topic, and what happens when the broker refuses it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.errors import (
    InvalidTimestampError,
    KafkaConnectionError,
    KafkaError,
    MessageSizeTooLargeError,
    RequestTimedOutError,
)

from tracker.engine.parking import LOG_EACH_PER_WINDOW, LOG_WINDOW_S, InvalidMarkerParker, Rejected
from tracker.headers import (
    INVALID_CATEGORY,
    INVALID_REASON,
    INVALID_SIZE,
    INVALID_SOURCE,
    INVALID_STUB,
    INVALID_TIMESTAMP,
)
from tracker.ids import MessageId
from tracker.protocol import Marker, decode_marker
from tracker.store.port import PendingMarker

pytestmark = pytest.mark.unit


@dataclass
class Record:
    partition: int
    offset: int
    key: bytes | None = b"k"
    value: bytes | None = b"\x00garbage"


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refused(count: int, start: int = 0) -> list[Rejected]:
    return [
        Rejected(Record(0, start + i), "bad magic", "malformed" if i % 3 else "unknown_topic")
        for i in range(count)
    ]


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.name == "tracker.engine.parking"]
    caplog.clear()
    return messages


def test_a_flood_logs_a_few_lines_then_one_summary_per_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    clock = ManualClock()
    parker = InvalidMarkerParker(None, "m.invalid", "m", clock=clock)

    parker._log(refused(4))
    assert len(lines(caplog)) == 4  # a few bad markers: each one named

    parker._log(refused(500, start=4))
    logged = lines(caplog)
    assert len(logged) == LOG_EACH_PER_WINDOW - 4 + 1
    assert logged[0].startswith("invalid marker at m/0/4 ")
    assert logged[-1] == (
        "494 more invalid markers on m (329 malformed, 165 unknown_topic); all parked on m.invalid"
    )

    parker._log(refused(3, start=504))
    assert lines(caplog) == [
        "3 more invalid markers on m (2 malformed, 1 unknown_topic); all parked on m.invalid"
    ]

    clock.now += LOG_WINDOW_S  # a new window: the next ones are named again
    parker._log(refused(2, start=507))
    assert [line.split(" (")[0] for line in lines(caplog)] == [
        "invalid marker at m/0/507",
        "invalid marker at m/0/508",
    ]


# -- what reaches the invalid topic, and when the broker refuses it ------------------------------


class FakeBatch:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.records: list[dict[str, Any]] = []
        self.size = 0

    def append(
        self,
        *,
        key: bytes | None,
        value: bytes | None,
        timestamp: int | None,
        headers: list[tuple[str, bytes]],
    ) -> object | None:
        size = len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)
        if self.records and self.size + size > self.limit:
            return None  # full
        self.records.append(
            {"key": key, "value": value, "timestamp": timestamp, "headers": headers}
        )
        self.size += size
        return object()

    def close(self) -> None:
        pass


class FakeBroker:
    """An aiokafka producer on a broker that refuses batches holding a value over
    ``max_value`` bytes (MESSAGE_TOO_LARGE), or fails every batch with ``fail``."""

    def __init__(
        self, *, max_value: int = 1000, fail: type[KafkaError] | None = None, partitions: int = 1
    ) -> None:
        self.max_value = max_value
        self.fail = fail
        self.partitions = partitions
        self.accepted: list[dict[str, Any]] = []
        self.batches = 0

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(self.partitions))

    def create_batch(self) -> FakeBatch:
        return FakeBatch(16_384)

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        self.batches += 1
        future = asyncio.get_running_loop().create_future()
        if self.fail is not None:
            future.set_exception(self.fail())
        elif any(len(r["value"] or b"") > self.max_value for r in batch.records):
            future.set_exception(MessageSizeTooLargeError())
        else:
            self.accepted.extend({**record, "partition": partition} for record in batch.records)
            future.set_result(None)
        return future


@dataclass
class Consumed:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


FAR_AHEAD = 1_754_000_000_000 + 200 * 365 * 24 * 3600 * 1000  #: a writer clock 200 years ahead


def garbage(*sizes: int) -> list[Rejected]:
    return [
        Rejected(
            Consumed(0, i, b"k", b"\x7f" * size, FAR_AHEAD + i), "unknown version", "malformed"
        )
        for i, size in enumerate(sizes)
    ]


def by_source(accepted: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for record in accepted:
        source = dict(record["headers"])[INVALID_SOURCE].decode()
        assert source not in out, f"{source} parked twice"
        out[source] = record
    return out


async def test_the_copy_is_stamped_when_parked_and_the_original_stamp_is_a_header() -> None:
    """A timestamp a broker would refuse (200 years ahead) is never copied onto the record."""
    broker = FakeBroker()
    await InvalidMarkerParker(broker, "m.invalid", "m").park(garbage(10, 20))
    parked = by_source(broker.accepted)
    assert set(parked) == {"m/0/0", "m/0/1"}
    for offset, record in enumerate(parked.values()):
        assert record["timestamp"] is None  # the producer (or the broker) stamps it now
        assert dict(record["headers"])[INVALID_TIMESTAMP] == str(FAR_AHEAD + offset).encode()
        assert record["value"] == b"\x7f" * (10, 20)[offset]
    assert broker.batches == 1


async def test_a_markers_partitions_refused_records_land_on_one_invalid_partition_in_order() -> (
    None
):
    """Markers partition p parks on invalid partition p mod n, in the order read; the records
    of a poll that spans partitions go out as one batch per partition, all at once."""
    broker = FakeBroker(partitions=3)
    rejected = [
        Rejected(Consumed(source, offset, None, b"\x7f", 0), "bad", "malformed")
        for offset in range(4)
        for source in range(5)
    ]
    await InvalidMarkerParker(broker, "m.invalid", "m").park(rejected)
    landed: dict[int, list[str]] = {}
    for record in broker.accepted:
        landed.setdefault(record["partition"], []).append(
            dict(record["headers"])[INVALID_SOURCE].decode()
        )
    assert landed == {
        0: [f"m/{s}/{o}" for o in range(4) for s in (0, 3)],
        1: [f"m/{s}/{o}" for o in range(4) for s in (1, 4)],
        2: [f"m/2/{o}" for o in range(4)],
    }
    assert broker.batches == 3


async def test_a_record_the_broker_refuses_for_its_content_does_not_stall_parking() -> None:
    """Ingest moves past refused markers only once they are parked: a record the invalid
    topic will never take must end as a stub there, not fail the park for ever."""
    broker = FakeBroker(max_value=1000)
    await InvalidMarkerParker(broker, "m.invalid", "m").park(garbage(10, 5000, 20, 30))
    parked = by_source(broker.accepted)
    assert set(parked) == {"m/0/0", "m/0/1", "m/0/2", "m/0/3"}, "each one, once"
    for source in ("m/0/0", "m/0/2", "m/0/3"):  # refused with it, taken alone: kept whole
        assert parked[source]["value"].startswith(b"\x7f"), source
        assert INVALID_STUB not in dict(parked[source]["headers"])
    stub = parked["m/0/1"]
    headers = dict(stub["headers"])
    assert (stub["key"], stub["value"]) == (None, b"")
    assert b"MessageSizeTooLargeError" in headers[INVALID_STUB]
    assert headers[INVALID_SIZE] == b"5001"
    assert headers[INVALID_CATEGORY] == b"malformed"
    assert headers[INVALID_TIMESTAMP] == str(FAR_AHEAD + 1).encode()


async def test_a_stub_lands_on_the_invalid_partition_of_its_markers_partition() -> None:
    """The retry alone and the stub keep the partition their markers partition parks on."""
    broker = FakeBroker(max_value=1000, partitions=3)
    rejected = [
        Rejected(Consumed(source, offset, b"k", b"\x7f" * size, 5), "bad", "malformed")
        for source, offset, size in [(2, 0, 10), (2, 1, 5000), (0, 0, 10), (2, 2, 20)]
    ]
    await InvalidMarkerParker(broker, "m.invalid", "m").park(rejected)
    landed = {
        dict(r["headers"])[INVALID_SOURCE].decode(): (
            r["partition"],
            INVALID_STUB in dict(r["headers"]),
        )
        for r in broker.accepted
    }
    assert landed == {
        "m/2/0": (2, False),
        "m/2/1": (2, True),
        "m/0/0": (0, False),
        "m/2/2": (2, False),
    }


async def test_a_record_without_a_timestamp_is_parked_without_the_timestamp_header() -> None:
    broker = FakeBroker()
    await InvalidMarkerParker(broker, "m.invalid", "m").park(refused(2))
    assert [INVALID_TIMESTAMP in dict(r["headers"]) for r in broker.accepted] == [False, False]
    assert [dict(r["headers"])[INVALID_SOURCE] for r in broker.accepted] == [b"m/0/0", b"m/0/1"]


@pytest.mark.parametrize("error", [KafkaConnectionError, RequestTimedOutError])
async def test_a_failure_that_is_not_about_the_records_is_raised(error: type[KafkaError]) -> None:
    """Ingest then reads the partitions again after a backoff: nothing is dropped."""
    broker = FakeBroker(fail=error)
    with pytest.raises(error):
        await InvalidMarkerParker(broker, "m.invalid", "m").park(garbage(10))
    assert broker.accepted == []


async def test_a_stub_the_broker_refuses_too_is_raised() -> None:
    """Every record refused for its stamp, even a stub stamped now: the tracker's own clock
    is out of the broker's range. Parking cannot succeed; ingest retries and says why."""
    broker = FakeBroker(fail=InvalidTimestampError)
    with pytest.raises(InvalidTimestampError):
        await InvalidMarkerParker(broker, "m.invalid", "m").park(garbage(10, 20))
    assert broker.accepted == []


async def test_each_parked_record_says_where_it_came_from_and_why() -> None:
    """Headers are built per batch (one encoding per distinct reason, one prefix per markers
    partition); each record still names its own source, reason, category and stamp."""
    broker = FakeBroker()
    rejected = [
        Rejected(Consumed(p, o, b"k", b"\x7f", 1000 + o), reason, category)
        for p, o, reason, category in [
            (0, 7, "bad magic", "malformed"),
            (3, 7, "bad magic", "malformed"),
            (0, 8, "topic 'x' unknown", "unknown_topic"),
            (0, 10_000_000_000, "bad magic", "malformed"),
            (3, 9, "caf\u00e9 " + "x" * 3000, "malformed"),
        ]
    ]
    await InvalidMarkerParker(broker, "m.invalid", "m").park(rejected)
    parked = by_source(broker.accepted)
    assert list(parked) == ["m/0/7", "m/3/7", "m/0/8", "m/0/10000000000", "m/3/9"]
    for item, record in zip(rejected, parked.values(), strict=True):
        headers = dict(record["headers"])
        assert headers[INVALID_CATEGORY] == item.category.encode()
        assert headers[INVALID_REASON] == item.reason.encode()[:2048]
        assert headers[INVALID_TIMESTAMP] == str(item.record.timestamp).encode()


async def test_a_tombstone_is_parked_as_an_empty_value_that_says_so() -> None:
    broker = FakeBroker()
    tombstone = Rejected(Consumed(0, 4, None, None, 5), "tombstone", "malformed")
    await InvalidMarkerParker(broker, "m.invalid", "m").park([tombstone])
    (record,) = broker.accepted
    assert (record["key"], record["value"]) == (None, b"")
    assert dict(record["headers"])[INVALID_CATEGORY + "-tombstone"] == b"1"


def anomalies(count: int) -> list[tuple[PendingMarker, str]]:
    return [
        (
            PendingMarker(Marker.ack("g", MessageId("orders", 1, 40 + i)), 1000, 2, 90 + i),
            "no START to match",
        )
        for i in range(count)
    ]


async def test_anomalies_are_parked_in_batches_with_their_marker_and_source() -> None:
    broker = FakeBroker()
    await InvalidMarkerParker(broker, "m.invalid", "m").park_anomalies(anomalies(3))
    assert broker.batches == 1, "one batch, not a send per marker"
    parked = by_source(broker.accepted)
    assert list(parked) == ["m/2/90", "m/2/91", "m/2/92"]
    for i, record in enumerate(parked.values()):
        headers = dict(record["headers"])
        assert headers[INVALID_CATEGORY] == b"anomaly"
        assert headers[INVALID_REASON] == b"no START to match"
        assert decode_marker(record["value"]) == Marker.ack("g", MessageId("orders", 1, 40 + i))


@pytest.mark.parametrize("error", [KafkaConnectionError, MessageSizeTooLargeError])
async def test_anomalies_are_best_effort(
    error: type[KafkaError], caplog: pytest.LogCaptureFixture
) -> None:
    """They are valid markers already applied: a broker that does not take them is logged,
    and ingest goes on."""
    caplog.set_level(logging.WARNING)
    broker = FakeBroker(fail=error)
    await InvalidMarkerParker(broker, "m.invalid", "m").park_anomalies(anomalies(2))
    assert broker.accepted == []
    assert any(error.__name__ in line for line in lines(caplog))
