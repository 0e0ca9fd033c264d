"""The consumer client: a classic Kafka consumer group with per-message job-queue semantics.

For every fetched batch the client

1. writes START markers (and DELAY markers for not-yet-due delayed messages),
2. waits until the broker acknowledged all of them,
3. commits the queue offsets past the batch,
4. only then hands the messages to the application.

That order is the KMQ invariant: after a crash at any point, every message is either read again
(its offset was not committed) or covered by a START the tracker will act on. Nothing is lost.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from tracker.clock import Clock, SystemClock
from tracker.errors import ClientClosed, MarkerWriteFailed
from tracker.ids import is_valid_topic
from tracker.kafka.clients import stop_consumer
from tracker.protocol import MAX_GROUP_LENGTH, MAX_TIMEOUT_MS

from .markers import KafkaMarkerSink, MarkerSink
from .message import KmqMessage
from .planning import Action, Planned, SeenCopies, plan_batch

log = logging.getLogger(__name__)

DEFAULT_MARKERS_TOPIC = "kmq-markers"


def default_consumer_id() -> str:
    """``host:pid``: enough for an operator to find the process that holds a message."""
    return f"{socket.gethostname()}:{os.getpid()}"[:255]


class KmqConsumer:
    """Consume ``topics`` as consumer group ``group_id`` with per-message ack/retry/reject.

    Example::

        async with KmqConsumer("orders", group_id="billing",
                               bootstrap_servers="localhost:9092") as consumer:
            async for message in consumer:
                async with message.processing():
                    await handle(message.value)

    ``processing_timeout`` is the lease each START asks for; ``None`` leaves it to the
    tracker's per-topic policy. ``dedup_window`` (opt-in) skips exact duplicates of a copy
    (same origin and attempt) taken within that window. Extra aiokafka settings (security,
    fetch sizes, ...) go in ``consumer_config`` / ``producer_config``.
    """

    def __init__(
        self,
        *topics: str,
        group_id: str,
        bootstrap_servers: str | Sequence[str],
        markers_topic: str = DEFAULT_MARKERS_TOPIC,
        processing_timeout: timedelta | None = None,
        consumer_id: str | None = None,
        max_batch: int = 500,
        fetch_timeout: timedelta = timedelta(milliseconds=500),
        dedup_window: timedelta | None = None,
        dedup_capacity: int = 100_000,
        clock: Clock | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        marker_sink: MarkerSink | None = None,
    ) -> None:
        if not topics:
            raise ValueError("KmqConsumer needs at least one topic")
        for topic in (*topics, markers_topic):
            if not is_valid_topic(topic):
                raise ValueError(f"{topic!r} is not a legal Kafka topic name")
        if markers_topic in topics:
            raise ValueError("the markers topic cannot also be a queue topic")
        if not group_id or len(group_id.encode("utf-8")) > MAX_GROUP_LENGTH:
            raise ValueError(f"group_id must be 1 to {MAX_GROUP_LENGTH} bytes of UTF-8")
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        self._timeout_ms = 0
        if processing_timeout is not None:
            self._timeout_ms = round(processing_timeout.total_seconds() * 1000)
            if not 0 < self._timeout_ms <= MAX_TIMEOUT_MS:
                raise ValueError("processing_timeout must be between 1 ms and ~49 days")
        self.topics = topics
        self.group_id = group_id
        self.markers_topic = markers_topic
        self.consumer_id = (consumer_id or default_consumer_id())[:255]
        self._max_batch = max_batch
        self._fetch_timeout_ms = max(0, round(fetch_timeout.total_seconds() * 1000))
        self._clock: Clock = clock or SystemClock()
        self._seen = SeenCopies(dedup_window, dedup_capacity) if dedup_window else None
        self._consumer = AIOKafkaConsumer(
            *topics,
            bootstrap_servers=bootstrap_servers,
            **{
                "auto_offset_reset": "earliest",
                **(consumer_config or {}),
                "group_id": group_id,
                "enable_auto_commit": False,
            },
        )
        self._producer: Any = None
        if marker_sink is None:
            self._producer = AIOKafkaProducer(
                bootstrap_servers=bootstrap_servers,
                **{"acks": "all", "linger_ms": 5, **(producer_config or {})},
            )
            marker_sink = KafkaMarkerSink(self._producer, markers_topic)
        self._sink: MarkerSink = marker_sink
        self._running = False
        self.skipped = 0  #: records skipped (other group's copies, duplicates)
        self.deferred = 0  #: not-yet-due delayed records handed to the tracker

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, check the markers topic and join the group; cleans up if any step fails."""
        try:
            if self._producer is not None:
                await self._producer.start()
                if isinstance(self._sink, KafkaMarkerSink):
                    await self._sink.start()
            await self._consumer.start()
        except BaseException:
            await self._close_clients()
            raise
        self._running = True

    async def stop(self) -> None:
        """Flush queued markers, then leave the group and close."""
        if not self._running:
            return
        self._running = False
        try:
            await self._sink.flush()
        finally:
            await self._close_clients()

    async def _close_clients(self) -> None:
        try:
            await stop_consumer(self._consumer)
        finally:
            if self._producer is not None:
                await self._producer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def flush(self) -> None:
        """Wait until every marker written so far is acknowledged by the broker."""
        await self._sink.flush()

    # -- consuming ------------------------------------------------------------------------

    async def getmany(self, wait: timedelta | None = None) -> list[KmqMessage]:
        """Fetch one batch (waiting up to ``wait``) and return the messages ready for the app.

        May return an empty list (nothing fetched, or everything was deferred or skipped).
        Raises :class:`MarkerWriteFailed` if the broker did not acknowledge the markers; the
        batch is then not handed over and will be fetched again.
        """
        if not self._running:
            raise ClientClosed()
        timeout_ms = (
            self._fetch_timeout_ms if wait is None else max(0, round(wait.total_seconds() * 1000))
        )
        fetched: dict[Any, list[Any]] = await self._consumer.getmany(
            timeout_ms=timeout_ms, max_records=self._max_batch
        )
        records = [record for batch in fetched.values() for record in batch]
        if not records:
            return []
        planned = plan_batch(
            records,
            group=self.group_id,
            consumer_id=self.consumer_id,
            timeout_ms=self._timeout_ms,
            now=self._clock.now(),
            seen=self._seen,
        )
        markers = [p.marker for p in planned if p.marker is not None]
        try:
            await self._sink.send_all(markers)
        except MarkerWriteFailed:
            self._rewind(fetched)
            raise
        if not await self._commit(fetched):
            return []
        return self._hand_over(planned)

    def _hand_over(self, planned: list[Planned]) -> list[KmqMessage]:
        messages: list[KmqMessage] = []
        for p in planned:
            if p.action is Action.DELIVER:
                messages.append(
                    KmqMessage(
                        p.record,
                        origin=p.origin,
                        attempt=p.attempt,
                        group=self.group_id,
                        sink=self._sink,
                    )
                )
            elif p.action is Action.DEFER:
                self.deferred += 1
            else:
                self.skipped += 1
                log.debug("skipped %s: %s", p.message, p.why)
        return messages

    async def _commit(self, fetched: dict[Any, list[Any]]) -> bool:
        offsets = {
            tp: OffsetAndMetadata(batch[-1].offset + 1, "")
            for tp, batch in fetched.items()
            if batch
        }
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:
            # Typically a rebalance. The STARTs are written, so the tracker covers these
            # messages; re-reading them (here or at the new owner) is the safe way on.
            log.warning("offset commit failed (%r); the batch will be read again", exc)
            self._rewind(fetched)
            return False
        return True

    def _rewind(self, fetched: dict[Any, list[Any]]) -> None:
        """Seek back to the first record of the batch on partitions we still own."""
        assigned = self._consumer.assignment()
        for tp, batch in fetched.items():
            if batch and tp in assigned:
                self._consumer.seek(tp, batch[0].offset)

    async def batches(self) -> AsyncIterator[list[KmqMessage]]:
        """Yield non-empty batches of messages until the consumer is stopped."""
        while self._running:
            messages = await self.getmany()
            if messages:
                yield messages

    async def __aiter__(self) -> AsyncIterator[KmqMessage]:
        async for batch in self.batches():
            for message in batch:
                yield message

    # -- introspection --------------------------------------------------------------------

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())
