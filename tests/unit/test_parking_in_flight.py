"""Refused markers parked while ingest goes on: a flush waits for what was handed over before
it, a failed produce keeps its records first in line, and a revoked partition's records are
left to its next owner."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from tracker.engine.parking import Rejected
from tracker.engine.parking_in_flight import ParkingInFlight
from tracker.metrics import Metrics

pytestmark = pytest.mark.unit


@dataclass
class Consumed:
    partition: int
    offset: int


def refused(partition: int, *offsets: int) -> list[Rejected]:
    return [Rejected(Consumed(partition, o), "bad", "malformed") for o in offsets]


class Parker:
    """An ``InvalidMarkerParker`` that records what it parked; it fails while ``down`` and
    holds each produce until ``open`` is set."""

    def __init__(self) -> None:
        self.parked: list[tuple[int, int]] = []
        self.down = False
        self.open = asyncio.Event()
        self.open.set()
        self.called = asyncio.Event()  #: a produce has started

    async def park(self, rejected: list[Rejected]) -> None:
        self.called.set()
        await self.open.wait()
        if self.down:
            raise KafkaConnectionError()
        self.parked += [(r.record.partition, r.record.offset) for r in rejected]


def in_flight(parker: Parker) -> tuple[ParkingInFlight, Metrics]:
    metrics = Metrics()
    return ParkingInFlight(parker, metrics), metrics  # type: ignore[arg-type]


def counted(metrics: Metrics) -> float:
    value: Any = metrics.markers_invalid.labels("malformed")._value.get()
    return float(value)


async def handed_over_while_down(
    parker: Parker, parking: ParkingInFlight, records: list[Rejected]
) -> None:
    """Hand ``records`` over while the broker is down: the flush raises, they wait in line."""
    parker.down = True
    parking.start(records)
    with pytest.raises(KafkaConnectionError):
        await parking.settle()


async def test_a_flush_waits_for_every_record_handed_over_before_it() -> None:
    parker = Parker()
    parking, metrics = in_flight(parker)
    parker.open.clear()
    parking.start(refused(0, 1, 2))
    parking.start(refused(1, 5))
    settling = asyncio.create_task(parking.settle())
    await asyncio.wait_for(parker.called.wait(), 5)
    assert not settling.done(), "the produce is still under way"
    parker.open.set()
    await asyncio.wait_for(settling, 5)
    assert parker.parked == [(0, 1), (0, 2), (1, 5)]
    assert counted(metrics) == 3, "counted once parked"


async def test_a_failed_produce_keeps_its_records_first_in_line() -> None:
    parker = Parker()
    parking, metrics = in_flight(parker)
    await handed_over_while_down(parker, parking, refused(0, 1, 2))
    assert counted(metrics) == 0
    parking.start(refused(0, 3))
    parker.down = False
    await asyncio.wait_for(parking.settle(), 5)
    assert parker.parked == [(0, 1), (0, 2), (0, 3)], "in the order read, none lost"
    assert counted(metrics) == 3


async def test_a_revoked_partitions_records_are_left_to_its_next_owner() -> None:
    """Their applied offset did not move past them, so the next owner reads and parks them:
    parked here too, each would land on the invalid topic twice."""
    parker = Parker()
    parking, _ = in_flight(parker)
    parker.down = True
    parking.start(refused(0, 1) + refused(1, 7))
    parking.start(refused(1, 8))
    with pytest.raises(KafkaConnectionError):
        await parking.settle()
    parking.forget({1})
    parker.down = False
    await asyncio.wait_for(parking.settle(), 5)
    assert parker.parked == [(0, 1)]
    # Assigned again later: its records are parked as any others.
    parking.start(refused(1, 7))
    await asyncio.wait_for(parking.settle(), 5)
    assert parker.parked == [(0, 1), (1, 7)]


async def test_a_partition_revoked_during_a_produce_that_fails_is_not_put_back() -> None:
    parker = Parker()
    parking, _ = in_flight(parker)
    parker.open.clear()
    parker.down = True
    parking.start(refused(0, 1) + refused(1, 7))
    settling = asyncio.create_task(parking.settle())
    await asyncio.wait_for(parker.called.wait(), 5)  # the produce is under way
    parking.forget({1})
    parking.start(refused(1, 9))  # handed over after the revoke: assigned again meanwhile
    parker.open.set()
    with pytest.raises(KafkaConnectionError):
        await settling
    parker.down = False
    await asyncio.wait_for(parking.settle(), 5)
    assert parker.parked == [(0, 1), (1, 9)]


async def test_a_flush_after_everything_was_forgotten_does_not_wait() -> None:
    parker = Parker()
    parking, _ = in_flight(parker)
    await handed_over_while_down(parker, parking, refused(2, 1, 2))
    parking.forget({2})
    await asyncio.wait_for(parking.settle(), 5)
    assert parker.parked == []
