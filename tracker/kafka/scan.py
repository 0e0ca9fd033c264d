"""Reading ranges of partitions: high watermarks and bounded scans.

Two users: redrive jobs (before republishing after a takeover, find the records the previous
owner produced but did not record) and the admin API's marker history (the last records of one
markers partition). Both need the true end of a partition, and both must never create a topic.

* The end of a partition comes from a fetch response's high watermark, not from
  ``end_offsets()`` (ListOffsets): on tansu that answers *base offset of the last batch + 1*,
  short of the real end after a batched produce. ``end_offsets()`` is only a hint of where to
  fetch from (it is never too high), so the fetch returns records and a high watermark.
* Which topics exist, and their partition counts, come from an all-topics metadata request:
  a metadata request naming a topic creates it on tansu (and on Kafka with auto-creation on).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from tracker.kafka.clients import start_positional_consumer, stop_consumer
from tracker.kafka.original_records import OriginalsUnavailable
from tracker.kafka.originals import RESERVED_CLIENT_KEYS

_POLL_MS = 50
_MAX_RECORDS = 2000

#: Called with every record read in a scan (an aiokafka ``ConsumerRecord``).
RecordSink = Callable[[Any], None]


class PartitionScanner:
    """One group-less consumer for high watermarks and range scans; calls are serialized."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        client_config: Mapping[str, Any] | None = None,
        timeout: float = 30.0,
    ) -> None:
        config = {k: v for k, v in (client_config or {}).items() if k not in RESERVED_CLIENT_KEYS}
        config.setdefault("fetch_max_wait_ms", _POLL_MS)
        self._bootstrap = bootstrap_servers
        self._config = config
        self._timeout = timeout
        self._consumer: Any = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Connect now (otherwise the first call connects)."""
        async with self._lock:
            await self._start()

    async def _start(self) -> None:
        if self._consumer is not None:
            return
        consumer = await start_positional_consumer(
            self._bootstrap,
            self._config,
            timeout=self._timeout,
            auto_offset_reset="earliest",
            error=OriginalsUnavailable,
        )
        self._consumer = consumer

    async def stop(self) -> None:
        async with self._lock:
            consumer, self._consumer = self._consumer, None
            if consumer is not None:
                # Same aiokafka quirk as OriginalsReader.stop: let the fetcher settle first.
                await asyncio.sleep(0.01)
                await stop_consumer(consumer)

    async def _started(self) -> Any:
        """The consumer, connecting on first use (callers hold ``_lock``)."""
        if self._consumer is None:
            await self._start()
        return self._consumer

    async def partition_counts(self, topics: Iterable[str]) -> dict[str, int | None]:
        """Partitions of each topic (None: it does not exist), without creating any."""
        async with self._lock:
            consumer = await self._started()
        try:
            async with asyncio.timeout(self._timeout):
                cluster = await consumer._client.fetch_all_metadata()
        except (KafkaError, TimeoutError) as exc:
            raise OriginalsUnavailable(f"reading cluster metadata failed: {exc!r}") from exc
        out: dict[str, int | None] = {}
        for topic in topics:
            partitions = cluster.partitions_for_topic(topic)
            out[topic] = len(partitions) if partitions else None
        return out

    async def high_watermarks(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The end offset of each partition, as a fetch response reports it.

        The partitions' topics must exist (see :meth:`partition_counts`).
        """
        return {tp: end for tp, (_, end) in (await self.bounds(tps)).items()}

    async def bounds(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        """``(log start, end)`` of each partition; the end as a fetch response reports it."""
        wanted = sorted(set(tps))
        if not wanted:
            return {}
        async with self._lock:
            consumer = await self._started()
            try:
                return await self._high_watermarks(consumer, wanted)
            except (KafkaError, TimeoutError) as exc:
                raise OriginalsUnavailable(f"reading high watermarks failed: {exc!r}") from exc
            finally:
                if self._consumer is consumer:
                    consumer.assign([])

    async def _high_watermarks(
        self, consumer: Any, tps: list[TopicPartition]
    ) -> dict[TopicPartition, tuple[int, int]]:
        async with asyncio.timeout(self._timeout):
            begins = await consumer.beginning_offsets(tps)
            hints = await consumer.end_offsets(tps)
        consumer.assign(tps)  # a fresh assignment: no high watermark known yet
        for tp in tps:
            consumer.seek(tp, max(begins[tp], hints[tp] - 1))
        found: dict[TopicPartition, int] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while len(found) < len(tps):
            if loop.time() > deadline:
                missing = ", ".join(f"{tp.topic}/{tp.partition}" for tp in tps if tp not in found)
                raise OriginalsUnavailable(f"no fetch response in time for {missing}")
            await consumer.getmany(timeout_ms=_POLL_MS, max_records=1)
            for tp in tps:
                if tp not in found:
                    highwater = consumer.highwater(tp)
                    if highwater is not None:
                        found[tp] = highwater
                        consumer.pause(tp)
        return {tp: (begins[tp], end) for tp, end in found.items()}

    async def scan(
        self,
        ranges: Mapping[TopicPartition, tuple[int, int]],
        sink: RecordSink,
    ) -> None:
        """Pass every record with ``start <= offset < end`` of each partition to ``sink``.

        Raises :class:`OriginalsUnavailable` when reading makes no progress for the timeout.
        Offsets below the log start are simply gone (retention): reading starts at the log
        start then.
        """
        todo = {tp: (start, end) for tp, (start, end) in ranges.items() if end > start}
        if not todo:
            return
        async with self._lock:
            consumer = await self._started()
            try:
                await self._scan(consumer, todo, sink)
            except (KafkaError, TimeoutError) as exc:
                raise OriginalsUnavailable(f"scanning partitions failed: {exc!r}") from exc
            finally:
                if self._consumer is consumer:
                    consumer.assign([])

    async def read_to_end(self, tp: TopicPartition, start: int, sink: RecordSink) -> int:
        """Pass every record of ``tp`` from ``start`` to its end to ``sink``; return the end.

        The end is the high watermark of the fetch responses: no separate offset requests, so
        reading what was written since a known position costs one fetch (the markers tail of
        the message views). An end below ``start`` means the partition restarted (the topic
        was created again): nothing is passed then. A ``start`` below the log start reads
        from the log start (the records before it are gone).
        """
        async with self._lock:
            consumer = await self._started()
            try:
                return await self._read_to_end(consumer, tp, start, sink)
            except (KafkaError, TimeoutError) as exc:
                raise OriginalsUnavailable(
                    f"reading {tp.topic}/{tp.partition} failed: {exc!r}"
                ) from exc
            finally:
                if self._consumer is consumer:
                    consumer.assign([])

    async def _read_to_end(
        self, consumer: Any, tp: TopicPartition, start: int, sink: RecordSink
    ) -> int:
        consumer.assign([tp])  # a fresh assignment: no high watermark known yet
        # From the record before: a fetch that has a record to return answers at once, where
        # one at the end would wait fetch_max_wait_ms for new records to arrive.
        consumer.seek(tp, max(start - 1, 0))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while True:
            if loop.time() > deadline:
                raise OriginalsUnavailable(f"no progress reading {tp.topic}/{tp.partition}")
            batch = await consumer.getmany(tp, timeout_ms=_POLL_MS, max_records=_MAX_RECORDS)
            end: int | None = consumer.highwater(tp)
            if end is None:
                continue
            if end < start:
                return end
            records = batch.get(tp, ())
            for record in records:
                if record.offset >= start:
                    sink(record)
            if records:
                deadline = loop.time() + self._timeout
            if await consumer.position(tp) >= end:
                return end

    async def _scan(
        self,
        consumer: Any,
        todo: dict[TopicPartition, tuple[int, int]],
        sink: RecordSink,
    ) -> None:
        consumer.assign(list(todo))
        for tp, (start, _) in todo.items():
            consumer.seek(tp, start)
        active = dict(todo)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while active:
            if loop.time() > deadline:
                stuck = ", ".join(f"{tp.topic}/{tp.partition}" for tp in active)
                raise OriginalsUnavailable(f"no progress scanning {stuck}")
            batch = await consumer.getmany(timeout_ms=_POLL_MS, max_records=_MAX_RECORDS)
            for tp, records in batch.items():
                bounds = active.get(tp)
                if bounds is None:
                    continue
                for record in records:
                    if bounds[0] <= record.offset < bounds[1]:
                        sink(record)
                if records:
                    deadline = loop.time() + self._timeout
            for tp in list(active):
                position = await consumer.position(tp)
                if position >= active[tp][1]:
                    consumer.pause(tp)
                    del active[tp]
