"""Writing markers to the markers topic: the Kafka boundary of the client.

:class:`MarkerSink` is the small port the consumer client talks to; :class:`KafkaMarkerSink` is
the real adapter on an aiokafka producer and :class:`tracker.testing.InMemoryMarkerSink` the
fake for unit tests. A sink routes every marker to the markers partition of its origin (see
:mod:`tracker.partitioning`), so all markers of one message stay on one partition, in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from aiokafka.errors import KafkaError

from tracker.errors import MarkerWriteFailed
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import AnyMarker, encode_any


class MarkerSink(Protocol):
    async def send(self, marker: AnyMarker) -> Awaitable[None]:
        """Queue one marker for sending (batched); the result completes once the broker acked it."""
        ...

    def send_later(self, marker: AnyMarker) -> None:
        """Queue a marker nobody waits for; it goes out with the next batch, failures are logged.

        Order is kept: a marker queued here is sent before any marker passed to a later
        ``send``, ``send_all`` or ``send_later`` call.
        """
        ...

    async def send_all(self, markers: Sequence[AnyMarker]) -> None:
        """Send markers and return only once the broker acknowledged every one of them."""
        ...

    async def flush(self) -> None:
        """Wait until everything queued so far is acknowledged."""
        ...


log = logging.getLogger(__name__)


async def _settle(futures: Sequence[Awaitable[Any]]) -> None:
    try:
        await asyncio.gather(*futures)
    except KafkaError as exc:
        raise MarkerWriteFailed(f"marker not acknowledged by the broker: {exc!r}") from exc


#: Pauses (s) between looks for a markers topic not in the metadata; None: give up.
MISSING_TOPIC_PAUSES: tuple[float | None, ...] = (0.1, 0.2, 0.4, 0.8, 1.5, None)


class KafkaMarkerSink:
    """Writes markers with an aiokafka producer, one record batch per markers partition.

    Markers are encoded and appended straight to aiokafka ``BatchBuilder``s, one per markers
    partition, and each builder is queued with ``send_batch``: one future per partition and
    call instead of one ``send`` (and one future) per marker, which made writing a marker cost
    more than consuming a message. Markers that nobody waits for (``send_later``: an ``ack()``
    without ``wait``) are collected and sent together on the next event-loop iteration.

    Order: every path takes the queued markers first and hands batches to the producer under
    one lock, and aiokafka sends a partition's batches in the order they were queued, so the
    markers of one message reach their markers partition in the order they were written.
    """

    def __init__(self, producer: Any, markers_topic: str) -> None:
        self._producer = producer
        self._topic = markers_topic
        self._partitions = 0
        #: encoded markers from send_later: (markers partition, key, value)
        self._queued: list[tuple[int, bytes, bytes]] = []
        #: send_later before the partition count is known (validated, encoded once started)
        self._pending_start: list[AnyMarker] = []
        self._drainer: asyncio.Task[None] | None = None
        self._unsettled: set[asyncio.Future[None]] = set()
        self._lock = asyncio.Lock()

    @property
    def topic(self) -> str:
        return self._topic

    async def start(self) -> None:
        """Learn the markers topic's partition count (it must not change while we run).

        Existence is asked with an all-topics metadata request first: a request naming the
        topic (what ``partitions_for`` sends) makes a broker with ``auto.create.topics.enable``
        (Apache Kafka's default) create it on the spot, with ``num.partitions`` (1) and
        ``CreateTime``, so a consumer started before the tracker would shape the markers
        topic instead of the tracker (``markers_partitions``, ``LogAppendTime``).
        """
        try:
            # A topic created a moment ago can be left out of the answer while its partitions
            # get their leaders: look again for a few seconds before calling it missing.
            for pause in MISSING_TOPIC_PAUSES:
                cluster = await self._producer.client.fetch_all_metadata()
                if cluster.partitions_for_topic(self._topic):
                    break
                if pause is None:
                    raise MarkerWriteFailed(
                        f"the markers topic {self._topic!r} does not exist: start the tracker "
                        "first (it creates the topic), or create it as docs/protocol.md says"
                    )
                await asyncio.sleep(pause)
            partitions = await self._producer.partitions_for(self._topic)
        except KafkaError as exc:
            raise MarkerWriteFailed(
                f"cannot read metadata of the markers topic {self._topic!r}: {exc!r}"
            ) from exc
        self._partitions = len(partitions)

    def _encode(self, marker: AnyMarker) -> tuple[int, bytes, bytes]:
        """(markers partition, key, value); raises ``MarkerError`` for an invalid marker."""
        return (
            markers_partition(marker.origin_topic, marker.origin_partition, self._partitions),
            marker_key(marker.origin_topic, marker.origin_partition),
            encode_any(marker),
        )

    async def _enqueue(self, markers: Sequence[AnyMarker]) -> dict[int, list[Any]]:
        """Hand the queued markers, then ``markers``, to the producer: partition -> futures."""
        async with self._lock:
            if not self._partitions:
                await self.start()
            if self._pending_start:
                early, self._pending_start = self._pending_start, []
                self._queued[:0] = [self._encode(marker) for marker in early]
            encoded = [self._encode(marker) for marker in markers]  # may raise: nothing taken
            queued, self._queued = self._queued, []
            by_partition: dict[int, list[tuple[bytes, bytes]]] = {}
            for partition, key, value in (*queued, *encoded) if queued else encoded:
                by_partition.setdefault(partition, []).append((key, value))
            producer = self._producer
            futures: dict[int, list[Any]] = {}
            try:
                for partition, records in by_partition.items():
                    sent = futures[partition] = []
                    batch = producer.create_batch()
                    for key, value in records:
                        if batch.append(key=key, value=value, timestamp=None) is None:
                            batch.close()
                            sent.append(
                                await producer.send_batch(batch, self._topic, partition=partition)
                            )
                            batch = producer.create_batch()
                            # The first record of an empty batch is always taken.
                            batch.append(key=key, value=value, timestamp=None)
                    # Closed: the batch is complete, so the producer sends it without lingering.
                    batch.close()
                    sent.append(await producer.send_batch(batch, self._topic, partition=partition))
            except KafkaError as exc:
                raise MarkerWriteFailed(f"cannot queue markers: {exc!r}") from exc
            return futures

    async def send(self, marker: AnyMarker) -> Awaitable[None]:
        futures = await self._enqueue([marker])
        mine = markers_partition(marker.origin_topic, marker.origin_partition, self._partitions)
        for partition, sent in futures.items():
            if partition != mine:  # markers queued earlier by send_later
                self._watch(_settle(sent))
        return _settle(futures[mine])

    def send_later(self, marker: AnyMarker) -> None:
        if not self._partitions:
            # Not started yet: the partition count comes with the first send.
            encode_any(marker)  # an invalid marker raises here, to the caller
            self._pending_start.append(marker)
        else:
            self._queued.append(self._encode(marker))  # an invalid marker raises here
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(
                self._drain(), name="kmq-marker-drain"
            )

    async def _drain(self) -> None:
        """Send what ``send_later`` queued (runs on the next loop iteration after a call)."""
        if not self._queued and not self._pending_start:
            return
        try:
            futures = await self._enqueue(())
        except MarkerWriteFailed as exc:
            _warn_unacknowledged(exc)
            return
        for sent in futures.values():
            self._watch(_settle(sent))

    def _watch(self, settling: Awaitable[None]) -> None:
        """Log a failure of markers nobody waits for (the tracker will redeliver)."""
        future = asyncio.ensure_future(settling)
        self._unsettled.add(future)
        future.add_done_callback(self._settled)

    def _settled(self, future: asyncio.Future[None]) -> None:
        self._unsettled.discard(future)
        if not future.cancelled() and future.exception() is not None:
            _warn_unacknowledged(future.exception())

    async def send_all(self, markers: Sequence[AnyMarker]) -> None:
        futures = await self._enqueue(markers)
        await _settle([f for sent in futures.values() for f in sent])

    async def flush(self) -> None:
        """Send what is queued and wait for every marker handed over so far."""
        if self._drainer is not None and not self._drainer.done():
            await asyncio.wait({self._drainer})
        if self._queued or self._pending_start:
            for sent in (await self._enqueue(())).values():
                self._watch(_settle(sent))
        if self._unsettled:
            await asyncio.wait(set(self._unsettled))
        try:
            await self._producer.flush()
        except KafkaError as exc:
            raise MarkerWriteFailed(f"flushing markers failed: {exc!r}") from exc


def _warn_unacknowledged(exc: BaseException | None) -> None:
    log.warning("markers not acknowledged; the tracker will redeliver: %s", exc)
