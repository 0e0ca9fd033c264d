"""Writing markers to the markers topic: the Kafka boundary of the client.

:class:`MarkerSink` is the small port the consumer client talks to; :class:`KafkaMarkerSink` is
the real adapter on an aiokafka producer and :class:`tracker.testing.InMemoryMarkerSink` the
fake for unit tests. A sink routes every marker to the markers partition of its origin (see
:mod:`tracker.partitioning`), so all markers of one message stay on one partition, in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
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
        """Wait until everything queued so far is acknowledged.

        Raises :class:`MarkerWriteFailed` if a marker queued so far (and not reported by an
        earlier flush) was not acknowledged: ``send_later`` never raises a broker failure, so
        this is where its writer learns of it.
        """
        ...


log = logging.getLogger(__name__)


#: Pauses (s) between looks for a markers topic not in the metadata; None: give up.
MISSING_TOPIC_PAUSES: tuple[float | None, ...] = (0.1, 0.2, 0.4, 0.8, 1.5, None)


class _Group:
    """Markers for one markers partition that go to the producer together, and their fate.

    ``done`` completes when the broker acknowledged every record of the group (or fails with
    :class:`MarkerWriteFailed`); every writer whose marker is in the group waits on it.
    """

    __slots__ = ("done", "records", "watched")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.records: list[tuple[bytes, bytes]] = []
        self.done: asyncio.Future[None] = loop.create_future()
        #: a marker nobody waits for is in the group: a failure is logged
        self.watched = False


class KafkaMarkerSink:
    """Writes markers with an aiokafka producer: group commit, one writer per markers partition.

    aiokafka keeps one request in flight per broker and one undrained batch per partition
    (``send_batch`` waits until the previous batch of its partition went into a request). A
    sink that handed each call's markers to the producer in turn made every marker wait for
    the round trip of the one before it on the same partition — and, behind one lock, every
    marker on every other partition too. Here each call only appends its encoded records to
    the *open group* of its markers partition and returns; a writer task per partition takes
    the whole open group, builds its record batch and hands it to the producer, and while the
    producer waits for the previous request the next group fills up. So the markers of a
    partition go out as one batch per round trip whatever the rate, partitions never wait for
    each other, and a writer that waits pays one round trip, not one per marker queued ahead.

    Order: a partition's records enter its open group in call order and its writer hands
    groups to the producer in order, which sends a partition's batches in the order queued:
    the markers of one message reach their markers partition in the order they were written.
    """

    def __init__(self, producer: Any, markers_topic: str) -> None:
        self._producer = producer
        self._topic = markers_topic
        self._partitions = 0
        #: markers partition -> the group being filled
        self._open: dict[int, _Group] = {}
        #: markers partition -> its writer task (exits when the partition has nothing open)
        self._writers: dict[int, asyncio.Task[None]] = {}
        #: groups handed to the producer and not yet acknowledged
        self._unsettled: set[asyncio.Future[None]] = set()
        #: send_later before the partition count is known (validated, encoded once started)
        self._pending_start: list[AnyMarker] = []
        self._starter: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        #: a failure of a marker nobody waits for, not yet reported by ``flush``
        self._lost: BaseException | None = None

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

    async def _started(self) -> None:
        """Know the partition count, then queue what ``send_later`` kept before that, in order."""
        if not self._partitions:
            async with self._start_lock:
                if not self._partitions:
                    await self.start()
        if self._pending_start:
            early, self._pending_start = self._pending_start, []
            for partition, record in [self._encode(marker) for marker in early]:
                self._append(partition, record, watched=True)

    def _encode(self, marker: AnyMarker) -> tuple[int, tuple[bytes, bytes]]:
        """(markers partition, (key, value)); raises ``MarkerError`` for an invalid marker."""
        topic, partition = marker.origin_topic, marker.origin_partition
        return markers_partition(topic, partition, self._partitions), (
            marker_key(topic, partition),
            encode_any(marker),
        )

    def _append(self, partition: int, record: tuple[bytes, bytes], *, watched: bool) -> _Group:
        """Put an encoded marker into its partition's open group; start the writer if idle."""
        group = self._open.get(partition)
        if group is None:
            loop = asyncio.get_running_loop()
            group = self._open[partition] = _Group(loop)
            writer = self._writers.get(partition)
            if writer is None or writer.done():
                self._writers[partition] = loop.create_task(
                    self._write(partition), name=f"kmq-markers-{partition}"
                )
        group.records.append(record)
        if watched:
            group.watched = True
        return group

    async def _write(self, partition: int) -> None:
        """Hand this partition's open groups to the producer, one at a time, until none is left."""
        producer, topic = self._producer, self._topic
        while (group := self._open.pop(partition, None)) is not None:
            done = group.done
            self._unsettled.add(done)
            done.add_done_callback(self._settled(group))
            delivered: list[Any] = []
            try:
                batch = producer.create_batch()
                for key, value in group.records:
                    if batch.append(key=key, value=value, timestamp=None) is None:
                        batch.close()
                        delivered.append(
                            await producer.send_batch(batch, topic, partition=partition)
                        )
                        batch = producer.create_batch()
                        # The first record of an empty batch is always taken.
                        batch.append(key=key, value=value, timestamp=None)
                # Closed: the batch is complete, so the producer sends it without lingering.
                batch.close()
                delivered.append(await producer.send_batch(batch, topic, partition=partition))
            except KafkaError as exc:
                done.set_exception(MarkerWriteFailed(f"cannot queue markers: {exc!r}"))
                # Batches of the group queued before the failure still get an outcome;
                # the group has failed either way (its writers send again or redeliver).
                for future in delivered:
                    future.add_done_callback(_observe)
                continue
            except BaseException as exc:  # cancelled, or a bug: nobody may wait forever
                if not done.done():
                    done.set_exception(MarkerWriteFailed(f"marker writer stopped: {exc!r}"))
                raise
            asyncio.gather(*delivered).add_done_callback(_resolve(done))

    def _settled(self, group: _Group) -> Callable[[asyncio.Future[None]], None]:
        def settled(done: asyncio.Future[None]) -> None:
            self._unsettled.discard(done)
            if done.cancelled():
                return
            exc = done.exception()  # retrieved here, so an unawaited failure is not "lost"
            if exc is not None and group.watched:
                _warn_unacknowledged(exc)
                self._lost = exc

        return settled

    async def send(self, marker: AnyMarker) -> Awaitable[None]:
        await self._started()
        partition, record = self._encode(marker)
        return _wait_for(self._append(partition, record, watched=False).done)

    def send_later(self, marker: AnyMarker) -> None:
        if self._partitions:
            partition, record = self._encode(marker)  # an invalid marker raises here
            self._append(partition, record, watched=True)
            return
        # Not started yet: the partition count comes with the first send.
        encode_any(marker)  # an invalid marker raises here, to the caller
        self._pending_start.append(marker)
        if self._starter is None or self._starter.done():
            self._starter = asyncio.get_running_loop().create_task(
                self._start_later(), name="kmq-markers-start"
            )

    async def _start_later(self) -> None:
        try:
            await self._started()
        except MarkerWriteFailed as exc:
            _warn_unacknowledged(exc)
            self._lost = exc

    async def send_all(self, markers: Sequence[AnyMarker]) -> None:
        await self._started()
        encoded = [self._encode(marker) for marker in markers]  # may raise: nothing queued
        groups: dict[int, asyncio.Future[None]] = {}
        for partition, record in encoded:
            done = self._append(partition, record, watched=False).done
            groups[id(done)] = done
        if groups:
            await asyncio.wait(groups.values())
            for done in groups.values():
                done.result()

    async def flush(self) -> None:
        """Send what is queued and wait for every marker handed over so far.

        Only for those: markers other tasks queue meanwhile are not waited for, so a flush
        ends after about one round trip however busy the sink is (waiting for the writers to
        go idle instead starved a flush under a worker pool's steady acks and renewals).

        A flush that returns means they were all acknowledged: a group that failed (now, or
        since the last flush, for markers nobody waits for) raises :class:`MarkerWriteFailed`
        here, once. Returning instead made a caller that flushed its acks before, say,
        reporting work done believe markers written that the broker refused.
        """
        if self._starter is not None and not self._starter.done():
            await asyncio.wait({self._starter})
        self._writers = {p: t for p, t in self._writers.items() if not t.done()}
        pending = {group.done for group in self._open.values()} | self._unsettled
        if pending:
            await asyncio.wait(pending)
        try:
            await self._producer.flush()
        except KafkaError as exc:
            raise MarkerWriteFailed(f"flushing markers failed: {exc!r}") from exc
        failures = [done.exception() for done in pending if not done.cancelled()]
        lost, self._lost = self._lost, None
        cause = next((failure for failure in failures if failure is not None), lost)
        if cause is not None:
            raise MarkerWriteFailed(f"markers were not acknowledged: {cause}") from cause


async def _wait_for(done: asyncio.Future[None]) -> None:
    """Wait for a group shared with other writers without cancelling it if we are cancelled."""
    if not done.done():
        await asyncio.wait((done,))
    done.result()


def _resolve(done: asyncio.Future[None]) -> Callable[[asyncio.Future[list[Any]]], None]:
    def resolve(delivered: asyncio.Future[list[Any]]) -> None:
        if done.done():
            return
        if delivered.cancelled():  # the producer was stopped under it
            done.set_exception(MarkerWriteFailed("marker delivery was cancelled"))
            return
        exc = delivered.exception()
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(MarkerWriteFailed(f"marker not acknowledged by the broker: {exc!r}"))

    return resolve


def _observe(future: asyncio.Future[Any]) -> None:
    """Take a future's outcome so that an exception nobody awaits is not reported as lost."""
    if not future.cancelled():
        future.exception()


def _warn_unacknowledged(exc: BaseException | None) -> None:
    log.warning("markers not acknowledged; the tracker will redeliver: %s", exc)
