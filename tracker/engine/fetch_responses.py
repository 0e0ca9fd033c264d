"""What the markers consumer's fetch responses tell ingest: how far it is caught up, and
whether the broker still answers.

Each fetch response reports a partition's high watermark at that moment. Once ingest has read
up to one, every marker the broker had then has been read: that moment is the partition's
``caught_up_ms``, from which ``MarkerIngest.safe_until`` (the safe horizon) follows. And the
responses keep coming every ``fetch_max_wait_ms`` while the broker is healthy, so their
absence is how an unreachable broker shows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from tracker.clock import Clock, to_millis
from tracker.metrics import Metrics

#: High watermarks remembered per partition until we read past them (older ones are dropped:
#: that only delays ``caught_up_ms``, never advances it too far).
MAX_ENDS = 256

#: Without a fetch response for this long, the broker counts as unreachable (readiness).
BROKER_SILENCE_MS = 5_000


class PartitionEnds(Protocol):
    """What is kept per owned markers partition to know when it was caught up."""

    #: tracker-clock time at which we had read everything the broker had (None: not yet)
    caught_up_ms: int | None
    #: (high watermark, wall-clock ms of the fetch response that reported it), oldest first:
    #: the broker's end at moments we have not read up to yet
    ends: deque[tuple[int, float]]


class FetchResponses:
    """Reads the markers consumer's fetch responses for the partitions ingest owns."""

    def __init__(
        self, *, consumer: Any, markers_topic: str, clock: Clock, metrics: Metrics
    ) -> None:
        self._consumer = consumer
        self._topic = markers_topic
        self._clock = clock
        self._metrics = metrics

    async def note_caught_up(self, owned: Mapping[int, PartitionEnds]) -> int | None:
        """Record, per partition, when we last had read everything the broker had.

        Each fetch response tells the partition's high watermark at the time of the response.
        The consumer only remembers the newest, and with markers arriving continuously the
        next response has usually come in (prefetched) before we read to the previous one's
        end, so "position >= newest high watermark" held only now and then (the safe horizon
        advanced in jumps of 0.3-0.5 s at 1k markers/s). Every end seen is remembered
        instead, and the newest one we have read past sets ``caught_up_ms``: every marker the
        broker had at that fetch has been read.

        Returns the newest ``caught_up_ms`` that advanced (None: none did).
        """
        now_ms = to_millis(self._clock.now())
        wall_ms = time.time() * 1000
        advanced: int | None = None
        for partition, state in owned.items():
            tp = TopicPartition(self._topic, partition)
            highwater = self._consumer.highwater(tp)
            fetched_at = self._consumer.last_poll_timestamp(tp)
            if highwater is None or fetched_at is None:
                continue
            if not state.ends or state.ends[-1][1] != fetched_at:
                state.ends.append((highwater, fetched_at))
            position = await self._consumer.position(tp)
            self._metrics.markers_lag.labels(str(partition)).set(max(0, highwater - position))
            reached: float | None = None
            while state.ends and state.ends[0][0] <= position:
                reached = state.ends.popleft()[1]
            if reached is not None:
                # The fetch's wall-clock time on the tracker's clock (they differ only when
                # a test injects a clock).
                caught_up = now_ms - max(0, int(wall_ms - reached))
                if state.caught_up_ms is None or caught_up > state.caught_up_ms:
                    state.caught_up_ms = caught_up
                    advanced = caught_up if advanced is None else max(advanced, caught_up)
        return advanced

    def broker_answering(self, partitions: Iterable[int], otherwise: bool) -> bool:
        """Whether fetch responses for our partitions still arrive (readiness asks this).

        aiokafka does not raise when the broker goes away, it just fetches nothing: no fetch
        response for a while (they come every ``fetch_max_wait_ms`` when healthy) means the
        broker is unreachable. Read from the consumer's fetch times at the moment of asking,
        not from the ingest loop, which may itself be stuck in the outage (a commit waits
        for the group coordinator as long as the broker is away). ``otherwise`` is the answer
        when nothing is owned or nothing was fetched yet.
        """
        newest: float | None = None
        for partition in partitions:
            try:
                fetched = self._consumer.last_poll_timestamp(TopicPartition(self._topic, partition))
            except (KafkaError, AssertionError, AttributeError, KeyError):  # revoked meanwhile
                continue
            if fetched is not None and fetched > 0:
                newest = fetched if newest is None else max(newest, fetched)
        if newest is None:  # nothing owned, or nothing fetched yet: what the loop last saw
            return otherwise
        return time.time() * 1000 - newest <= BROKER_SILENCE_MS
