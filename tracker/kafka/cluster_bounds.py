"""What the originals reader has learned of the cluster lately: topics, partitions, bounds.

A burst of redelivery rounds reads every ~50 ms; asking the broker for the cluster's metadata
and every partition's bounds each time was two of a round's four round trips. This keeps both
for a short while (``KNOWN_MAX_AGE``) and says when they must be read again: a topic or
partition not in the cached metadata is asked about again before it is called missing; an
offset at or past the cached end makes the bounds be read again; a log start that moved
meanwhile is found by the read itself (Kafka answers out of range, and gaps are checked
against a fresh log start). Every broker interaction is bounded by the reader's
``fetch_timeout``, and a failure means "later" (:class:`OriginalsUnavailable`), never "lost".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from aiokafka.errors import KafkaError

from tracker.kafka.original_records import OriginalsUnavailable

T = TypeVar("T")

#: How long what was learned may be reused (seconds).
KNOWN_MAX_AGE = 1.0


class ClusterBounds:
    """Cached cluster metadata and partition bounds for one originals reader's consumer."""

    def __init__(self, bootstrap_servers: str, fetch_timeout: float) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.fetch_timeout = fetch_timeout
        self._cluster: Any = None  #: the last all-topics metadata, and when (loop time)
        self._cluster_at = 0.0
        self._known: dict[Any, tuple[int, int, float]] = {}  #: tp: (begin, end, when)

    def saw_end(self, tp: Any, high_watermark: int) -> None:
        """A fetch response showed ``high_watermark`` as the end of ``tp``: keep the larger."""
        known = self._known.get(tp)
        if known is not None:
            self._known[tp] = (known[0], max(known[1], high_watermark), known[2])

    async def metadata(self, consumer: Any, wanted: Mapping[tuple[str, int], Any]) -> Any:
        """The cluster's metadata: the cached one if recent and it knows every wanted
        partition, else fresh (nothing is called missing on the strength of a cache)."""
        now = asyncio.get_running_loop().time()
        cluster = self._cluster
        if (
            cluster is not None
            and now - self._cluster_at < KNOWN_MAX_AGE
            and all(
                partition in (cluster.partitions_for_topic(topic) or ())
                for topic, partition in wanted
            )
        ):
            return cluster
        # The consumer's client is aiokafka-internal but stable; the public consumer.topics()
        # makes the same request and throws the partition counts away.
        cluster = await self.within(
            consumer._client.fetch_all_metadata(), "reading cluster metadata"
        )
        self._cluster, self._cluster_at = cluster, now
        return cluster

    async def known_bounds(
        self, consumer: Any, wanted: dict[Any, set[int]]
    ) -> tuple[dict[Any, int], dict[Any, int]]:
        """Each wanted partition's (log start, end): recent ones reused while every wanted
        offset lies below the known end, the others read from the broker."""
        now = asyncio.get_running_loop().time()
        begins: dict[Any, int] = {}
        ends: dict[Any, int] = {}
        ask: list[Any] = []
        for tp, offsets in wanted.items():
            known = self._known.get(tp)
            if known is not None and now - known[2] < KNOWN_MAX_AGE and max(offsets) < known[1]:
                begins[tp], ends[tp] = known[0], known[1]
            else:
                ask.append(tp)
        if ask:
            fresh_begins, fresh_ends = await self.bounds(consumer, ask)
            for tp in ask:
                begins[tp], ends[tp] = fresh_begins[tp], fresh_ends[tp]
                self._known[tp] = (begins[tp], ends[tp], now)
        if len(self._known) > 4 * len(wanted) + 1024:  # forget what is no longer read
            self._known = {
                tp: known for tp, known in self._known.items() if now - known[2] < KNOWN_MAX_AGE
            }
        return begins, ends

    async def bounds(self, consumer: Any, tps: list[Any]) -> tuple[dict[Any, int], dict[Any, int]]:
        begins, ends = await self.within(
            asyncio.gather(consumer.beginning_offsets(tps), consumer.end_offsets(tps)),
            "reading partition offsets",
        )
        return begins, ends

    async def within(self, awaitable: Awaitable[T], what: str) -> T:
        """Await one broker interaction, bounded by ``fetch_timeout``; failures mean "later"."""
        try:
            async with asyncio.timeout(self.fetch_timeout):
                return await awaitable
        except TimeoutError as exc:
            raise OriginalsUnavailable(
                f"{what}: Kafka at {self.bootstrap_servers} did not answer within "
                f"{self.fetch_timeout:g}s"
            ) from exc
        except KafkaError as exc:
            raise OriginalsUnavailable(f"{what}: {exc!r}") from exc
