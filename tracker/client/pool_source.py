"""A :class:`~tracker.client.workers.WorkerPool`'s view of a ``KmqConsumer``: where batches come
from, where markers go, how the group is kept from dropping a member whose pool is full, and
how the leases of batches fetched ahead are renewed.

:class:`BatchSource` is what the pool needs (a fake one drives the pool's unit tests);
:class:`ConsumerBatchSource` is the consumer's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from aiokafka import AIOKafkaConsumer

from tracker.protocol import AnyMarker

from .marker_sink import MarkerSink
from .message import KmqMessage
from .open_ranges import OpenRange
from .pipeline import InFlight
from .prepared_batches import PreparedBatch


@dataclass(slots=True, eq=False)
class TakenBatch:
    """A batch handed over by the consumer: STARTed, its offsets committed or on their way."""

    messages: Sequence[KmqMessage]  #: a MessageBatch (range markers) or a list (v1)
    ranges: list[OpenRange]  #: the range STARTs covering most of them
    loose: list[KmqMessage]  #: the ones settled per message (copies)
    at: float  #: ``time.monotonic()`` when their STARTs were sent: their leases run from then


class BatchSource(Protocol):
    """What the pool needs from the consumer."""

    async def take(self, wait_s: float) -> TakenBatch | None:
        """The next batch handed over, or None after ``wait_s`` seconds."""
        ...

    async def send_all(self, markers: Sequence[AnyMarker]) -> None:
        """Write markers; return once the broker acknowledged them."""
        ...

    def send_later(self, marker: AnyMarker) -> None:
        """Queue a marker nobody waits for."""
        ...

    async def keep_alive(self) -> None:
        """Poll the group without taking records (the pool is full)."""
        ...

    def prefetched_extensions(self, lease_ms: int, older_than_s: float) -> list[AnyMarker]:
        """EXTENDs of ``lease_ms`` for batches fetched ahead whose leases run longer than
        ``older_than_s`` (their leases count from now on)."""
        ...


class ConsumerBatchSource:
    """The :class:`BatchSource` of a consumer's worker pool."""

    def __init__(
        self,
        *,
        take: Callable[[int], Awaitable[TakenBatch | None]],
        sink: MarkerSink,
        consumer: AIOKafkaConsumer,
        prefetched: Callable[[], Sequence[InFlight]],
        group: str,
    ) -> None:
        self._take = take
        self._sink = sink
        self._consumer = consumer
        self._prefetched = prefetched
        self._group = group

    async def take(self, wait_s: float) -> TakenBatch | None:
        return await self._take(round(wait_s * 1000))

    async def send_all(self, markers: Sequence[AnyMarker]) -> None:
        await self._sink.send_all(markers)

    def send_later(self, marker: AnyMarker) -> None:
        self._sink.send_later(marker)

    async def keep_alive(self) -> None:
        """Poll with every partition paused: the group sees a live member, nothing is fetched
        (what was buffered for a paused partition is dropped and fetched again later: its
        position does not move)."""
        consumer = self._consumer
        assigned = consumer.assignment()
        consumer.pause(*assigned)
        try:
            await consumer.getmany(timeout_ms=0)
        finally:
            consumer.resume(*(assigned & consumer.assignment()))

    def prefetched_extensions(self, lease_ms: int, older_than_s: float) -> list[AnyMarker]:
        now = time.monotonic()
        markers: list[AnyMarker] = []
        for item in self._prefetched():
            if now - item.sent_at >= older_than_s:
                prepared = PreparedBatch(item.plans, item.sent_at, lease_ms, self._group)
                markers += prepared.extensions(lease_ms)
                item.sent_at = now
        return markers
