"""Protocol v1's hand-over: one START per message, the offsets committed before the app sees it.

``KmqConsumer(marker_version=1)`` is for trackers older than protocol v2. Each fetched batch
is planned per record, its START (and DELAY) markers are written and acknowledged, the queue
offsets past the batch are committed, and only then are the messages handed over: the KMQ
invariant, one step after another. Apart from the consumer because it shares nothing with the
range path (no pipelining, no range book) but the clients and the deduplication.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from tracker.clock import Clock
from tracker.errors import MarkerWriteFailed
from tracker.ids import MessageId

from .marker_sink import MarkerSink
from .message import KmqMessage, MessageContext
from .offset_commits import offsets_past
from .planning import Action, Planned, SeenCopies, plan_batch
from .pool_source import TakenBatch

log = logging.getLogger("tracker.client.consumer")


@dataclass(slots=True)
class HandOverCounts:
    """Records not handed over, since the consumer started (``KmqConsumer.skipped`` and
    ``deferred``): both hand-over paths count into one."""

    skipped: int = 0  #: other groups' copies and duplicates
    deferred: int = 0  #: not-yet-due delayed records handed to the tracker


class PerMessageTaker:
    """Take batches the v1 way: plan, START each message, wait, commit, hand over."""

    def __init__(
        self,
        *,
        consumer: AIOKafkaConsumer,
        sink: MarkerSink,
        context: MessageContext,
        counts: HandOverCounts,
        seen: SeenCopies | None,
        clock: Clock,
        group_id: str,
        consumer_id: str,
        max_batch: int,
    ) -> None:
        self._consumer = consumer
        self._sink = sink
        self._context = context
        self._counts = counts
        self._seen = seen
        self._clock = clock
        self._group_id = group_id
        self._consumer_id = consumer_id
        self._max_batch = max_batch

    async def take(self, timeout_ms: int, lease_ms: int) -> TakenBatch | None:
        """The next batch, STARTed and committed; None if nothing was fetched or handed over.

        Raises :class:`MarkerWriteFailed` if the broker did not acknowledge the markers; the
        batch is then read again.
        """
        fetched: dict[Any, list[Any]] = await self._consumer.getmany(
            timeout_ms=timeout_ms, max_records=self._max_batch
        )
        records = [record for batch in fetched.values() for record in batch]
        if not records:
            return None
        planned = plan_batch(
            records,
            group=self._group_id,
            consumer_id=self._consumer_id,
            timeout_ms=lease_ms,
            now=self._clock.now(),
            seen=self._seen,
        )
        markers = [p.marker for p in planned if p.marker is not None]
        sent_at = time.monotonic()
        try:
            await self._sink.send_all(markers)
        except MarkerWriteFailed:
            self._rewind(fetched, _taken(planned))
            raise
        if not await self._commit(fetched, _taken(planned)):
            return None
        messages = self._hand_over(planned)
        return TakenBatch(messages, [], messages, sent_at) if messages else None

    def _hand_over(self, planned: list[Planned]) -> list[KmqMessage]:
        messages: list[KmqMessage] = []
        for p in planned:
            if p.action is Action.DELIVER:
                messages.append(KmqMessage(p.record, self._context, None, p.origin, p.attempt))
            elif p.action is Action.DEFER:
                self._counts.deferred += 1
            else:
                self._counts.skipped += 1
                log.debug("skipped %s: %s", p.message, p.why)
        return messages

    async def _commit(
        self, fetched: dict[Any, list[Any]], taken: list[tuple[MessageId, int]]
    ) -> bool:
        try:
            await self._consumer.commit(offsets_past(fetched))
        except KafkaError as exc:
            # Typically a rebalance. The STARTs are written, so the tracker covers these
            # messages; re-reading them (here or at the new owner) is the safe way on.
            log.warning("offset commit failed (%r); the batch will be read again", exc)
            self._rewind(fetched, taken)
            return False
        return True

    def _rewind(self, fetched: dict[Any, list[Any]], taken: list[tuple[MessageId, int]]) -> None:
        """Seek back to the first record of the batch on partitions we still own.

        The copies of the batch are forgotten by the deduplication: read again, they are not
        duplicates (skipping them would commit past copies nobody took).
        """
        if self._seen is not None:
            for origin, attempt in taken:
                self._seen.forget(origin, attempt)
        assigned = self._consumer.assignment()
        for tp, batch in fetched.items():
            if batch and tp in assigned:
                self._consumer.seek(tp, batch[0].offset)


def _taken(planned: list[Planned]) -> list[tuple[MessageId, int]]:
    """The copies a batch takes (what the deduplication must forget if it is read again)."""
    return [(p.origin, p.attempt) for p in planned if p.action is not Action.SKIP]
