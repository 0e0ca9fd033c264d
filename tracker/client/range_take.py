"""Protocol v2's hand-over: range STARTs, prepared ahead, committed after the app has them.

``KmqConsumer`` (the default ``marker_version=2``) takes its batches here. A
:class:`~tracker.client.pipeline.StartPipeline` fetches and plans the next batches and writes
their RANGE_STARTs while the application works on the current one; a batch is handed over once
its STARTs are acknowledged, then its offsets are committed in the background
(:class:`~tracker.client.offset_commits.OffsetCommits`). Its ranges go to the range book (acks
become RANGE_SETTLEs); its copies, settled per message, are kept for ``ack_all``. Apart from the
consumer so that the consumer reads as its public API and lifecycle, and this as the one path
that is the client's hot loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer

from tracker.clock import Clock
from tracker.protocol import AnyMarker

from .marker_sink import MarkerSink
from .message import KmqMessage, MessageContext
from .message_batch import MessageBatch
from .offset_commits import OffsetCommits
from .open_ranges import OpenRange, RangeBook
from .per_message_take import HandOverCounts
from .pipeline import InFlight, StartPipeline
from .planning import RangePlan, Run, SeenCopies, plan_ranges
from .pool_source import TakenBatch
from .prepared_batches import PreparedBatch, prefetch_seconds, value_bytes


class RangeTaker:
    """Take batches the v2 way. ``lease_ms`` and ``depth`` may be changed before the first
    :meth:`take` (``KmqConsumer.run`` does: the pool renews leases and fetches few ahead).

    ``lease_ms`` is the consumer's one record of its lease (0: none), which protocol v1's
    taker and the worker pool read from here too.
    """

    def __init__(
        self,
        *,
        consumer: AIOKafkaConsumer,
        sink: MarkerSink,
        book: RangeBook,
        context: MessageContext,
        commits: OffsetCommits,
        counts: HandOverCounts,
        seen: SeenCopies | None,
        clock: Clock,
        untrack: Callable[[dict[Any, list[Any]]], None] | None,
        generation: Callable[[], int],
        group_id: str,
        consumer_id: str,
        max_batch: int,
        fetch_timeout_ms: int,
        fetch_max_bytes: int,
        lease_ms: int,
        depth: int,
    ) -> None:
        self._consumer = consumer
        self._sink = sink
        self._book = book
        self._context = context
        self._commits = commits
        self._counts = counts
        self._seen = seen
        self._clock = clock
        self._untrack = untrack
        self._generation = generation
        self._group_id = group_id
        self._consumer_id = consumer_id
        self._max_batch = max_batch
        self._fetch_timeout_ms = fetch_timeout_ms
        self._fetch_max_bytes = fetch_max_bytes
        self.lease_ms = lease_ms
        self.depth = depth
        self._pipeline: StartPipeline | None = None
        #: handed-over messages settled per message (copies): what ack_all must ack
        self._loose: list[KmqMessage] = []

    def take_loose(self) -> list[KmqMessage]:
        """The copies handed over since the last call (``ack_all`` acks those not settled)."""
        loose, self._loose = self._loose, []
        return loose

    def waiting(self) -> list[InFlight]:
        """Batches fetched ahead, STARTed or on their way (a pool renews their leases)."""
        return [] if self._pipeline is None else self._pipeline.waiting()

    async def release_prefetched(self) -> None:
        """Stop the pipeline; give batches the app never saw back to the tracker.

        Their STARTs are acknowledged, so they are covered; an EXTEND of 1 ms makes the
        tracker redeliver them at once instead of at the end of their lease (what SQS does with
        a visibility timeout of 0, share groups with RELEASE). Their offsets were not
        committed (that happens at hand-over), so the group reads them again too: whichever
        comes first, nothing waits for a lease. A batch whose STARTs are still on their way is
        either covered or read again.
        """
        if self._pipeline is None:
            return
        for item in await self._pipeline.close():
            prepared = PreparedBatch(item.plans, item.sent_at, self.lease_ms, self._group_id)
            for marker in prepared.extensions(1):
                self._sink.send_later(marker)

    async def take(self, timeout_ms: int) -> TakenBatch | None:
        """Hand over the next batch whose STARTs are acknowledged; commit it after that."""
        if self._pipeline is None:
            self._pipeline = StartPipeline(
                fetch=self._fetch_batch,
                plan=self._plan_ranges,
                send=self._sink.send_all,
                seek=self._seek_back,
                depth=self.depth,
                ahead_s=prefetch_seconds(self.lease_ms),
                max_bytes=self._fetch_max_bytes,
                weigh=value_bytes,
                generation=self._generation,
            )
        item = await self._pipeline.next(timeout_ms / 1000)
        if item is None:
            return None
        self._commits.soon(item.fetched)
        self._book.flush()  # the acks of the batches before go out first
        return self._hand_over(
            PreparedBatch(item.plans, item.sent_at, self.lease_ms, self._group_id)
        )

    async def _fetch_batch(self) -> dict[Any, list[Any]]:
        fetched: dict[Any, list[Any]] = await self._consumer.getmany(
            timeout_ms=self._fetch_timeout_ms, max_records=self._max_batch
        )
        if self._untrack is not None:  # held ahead of the app: out of the GC's sight
            self._untrack(fetched)
        return fetched

    def _plan_ranges(
        self, fetched: dict[Any, list[Any]]
    ) -> tuple[list[RangePlan], list[AnyMarker]]:
        now = self._clock.now()
        plans = [
            plan_ranges(
                batch,
                group=self._group_id,
                consumer_id=self._consumer_id,
                timeout_ms=self.lease_ms,
                now=now,
                seen=self._seen,
            )
            for batch in fetched.values()
            if batch
        ]
        markers: list[AnyMarker] = []
        for plan in plans:
            markers += [opened.start(self._consumer_id, self.lease_ms) for opened in plan.ranges]
            markers += plan.markers
        return plans, markers

    def _seek_back(self, first: dict[Any, int]) -> None:
        """Read these partitions again from these offsets (the batches were not handed over).

        Their copies are forgotten by the deduplication: read again, they are not duplicates.
        """
        assigned = self._consumer.assignment()
        for tp, offset in first.items():
            if tp in assigned:
                self._consumer.seek(tp, offset)
        if self._seen is not None:
            self._seen.clear()

    def _hand_over(self, prepared: PreparedBatch) -> TakenBatch | None:
        at = prepared.at
        if prepared.stale():
            # It waited for the application longer than half its lease: renew the lease of
            # what it holds before the tracker counts it as abandoned.
            for marker in prepared.extensions(self.lease_ms):
                self._sink.send_later(marker)
            at = time.monotonic()
        ranges: list[OpenRange] = []
        runs: list[Run] = []
        book = self._book
        for plan in prepared.plans:
            self._counts.deferred += plan.deferred
            self._counts.skipped += plan.skipped
            for whole in plan.ranges:
                book.add(whole)
            ranges += plan.ranges
            runs += plan.deliver
        loose: list[KmqMessage] = []
        messages = MessageBatch(runs, self._context, loose)
        if loose:
            self._loose = [m for m in self._loose if m.settled is None] + loose
        return TakenBatch(messages, ranges, loose, at) if messages else None
