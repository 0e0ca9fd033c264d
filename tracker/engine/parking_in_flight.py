"""Refused markers on their way to the invalid-markers topic, parked while ingest goes on.

A poll that holds refused records used to wait for their parking produce (``acks=all``)
before it went on: with half the markers garbage, ingest spent most of its time waiting on
that round trip instead of reading and applying. What must come first is narrower: the
records must be parked before the *applied offsets* move past them (a crash after the store
recorded an offset beyond an unparked record would lose it). So a poll starts the parking
and goes on; the flush that would record offsets past the parked records waits for every
parking started before it (:meth:`ParkingInFlight.settle`), and applies nothing if one
failed.

One produce is under way at a time, and what polls refuse meanwhile is parked next, in one
go. A produce per poll would not do: polls that no longer wait come often and carry few
records each, and the producer sends a partition's batches one round trip after the other,
so parking fell behind reading (measured: the valid-marker rate with 50 % garbage halved).
Kept in order, a markers partition's parked copies land on one partition of the invalid
topic in the order they were read (``InvalidMarkerParker``).

A parking that failed keeps its records, first in line: nothing of what was read is dropped
or read again, the markers accepted meanwhile wait in memory (ingest's pending bound stops
the reading), and the next poll or flush tries again. Refused markers are counted in
``kmq_markers_invalid_total`` once they are parked.

The one exception is a revoked partition (:meth:`ParkingInFlight.forget`): its applied offset
did not move past what waits here, so its next owner reads those records again and parks
them; parking them here too would put each on the invalid topic twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Collection

from aiokafka.errors import KafkaError

from tracker.engine.parking import InvalidMarkerParker, Rejected, category_of
from tracker.metrics import Metrics


class ParkingInFlight:
    """Refused records handed over by polls, parked in order by one produce at a time.

    Bookkeeping is per hand-over (one poll's list), not per record: :meth:`settle` waits for
    the hand-overs made before it, and a forgotten record leaves its hand-over shorter, not
    the count wrong.
    """

    def __init__(self, parker: InvalidMarkerParker, metrics: Metrics) -> None:
        self._parker = parker
        self._metrics = metrics
        self._waiting: list[list[Rejected]] = []  #: hand-overs not being parked yet, in order
        self._handed = 0  #: hand-overs so far
        self._parked = 0  #: hand-overs parked (or forgotten) so far, always the first ones
        self._failed: KafkaError | None = None  #: why the last produce failed, if it did
        self._driver: asyncio.Task[None] | None = None
        #: partitions forgotten while a produce was under way: if it fails, their records
        #: are not put back in line
        self._forgotten_in_flight: set[int] = set()

    def start(self, rejected: list[Rejected]) -> None:
        """Hand over one poll's refused records (the list is taken over) to be parked;
        returns at once."""
        if rejected:
            self._waiting.append(rejected)
            self._handed += 1
            self._drive()

    def forget(self, partitions: Collection[int]) -> None:
        """Do not park what waits of markers ``partitions``: they are revoked, and their next
        owner reads those records again from the applied offset, which did not move past
        them (a flush that would move it waits for them)."""
        if not partitions:
            return
        _drop(self._waiting, partitions)
        if self._driver is not None and not self._driver.done():
            self._forgotten_in_flight.update(partitions)

    async def settle(self) -> None:
        """Wait until every record handed over before this call is parked.

        Raises the ``KafkaError`` of a produce that failed (its records stay first in line,
        tried again by the next call); the caller must then not move any offset past what
        was read.
        """
        target = self._handed
        while self._parked < target:
            driver = self._drive()
            # Shielded: a flush cancelled at shutdown must not cancel the produce.
            await asyncio.shield(driver)
            if self._parked < target and self._failed is not None:
                raise self._failed

    async def close(self) -> None:
        """Stop parking (shutdown: what was not parked is read again by the next owner)."""
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver  # puts the batch it was parking back in line: cleared below
        self._waiting.clear()
        self._parked = self._handed

    def _drive(self) -> asyncio.Task[None]:
        """The task parking what waits (started unless one runs)."""
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(
                self._park_waiting(), name="kmq-park-invalid-markers"
            )
        return self._driver

    async def _park_waiting(self) -> None:
        while self._waiting:
            handed, self._waiting = self._waiting, []
            batch = [item for records in handed for item in records]
            self._forgotten_in_flight = set()
            try:
                if batch:
                    await self._parker.park(batch)
            except BaseException as exc:
                _drop(handed, self._forgotten_in_flight)
                self._waiting[:0] = handed  # first in line again
                if isinstance(exc, KafkaError):
                    self._failed = exc
                    return
                raise
            self._failed = None
            self._parked += len(handed)
            for category, n in Counter(map(category_of, batch)).items():
                self._metrics.markers_invalid.labels(category).inc(n)


def _drop(hand_overs: list[list[Rejected]], partitions: Collection[int]) -> None:
    """Remove the records of markers ``partitions`` from ``hand_overs`` (each kept, shorter)."""
    if partitions:
        for records in hand_overs:
            records[:] = [item for item in records if item.record.partition not in partitions]
