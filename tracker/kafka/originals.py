"""Read original records back by position, for the tracker's redelivery loop.

When a message is due (its lease ran out, or a retry/delay is due), the tracker republishes a
copy of the *original* record: same key, value and headers. The store keeps only positions
(``topic/partition/offset``), so the payload is read back from Kafka here.

Why this is not a plain consumer loop:

- Positions arrive in bulk (thousands per tick) and unordered. They are grouped per partition,
  sorted, and read with as few round trips as possible: one seek to the first wanted offset,
  then reading forward while the next wanted offset is close (``max_gap``), seeking again only
  across large gaps. All partitions are fetched concurrently by one consumer.
- A record can be gone for good (retention moved the log start, compaction removed it, it
  never existed). Such positions come back as :class:`Missing` with a human-readable reason,
  never as an exception, so the tracker can record the loss and move on (DESIGN: "never
  silently dropped"). An unreachable or slow broker is the opposite case: the records are not
  known to be lost, so :class:`OriginalsUnavailable` is raised and the caller retries later.
- Asking about a topic must never create it. tansu auto-creates topics on any metadata request
  naming them, and so does Apache Kafka with ``auto.create.topics.enable`` (the default), so
  existence is checked with an all-topics metadata request before the consumer is pointed at
  anything.
- The end of a partition is taken from fetch responses (their high watermark), not from
  ``end_offsets()``: tansu's ListOffsets(latest) answers *base offset of the last batch + 1*,
  which is short of the real end whenever the last producer batch held more than one record.
  ``end_offsets()`` is used only as a hint of where to look (it is exact on Kafka and never
  too high on tansu). A position is declared beyond the end only once a fetch response showed
  a high watermark at or below it.
- Seeking past the end behaves differently per broker: Apache Kafka answers
  ``OFFSET_OUT_OF_RANGE``, tansu returns nothing (and no error) forever. The reader avoids
  seeking past the end where it can (it probes at the last record instead) and treats an
  out-of-range answer (e.g. retention racing the read) by re-reading the bounds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar

from aiokafka.errors import (
    ConsumerStoppedError,
    KafkaError,
    OffsetOutOfRangeError,
    RecordTooLargeError,
)

from tracker.errors import ClientClosed
from tracker.ids import MessageId
from tracker.kafka.clients import start_positional_consumer, stop_consumer
from tracker.kafka.cluster_bounds import ClusterBounds
from tracker.kafka.original_records import (
    Missing,
    OriginalRecord,
    OriginalsUnavailable,
)
from tracker.kafka.partition_read import PartitionRead, existing_partitions, plan_reads

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_FETCH_TIMEOUT = 30.0
DEFAULT_MAX_GAP = 500

#: How long one ``getmany`` may wait for buffered records before the loop re-checks positions
#: (and its no-progress deadline). Short, because some answers come without records and so
#: without a wake-up: a compacted gap or a batch of transaction markers moves the position
#: silently, and an empty fetch at the end of a partition only updates the high watermark.
_POLL_SECONDS = 0.05

#: Broker-side wait for an empty fetch. Short: an empty answer is how the end of a partition
#: is confirmed, and the reader is waiting for it.
_FETCH_MAX_WAIT_MS = 50

#: Bytes one fetch brings per partition, unless ``client_config`` says otherwise. aiokafka's
#: default (1 MiB) had every redelivery round pull up to 1 MiB from each partition it reads,
#: thousands of records for the few dozen it wants: 8 MiB per round of a steady load, which
#: the broker serves and the client copies before all but those few are dropped, and which
#: held the tracker's own markers fetches back (a tenth of them took 200 ms on the test
#: broker). Longer runs of wanted offsets are read in several fetches; a record larger than
#: this still comes back whole (Kafka returns the first batch of a partition whatever its
#: size).
_PARTITION_FETCH_BYTES = 128 * 1024

#: Pause before stopping the consumer (see OriginalsReader.stop).
_SETTLE_SECONDS = 0.01

#: Records taken from aiokafka's buffers per turn. aiokafka turns every record it hands out
#: into a ConsumerRecord (costlier than the fetch itself), and one fetch brings up to
#: ``max_partition_fetch_bytes`` per partition. Taking a slice at a time means a partition
#: that is done, or a seek, drops the rest of its buffer undecoded. Measured on tansu with
#: 80k records in 8 partitions: 2-4x faster for sparse or partial reads, same for dense ones.
_MAX_RECORDS = 1000

#: Consumer settings the reader depends on; ``client_config`` may not override them.
RESERVED_CLIENT_KEYS = frozenset(
    {
        "bootstrap_servers",
        "group_id",
        "group_instance_id",
        "enable_auto_commit",
        "auto_offset_reset",
        "key_deserializer",
        "value_deserializer",
    }
)


class OriginalsReader:
    """Fetch original records by position: ``await reader.fetch(positions)``.

    Usage::

        async with OriginalsReader("localhost:9092") as reader:
            found = await reader.fetch([MessageId("orders", 0, 41), ...])
            for position, result in found.items():
                if isinstance(result, Missing):
                    record_lost(position, result.reason)
                else:
                    republish(position, result)

    One consumer without a group (nothing is committed) with manual assignment. Concurrent
    :meth:`fetch` calls are serialized: the consumer has one position per partition.

    ``max_gap``: keep reading forward while the next wanted offset is at most this many
    offsets ahead of the current position; further away, seek. Reading through a gap costs
    bandwidth, a seek costs a round trip.

    ``fetch_timeout`` (seconds) bounds every wait on the broker: a metadata or offsets request
    that takes longer, or a read that makes no progress for that long, raises
    :class:`OriginalsUnavailable`. It bounds progress, not the whole call, so a very large
    request is not cut off while the broker keeps delivering.

    ``client_config``: extra :class:`aiokafka.AIOKafkaConsumer` settings (security, fetch
    sizes, ``isolation_level``...). The keys in :data:`RESERVED_CLIENT_KEYS` are set by the
    reader. With ``isolation_level="read_committed"``, a record of a transaction that is still
    open cannot be read until it ends: such a fetch raises :class:`OriginalsUnavailable` after
    ``fetch_timeout`` (try later), and a record of an aborted one is reported as missing.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        client_config: Mapping[str, Any] | None = None,
        max_gap: int = DEFAULT_MAX_GAP,
        fetch_timeout: float = DEFAULT_FETCH_TIMEOUT,
    ) -> None:
        if max_gap < 0:
            raise ValueError(f"max_gap must be >= 0, not {max_gap}")
        if fetch_timeout <= 0:
            raise ValueError(f"fetch_timeout must be positive, not {fetch_timeout}")
        config = dict(client_config or {})
        reserved = sorted(RESERVED_CLIENT_KEYS.intersection(config))
        if reserved:
            raise ValueError(f"client_config may not set {', '.join(reserved)}: the reader does")
        self.bootstrap_servers = bootstrap_servers
        self.max_gap = max_gap
        self.fetch_timeout = fetch_timeout
        config.setdefault("fetch_max_wait_ms", _FETCH_MAX_WAIT_MS)
        config.setdefault("max_partition_fetch_bytes", _PARTITION_FETCH_BYTES)
        config.setdefault("request_timeout_ms", max(int(fetch_timeout * 1000), 1000))
        self._config = config
        self._consumer: Any = None
        self._lock = asyncio.Lock()
        self._cluster = ClusterBounds(bootstrap_servers, fetch_timeout)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the cluster. Raises :class:`OriginalsUnavailable` if it does not answer."""
        if self._consumer is not None:
            return
        # Never jump elsewhere on an out-of-range offset: Kafka then reports the error and
        # the reader reclassifies the position instead of reading the wrong records.
        consumer = await start_positional_consumer(
            self.bootstrap_servers,
            self._config,
            timeout=self.fetch_timeout,
            auto_offset_reset="none",
            error=OriginalsUnavailable,
        )
        self._consumer = consumer

    async def stop(self) -> None:
        """Close the consumer (idempotent).

        Waits for a fetch in progress to finish (it is bounded by ``fetch_timeout`` without
        progress); cancel the fetching task first for an immediate shutdown.
        """
        async with self._lock:
            consumer, self._consumer = self._consumer, None
            if consumer is None:
                return
            # aiokafka 0.14 bug: if the consumer is stopped while its fetcher task is still
            # cancelling the fetches of a previous assignment (fetch() ends with assign([])),
            # the fetcher swallows its own cancellation and stop() hangs forever. Letting the
            # event loop run briefly lets the fetcher finish that first (a few loop turns).
            await asyncio.sleep(_SETTLE_SECONDS)
            await stop_consumer(consumer)

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

    # -- reading ------------------------------------------------------------------------------

    async def fetch(
        self, positions: Iterable[MessageId]
    ) -> dict[MessageId, OriginalRecord | Missing]:
        """Read the records at ``positions``; every distinct position gets an entry.

        A record that exists maps to :class:`OriginalRecord`; one that is gone or never existed
        maps to :class:`Missing` (this never raises for such positions). Raises
        :class:`OriginalsUnavailable` when the broker does not answer in time (retry later:
        nothing is known to be lost) and :class:`~tracker.errors.ClientClosed` when the reader
        is not started.
        """
        if self._consumer is None:
            raise ClientClosed("the originals reader is not started")
        by_partition: dict[tuple[str, int], set[int]] = {}
        for topic, partition, offset in positions:
            by_partition.setdefault((topic, partition), set()).add(offset)
        if not by_partition:
            return {}
        async with self._lock:
            consumer = self._consumer
            if consumer is None:
                raise ClientClosed("the originals reader was stopped")
            try:
                return await self._fetch(consumer, by_partition)
            except ConsumerStoppedError as exc:
                raise ClientClosed("the originals reader was stopped during a fetch") from exc
            finally:
                if self._consumer is consumer:
                    # Drop the assignment: stops background prefetching, and stops the client
                    # from tracking these topics' metadata (a later refresh naming a topic that
                    # was deleted meanwhile would re-create it).
                    consumer.assign([])

    async def _fetch(
        self, consumer: Any, by_partition: dict[tuple[str, int], set[int]]
    ) -> dict[MessageId, OriginalRecord | Missing]:
        results: dict[MessageId, OriginalRecord | Missing] = {}

        # 1. Which topics and partitions exist, without creating any (all-topics metadata).
        cluster = await self._cluster.metadata(consumer, by_partition)
        existing = existing_partitions(cluster, by_partition, results)
        if not existing:
            return results

        # 2. The partitions' bounds. Below the log start is certainly gone (retention); the end
        # is settled by fetch responses while reading (see PartitionRead).
        begins, ends = await self._cluster.known_bounds(consumer, existing)
        reads = plan_reads(existing, begins, ends, results)
        if not reads:
            return results

        # 3. Read forward from the first wanted offset of every partition, concurrently.
        await self._read(consumer, reads, results)
        for read in reads:  # what the fetch responses told of the end
            if read.high_watermark is not None:
                self._cluster.saw_end(read.tp, read.high_watermark)

        # 4. In range but never returned: compacted, a transaction marker, or (if the log start
        # moved while reading) deleted by retention. Look at the log start again to tell.
        with_gaps = [read for read in reads if read.gaps]
        if with_gaps:
            fresh_begins, _ = await self._cluster.bounds(consumer, [read.tp for read in with_gaps])
            for read in with_gaps:
                read.settle_gaps(fresh_begins.get(read.tp, read.begin), results)
        return results

    async def _read(
        self,
        consumer: Any,
        reads: list[PartitionRead],
        results: dict[MessageId, OriginalRecord | Missing],
    ) -> None:
        active = {read.tp: read for read in reads}
        positions = {read.tp: read.seek_target(read.plan[0]) for read in reads}
        # Assign and seek without yielding in between: a partition without a position would
        # make the fetcher try to reset it (and fail, since auto_offset_reset is "none").
        consumer.assign(list(active))
        for tp, position in positions.items():
            consumer.seek(tp, position)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.fetch_timeout
        while active:
            remaining = deadline - loop.time()
            if remaining <= 0:
                stuck = ", ".join(
                    f"{tp.topic}/{tp.partition}@{positions[tp]}" for tp in sorted(active)
                )
                raise OriginalsUnavailable(
                    f"no progress reading original records for {self.fetch_timeout:g}s "
                    f"(partitions at: {stuck})"
                )
            progress = False
            try:
                async with asyncio.timeout(remaining + 1.0):
                    batch = await self._take(consumer, active, positions, remaining)
            except OffsetOutOfRangeError as exc:
                progress = await self._out_of_range(consumer, exc, active, positions, results)
                batch = {}
            except RecordTooLargeError as exc:
                raise OriginalsUnavailable(
                    f"a record is larger than the fetch size; raise max_partition_fetch_bytes "
                    f"in client_config ({exc})"
                ) from exc
            except (KafkaError, TimeoutError) as exc:
                raise OriginalsUnavailable(f"reading original records failed: {exc!r}") from exc

            for tp, records in batch.items():
                partition_read = active.get(tp)
                if partition_read is not None and records:
                    partition_read.collect(records, results)
                    progress = True

            # Positions and high watermarks can change without records (compacted gaps,
            # transaction markers, an empty fetch at the end), so look at every active
            # partition, not only those that returned something.
            for tp, partition_read in list(active.items()):
                position = await self._cluster.within(consumer.position(tp), "reading a position")
                high_watermark = consumer.highwater(tp)
                if high_watermark is not None and high_watermark != partition_read.high_watermark:
                    partition_read.high_watermark = high_watermark
                    progress = True
                if position != positions[tp]:
                    positions[tp] = position
                    progress = True
                target = partition_read.advance(position, results)
                if target is None:
                    consumer.pause(tp)
                    del active[tp]
                    continue
                destination = partition_read.seek_target(target)
                if destination - position > self.max_gap:
                    consumer.seek(tp, destination)
                    positions[tp] = destination
            if progress:
                deadline = loop.time() + self.fetch_timeout

    async def _take(
        self,
        consumer: Any,
        active: dict[Any, PartitionRead],
        positions: dict[Any, int],
        remaining: float,
    ) -> dict[Any, list[Any]]:
        """Records fetched for the active partitions: from each, at most up to its last
        wanted offset; if none has any yet, wait (briefly) for the first to arrive.

        A fetch brings up to ``max_partition_fetch_bytes`` per partition, thousands of
        records, and aiokafka turns every record it hands out into a ``ConsumerRecord``.
        Taken with one ``max_records`` across partitions, a round wanting 2 records of each
        of 8 partitions decoded 4,000 (four calls of 1,000, a partition at a time). Taken per
        partition, up to what that partition still needs, the rest of its buffer is dropped
        undecoded when it is paused.
        """
        batch: dict[Any, list[Any]] = {}
        for tp, partition_read in active.items():
            need = partition_read.plan[-1] - positions[tp] + 1
            if need > 0:
                batch.update(
                    await consumer.getmany(tp, timeout_ms=0, max_records=min(need, _MAX_RECORDS))
                )
        if any(batch.values()):
            return batch
        return dict(
            await consumer.getmany(
                *active, timeout_ms=int(min(remaining, _POLL_SECONDS) * 1000), max_records=1
            )
        )

    async def _out_of_range(
        self,
        consumer: Any,
        exc: OffsetOutOfRangeError,
        active: dict[Any, PartitionRead],
        positions: dict[Any, int],
        results: dict[MessageId, OriginalRecord | Missing],
    ) -> bool:
        """The broker refused a fetch offset: re-read the bounds and carry on from there.

        Happens on Apache Kafka when retention moves the log start past a wanted offset during
        the read, or when a seek went past the end (tansu never answers this way: it returns
        nothing). Wanted offsets now below the log start are gone; the rest is read again,
        approaching the end from the last listed record. Returns whether anything was settled
        (only that counts as progress: a broker that keeps refusing offsets it lists as valid
        must run into the deadline, not loop forever).
        """
        settled = False
        failed = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
        tps = [tp for tp in failed if tp in active] or list(active)
        begins, ends = await self._cluster.bounds(consumer, tps)
        for tp in tps:
            read = active[tp]
            settled = read.rebound(begins[tp], ends[tp], results) or settled
            log.info(
                "offset out of range on %s/%s; log start %d, end %d",
                tp.topic,
                tp.partition,
                read.begin,
                read.listed_end,
            )
            if read.done:
                consumer.pause(tp)
                del active[tp]
            else:
                destination = read.seek_target(read.plan[read.next_index])
                consumer.seek(tp, destination)
                positions[tp] = destination
        return settled
