"""The consumer client: a classic Kafka consumer group with per-message job-queue semantics.

For every fetched batch the client

1. writes START markers (and DELAY markers for not-yet-due delayed messages),
2. waits until the broker acknowledged all of them,
3. commits the queue offsets past the batch,
4. only then hands the messages to the application.

That order is the KMQ invariant: after a crash at any point, every message is either read again
(its offset was not committed) or covered by a START the tracker will act on. Nothing is lost.

With range markers (protocol v2, the default) step 1 is one RANGE_START per fetched partition
batch, acks are bytes in the batch's :class:`~tracker.client.open_ranges.OpenRange` that go out as
RANGE_SETTLEs, and steps 1-2 for the next batches run in the background while the application
works on the current one (*pipelining*, paced by how fast the application takes batches).
Step 3 follows step 4 in the background, one OffsetCommit in flight: a START is still
acknowledged before its offset is committed and before the application sees the message, and
in steady state the application never waits for a round trip.
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

from tracker.clock import Clock, SystemClock
from tracker.errors import ClientClosed, MarkerWriteFailed
from tracker.ids import is_valid_topic
from tracker.kafka.clients import stop_consumer
from tracker.protocol import MAX_CONSUMER_LENGTH, MAX_GROUP_LENGTH, MAX_TIMEOUT_MS

from .gc_untrack import records_untracker
from .group_membership import GroupTimeouts, RebalanceCounter
from .handlers import Handler, HandlerCaller
from .marker_sink import KafkaMarkerSink, MarkerSink
from .message import KmqMessage, MessageContext
from .message_batch import each_once
from .offset_commits import OffsetCommits
from .open_ranges import RangeBook
from .ordering import Ordering
from .per_message_take import HandOverCounts, PerMessageTaker
from .planning import SeenCopies
from .pool_config import PoolSettings, WorkerStats, checked_run_options
from .pool_source import ConsumerBatchSource, TakenBatch
from .range_take import RangeTaker
from .workers import WorkerPool

#: aiokafka's default ``fetch_max_bytes`` (50 MiB, as the Java consumer's ``fetch.max.bytes``).
AIOKAFKA_FETCH_MAX_BYTES = 52_428_800

#: Versions of the marker protocol the client can write (docs/protocol.md).
MARKER_VERSIONS = (1, 2)

log = logging.getLogger(__name__)

DEFAULT_MARKERS_TOPIC = "kmq-markers"

#: Batches the START pipeline fetches ahead of a worker pool at most.
POOL_PIPELINE_DEPTH = 4

#: The lease ``run()`` asks for and renews when the consumer leaves it to the tracker's policy.
DEFAULT_RUN_LEASE = timedelta(seconds=30)


def marker_consumer_id(consumer_id: str | None) -> str:
    """``consumer_id`` (or :func:`default_consumer_id`) as STARTs carry it: at most
    ``MAX_CONSUMER_LENGTH`` bytes of UTF-8, cut on a character (a cut by characters could
    leave twice that many bytes, which every START then failed to encode); ``ValueError`` for
    a NUL character, which no marker carries."""
    if consumer_id is not None and "\x00" in consumer_id:
        raise ValueError("consumer_id must not contain NUL characters")
    text = consumer_id or default_consumer_id()
    return text.encode("utf-8")[:MAX_CONSUMER_LENGTH].decode("utf-8", errors="ignore")


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

    Whole batches (the cheapest form: one RANGE_START and one RANGE_SETTLE per partition
    batch)::

            async for batch in consumer.batches():
                await handle_all(batch)
                await consumer.ack_all()

    ``processing_timeout`` is the lease each START asks for; ``None`` leaves it to the
    tracker's per-topic policy. ``dedup_window`` (opt-in) skips exact duplicates of a copy
    (same origin and attempt) taken within that window. Extra aiokafka settings (security,
    fetch sizes, ...) go in ``consumer_config`` / ``producer_config``.

    ``marker_version``: 2 (default) writes range markers and prepares the next batch while
    the application works on the current one: its lease starts then, and if it waited more
    than half its lease before being handed over, it is extended at hand-over. 1 writes one
    START and one ACK record per message, for trackers older than protocol v2.
    ``pipeline_depth`` bounds how many fetched batches (of up to ``max_batch``) wait with
    their STARTs in flight; within it the client keeps waiting only the application's work
    (measured from how fast it takes batches) that hides the START round trips (four times
    their measured time, at least 20 ms), at most a tenth of the lease (one second at most),
    so a slow application has one batch fetched ahead, not ``pipeline_depth``; and
    no more than ``fetch_max_bytes`` (``consumer_config``, 50 MiB by default) of values.
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
        marker_version: int = 2,
        pipeline_depth: int = 128,
    ) -> None:
        if pipeline_depth < 1:
            raise ValueError("pipeline_depth must be at least 1")
        if marker_version not in MARKER_VERSIONS or isinstance(marker_version, bool):
            raise ValueError(
                f"marker_version must be 1 or 2 (docs/protocol.md), got {marker_version!r}"
            )
        if not topics:
            raise ValueError("KmqConsumer needs at least one topic")
        for topic in (*topics, markers_topic):
            if not is_valid_topic(topic):
                raise ValueError(f"{topic!r} is not a legal Kafka topic name")
        if markers_topic in topics:
            raise ValueError("the markers topic cannot also be a queue topic")
        if not group_id or "\x00" in group_id or len(group_id.encode("utf-8")) > MAX_GROUP_LENGTH:
            raise ValueError(
                f"group_id must be 1 to {MAX_GROUP_LENGTH} bytes of UTF-8, without NUL characters"
            )
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        lease_ms = 0  #: kept by the range taker from here on (run() may set one)
        if processing_timeout is not None:
            lease_ms = round(processing_timeout.total_seconds() * 1000)
            if not 0 < lease_ms <= MAX_TIMEOUT_MS:
                raise ValueError("processing_timeout must be between 1 ms and ~49 days")
        self.topics = topics
        self.group_id = group_id
        self.markers_topic = markers_topic
        self.consumer_id = marker_consumer_id(consumer_id)
        self._max_batch = max_batch
        self._fetch_timeout_ms = max(0, round(fetch_timeout.total_seconds() * 1000))
        self._clock: Clock = clock or SystemClock()
        self._seen = SeenCopies(dedup_window, dedup_capacity) if dedup_window else None
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            **{
                "auto_offset_reset": "earliest",
                **(consumer_config or {}),
                "group_id": group_id,
                "enable_auto_commit": False,
            },
        )
        #: counts rebalances: batches fetched before one are not handed over
        self._rebalances = RebalanceCounter(self._on_revoked)
        self._group_timeouts = GroupTimeouts.of(consumer_config or {})
        self._consumer.subscribe(list(topics), listener=self._rebalances)
        self._producer: Any = None
        if marker_sink is None:
            self._producer = AIOKafkaProducer(
                bootstrap_servers=bootstrap_servers,
                **{"acks": "all", "linger_ms": 5, **(producer_config or {})},
            )
            marker_sink = KafkaMarkerSink(self._producer, markers_topic)
        self._sink: MarkerSink = marker_sink
        self.marker_version = marker_version
        self._book = RangeBook(self._sink.send_later)
        self._context = MessageContext(group_id, self._sink, self._book)
        self._commits = OffsetCommits(self._consumer)
        self._running = False
        #: the aiokafka clients were stopped (by stop, or by a start that failed)
        self._clients_closed = False
        self._handed_out = False  #: messages were taken with getmany/iteration
        self._pool: WorkerPool | None = None  #: run()'s pool, while it runs
        self._counts = HandOverCounts()
        self._per_message = PerMessageTaker(
            consumer=self._consumer,
            sink=self._sink,
            context=self._context,
            counts=self._counts,
            seen=self._seen,
            clock=self._clock,
            group_id=group_id,
            consumer_id=self.consumer_id,
            max_batch=max_batch,
        )
        self._ranges = RangeTaker(
            consumer=self._consumer,
            sink=self._sink,
            book=self._book,
            context=self._context,
            commits=self._commits,
            counts=self._counts,
            seen=self._seen,
            clock=self._clock,
            untrack=records_untracker(consumer_config or {}, max_batch),
            generation=self._rebalances.current,
            group_id=group_id,
            consumer_id=self.consumer_id,
            max_batch=max_batch,
            fetch_timeout_ms=self._fetch_timeout_ms,
            # aiokafka's own bound on a fetch; the pipeline holds no more than that ahead.
            fetch_max_bytes=int(
                (consumer_config or {}).get("fetch_max_bytes", AIOKAFKA_FETCH_MAX_BYTES)
            ),
            lease_ms=lease_ms,
            depth=pipeline_depth,
        )

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
        """Flush queued markers, then leave the group and close.

        While :meth:`run` runs, it first stops the pool (which drains) and waits for it.
        Called from inside a handler (or a task a handler started), it only asks the pool to
        stop and returns at once: the pool waits for that handler, and the consumer closes
        when ``stop()`` is called again (by ``async with``, for one).
        """
        if not self._running:
            if not self._clients_closed:
                # Made and never started: aiokafka's clients exist from the constructor on and
                # warn ("Unclosed AIOKafkaConsumer") when collected unstopped.
                await self._close_clients()
            return
        pool = self._pool
        if pool is not None:
            pool.request_stop()
            if pool.runs_here():
                return  # called by a handler: run() drains and returns; closing comes after
            await pool.finished()
        self._running = False
        try:
            await self._ranges.release_prefetched()
            await self._commits.finish()
            self._book.flush()
            self._book.close()
            try:
                await self._sink.flush()
            except MarkerWriteFailed as exc:
                # Stopping goes on: what was not acknowledged is covered by its START, and
                # the tracker redelivers it (at least once); the sink logged each failure.
                log.warning("stopping with markers not acknowledged: %s", exc)
        finally:
            await self._close_clients()

    async def _close_clients(self) -> None:
        self._clients_closed = True
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
        """Send the acks not sent yet; wait until every marker so far is acknowledged.

        Raises :class:`MarkerWriteFailed` if one was not (acks are written without waiting, so
        this is where a failed one shows): the messages it settled will be redelivered.
        """
        self._book.flush()
        await self._sink.flush()

    async def ack_all(self) -> None:
        """Ack every message handed out so far and not settled yet (the batch form).

        With range markers this is one RANGE_SETTLE per open batch range, however many
        messages it covers; copies (settled per message) get their ACKs.
        """
        self._book.ack_all()
        for message in self._ranges.take_loose():
            if message.settled is None:
                await message.ack()

    # -- consuming ------------------------------------------------------------------------

    async def getmany(self, wait: timedelta | None = None) -> Sequence[KmqMessage]:
        """Fetch one batch (waiting up to ``wait``) and return the messages ready for the app.

        May return an empty list (nothing fetched, or everything was deferred or skipped).
        With range markers the batch is a :class:`~tracker.client.message_batch.MessageBatch`:
        a sequence whose messages are made when first looked at (settling it whole with
        :meth:`ack_all` makes none).
        Raises :class:`MarkerWriteFailed` if the broker did not acknowledge the markers; the
        batch is then not handed over and will be fetched again.
        """
        if not self._running:
            raise ClientClosed()
        timeout_ms = (
            self._fetch_timeout_ms if wait is None else max(0, round(wait.total_seconds() * 1000))
        )
        if self._pool is not None:
            raise RuntimeError("run() is taking this consumer's messages")
        self._handed_out = True
        taken = await self._take(timeout_ms)
        return [] if taken is None else taken.messages

    async def run(
        self,
        handler: Handler,
        *,
        concurrency: int = 16,
        ordering: Ordering | str = Ordering.UNORDERED,
        blocking: bool | None = None,
        max_processing: timedelta = timedelta(minutes=4),
        drain_timeout: timedelta = timedelta(seconds=10),
    ) -> WorkerStats:
        """Process messages with ``handler``, up to ``concurrency`` at once, until :meth:`stop`
        (or the cancellation of this call); returns what it did.

        ``handler(message)`` is ``async def`` (run on the loop) or a plain function (run in a
        thread pool of ``concurrency`` threads; ``blocking`` overrides the guess). Each message
        is acked when its handler returns, retried when it raises (after the topic's backoff,
        or the delay of a :class:`~tracker.client.RetryMessage`), dead-lettered when it raises
        :class:`~tracker.client.RejectMessage`. A handler may settle the message itself.

        ``ordering``: ``"unordered"``; ``"key"`` (messages of one key of a topic one at a
        time, in offset order; different keys in parallel; keyless messages unordered); or
        ``"partition"``. Leases are renewed while messages wait or run, by batch;
        a handler running longer than ``max_processing`` is cancelled and its message retried.
        On stop and when the group takes partitions away, what the pool holds gets up to
        ``drain_timeout`` to finish; the rest goes back to the tracker, redelivered at once.

        A handler that raises ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) stops
        the pool: its message is given back, the others drain, and ``run`` raises it.
        ``run`` takes over the consumer: call it once, and not after ``getmany``/iteration.
        """
        order, max_s, drain_s = checked_run_options(
            handler,
            concurrency=concurrency,
            ordering=ordering,
            max_processing=max_processing,
            drain_timeout=drain_timeout,
        )
        if not self._running:
            raise ClientClosed()
        if self._pool is not None or self._handed_out:
            raise RuntimeError("run() takes over the consumer: call it once, before any getmany")
        caller = HandlerCaller(handler, blocking=blocking, threads=concurrency)
        # The pool keeps its own list of waiting messages (renewed): a few batches fetched
        # ahead are enough to hide the START round trips; more would be read twice after a
        # rebalance and given back on stop.
        self._ranges.depth = min(self._ranges.depth, POOL_PIPELINE_DEPTH)
        if not self._ranges.lease_ms:
            # The pool renews leases, so it must know them: ask for one explicitly.
            self._ranges.lease_ms = round(DEFAULT_RUN_LEASE.total_seconds() * 1000)
        settings = PoolSettings(
            concurrency=concurrency,
            ordering=order,
            lease_ms=self._ranges.lease_ms,
            max_processing_s=max_s,
            drain_s=drain_s,
            max_waiting=2 * max(concurrency, self._max_batch),
            keepalive_s=self._group_timeouts.max_poll_interval_ms / 3000,
        )
        source = ConsumerBatchSource(
            take=self._take,
            sink=self._sink,
            consumer=self._consumer,
            prefetched=self._ranges.waiting,
            group=self.group_id,
        )
        self._pool = pool = WorkerPool(source, caller, settings)
        try:
            return await pool.run()
        finally:
            self._pool = None

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """The group takes partitions away (aiokafka waits for this before the rebalance goes
        on): let run()'s pool finish what it holds of them, and commit what was handed over,
        so their next owner starts where this one stopped."""
        # The group waits for this member up to its rebalance timeout: drain for at most half
        # of it, and leave time for the commit after.
        budget_s = self._group_timeouts.rebalance_timeout_ms / 2000
        pool = self._pool
        if pool is not None and revoked:
            drain_s = min(pool.drain_s, budget_s)
            await pool.drain_partitions({(tp.topic, tp.partition) for tp in revoked}, drain_s)
        self._book.flush()
        await self._commits.wait(budget_s / 2)

    async def _take(self, timeout_ms: int) -> TakenBatch | None:
        if self.marker_version == 2:
            return await self._ranges.take(timeout_ms)
        return await self._per_message.take(timeout_ms, self._ranges.lease_ms)

    async def batches(self) -> AsyncIterator[Sequence[KmqMessage]]:
        """Yield non-empty batches of messages until the consumer is stopped."""
        while self._running:
            messages = await self.getmany()
            if messages:
                yield messages

    async def __aiter__(self) -> AsyncIterator[KmqMessage]:
        async for batch in self.batches():
            for message in each_once(batch):  # each made when reached, not kept by the batch
                yield message

    # -- introspection --------------------------------------------------------------------

    @property
    def skipped(self) -> int:
        """Records skipped so far: other groups' copies, duplicates."""
        return self._counts.skipped

    @property
    def deferred(self) -> int:
        """Not-yet-due delayed records handed to the tracker so far."""
        return self._counts.deferred

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())
