"""Parking refused markers on the invalid-markers topic, for inspection.

A marker the tracker cannot use (malformed, unknown topic, not on its origin's markers
partition, or valid but not applicable such as a stale or unmatched one) is never silently
skipped: it is counted, logged with its position, and its raw bytes are produced to the
invalid-markers topic with headers saying where it came from and why it was refused.

The parked copy is a new record stamped when it is parked (the producer's clock, or the
broker's with ``LogAppendTime``); the refused record's own timestamp, which may be anything a
writer put there, is kept in the ``kmq-invalid-timestamp`` header instead, so a broker that
bounds timestamps (``message.timestamp.after.max.ms``, one hour by default since Kafka 4.0)
never refuses the copy for it. Ingest waits for the parked copies before it moves past the
originals, so a copy the broker refuses *for its content* would stall ingest on it for ever:
such a record (too large for the invalid topic, say) is parked again alone, and if the broker
still refuses it, as a stub: the headers, the error, no key or value. Any other failure
(broker unreachable, the tracker's own clock refused) is raised, and ingest reads the
partitions again after a backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from aiokafka.errors import (
    CorruptRecordException,
    InvalidTimestampError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)

from tracker.headers import (
    INVALID_CATEGORY,
    INVALID_REASON,
    INVALID_SIZE,
    INVALID_SOURCE,
    INVALID_STUB,
    INVALID_TIMESTAMP,
)
from tracker.protocol import encode_any
from tracker.store.port import PendingMarker

log = logging.getLogger(__name__)

#: A refused record's category (for counting many at once without a Python frame each).
category_of = attrgetter("category")


def _invalid_partition(partitions: Sequence[int], source: int) -> int:
    """The invalid partition that markers partition ``source`` parks on: the
    ``source % len``-th of the invalid topic's sorted ``partitions``.

    A markers partition's refused records always land on the same invalid partition, in the
    order they were read; and a poll's records from several markers partitions go out in one
    request per broker, one batch per partition (a producer sends one batch per partition
    per request and waits for it: records all bound for one partition went out one batch per
    round trip).
    """
    return partitions[source % len(partitions)]


#: Broker refusals of a parked record for what it contains: sending the same bytes again can
#: never succeed. A stamp the broker finds out of range is one of them: the producer's clock
#: stamps the stub too, so a stub refused for it means the tracker's clock is off (raised).
REFUSED_CONTENT: tuple[type[KafkaError], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    CorruptRecordException,
    InvalidTimestampError,
)


class Rejected:
    """A refused markers record: the record as consumed, why, and the category
    (``malformed`` | ``unknown_topic`` | ``wrong_partition`` | ``anomaly``).

    A plain slotted class, not a frozen dataclass: ingest builds one per refused record, and
    a frozen dataclass's ``__init__`` costs three times as much (0.58 against 0.19 us).
    """

    __slots__ = ("category", "reason", "record")

    def __init__(self, record: Any, reason: str, category: str) -> None:
        self.record = record
        self.reason = reason
        self.category = category

    def __repr__(self) -> str:
        return f"Rejected({self.record!r}, {self.reason!r}, {self.category!r})"


class _Parked:
    """One record to produce to the invalid topic (compared and hashed by identity).

    A plain slotted class, not a frozen dataclass: one is built per refused record, and a
    frozen dataclass's ``__init__`` costs several times as much.
    """

    __slots__ = ("headers", "key", "value")

    def __init__(self, key: bytes | None, value: bytes | None, headers: list[Any]) -> None:
        self.key = key
        self.value = value
        self.headers = headers


_TOMBSTONE = (INVALID_CATEGORY + "-tombstone", b"1")


class _ParkedHeaders:
    """The headers that say where a parked record came from and why, built for one batch.

    The category and reason are the same for most records of a batch (a producer gone wrong
    writes the same garbage many times): each distinct pair is encoded once and its header
    tuples are shared. The source is the markers partition's prefix, written once, and the
    offset.
    """

    def __init__(self, markers_topic: str) -> None:
        self._markers_topic = markers_topic
        self._labels: dict[tuple[str, str], tuple[tuple[str, bytes], tuple[str, bytes]]] = {}
        self._prefixes: dict[int, bytes] = {}

    def label(self, category: str, reason: str) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
        """The category and reason headers (built once per distinct pair)."""
        label = self._labels.get((category, reason))
        if label is None:
            label = self._labels[category, reason] = (
                (INVALID_CATEGORY, category.encode()),
                (INVALID_REASON, reason.encode("utf-8", "replace")[:2048]),
            )
        return label

    def prefix(self, partition: int) -> bytes:
        """The source header's value up to the offset (built once per markers partition)."""
        prefix = self._prefixes.get(partition)
        if prefix is None:
            prefix = self._prefixes[partition] = f"{self._markers_topic}/{partition}/".encode()
        return prefix

    def of(self, category: str, reason: str, partition: int, offset: int) -> list[Any]:
        return [
            *self.label(category, reason),
            (INVALID_SOURCE, self.prefix(partition) + b"%d" % offset),
        ]


#: Refused markers logged one line each per window; the rest of the window is summed up.
LOG_EACH_PER_WINDOW = 10
LOG_WINDOW_S = 60.0


class _LogBudget:
    """At most ``limit`` individual log lines per window, so garbage cannot flood the log.

    A producer gone wrong can write thousands of bad markers a second; logging each one costs
    more than parking it and buries everything else. Every refused marker is still counted in
    ``kmq_markers_invalid_total`` and parked with its reason; the log shows the first few of each
    window and one summary line per batch for the rest.
    """

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float]) -> None:
        self._limit = limit
        self._window_s = window_s
        self._clock = clock
        self._window_start = -window_s
        self._used = 0

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` lines may be logged one by one now (taken from the budget)."""
        now = self._clock()
        if now - self._window_start >= self._window_s:
            self._window_start, self._used = now, 0
        granted = max(0, min(wanted, self._limit - self._used))
        self._used += granted
        return granted


class InvalidMarkerParker:
    def __init__(
        self,
        producer: Any,
        invalid_topic: str,
        markers_topic: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._producer = producer
        self._topic = invalid_topic
        self._markers_topic = markers_topic
        self._log_budget = _LogBudget(LOG_EACH_PER_WINDOW, LOG_WINDOW_S, clock)

    def _log(self, rejected: Sequence[Rejected]) -> None:
        logged = self._log_budget.take(len(rejected))
        for item in rejected[:logged]:
            record = item.record
            log.warning(
                "invalid marker at %s/%s/%s (%s): %s",
                self._markers_topic,
                record.partition,
                record.offset,
                item.category,
                item.reason,
            )
        unlogged = Counter(map(category_of, rejected[logged:]))
        if unlogged:
            log.warning(
                "%d more invalid markers on %s (%s); all parked on %s",
                sum(unlogged.values()),
                self._markers_topic,
                ", ".join(f"{n} {category}" for category, n in sorted(unlogged.items())),
                self._topic,
            )

    async def _invalid_partitions(self) -> list[int]:
        """The invalid topic's partitions, sorted (see :func:`_invalid_partition`)."""
        return sorted(await self._producer.partitions_for(self._topic))

    async def _send_all(self, groups: dict[int, list[_Parked]]) -> dict[_Parked, KafkaError]:
        """:meth:`_send_batches` for every partition's records at once."""
        sent = await asyncio.gather(
            *(self._send_batches(ones, partition) for partition, ones in groups.items())
        )
        return {one: error for refused in sent for one, error in refused.items()}

    def _build(
        self, rejected: Sequence[Rejected], partitions: Sequence[int]
    ) -> dict[int, list[_Parked]]:
        """The parked records of one batch of refused markers, by invalid partition
        (:func:`_invalid_partition`), in the order they were read.

        One pass, the header tuples shared (see :class:`_ParkedHeaders`): its loop runs once
        per refused record, and with half the markers garbage parking was most of ingest's
        time.
        """
        headers = _ParkedHeaders(self._markers_topic)
        label, prefix = headers.label, headers.prefix
        groups: dict[int, list[_Parked]] = defaultdict(list)
        for item in rejected:
            record = item.record
            source = record.partition
            category, reason = label(item.category, item.reason)
            timestamp = getattr(record, "timestamp", None)
            where = (INVALID_SOURCE, prefix(source) + b"%d" % record.offset)
            if timestamp is not None:
                parked_headers = [category, reason, where, (INVALID_TIMESTAMP, b"%d" % timestamp)]
            else:
                parked_headers = [category, reason, where]
            value, key = record.value, record.key
            if value is None and key is None:
                # Kafka clients refuse a record with neither key nor value: park an empty
                # value and say that it was a tombstone.
                value = b""
                parked_headers.append(_TOMBSTONE)
            groups[_invalid_partition(partitions, source)].append(
                _Parked(key, value, parked_headers)
            )
        return groups

    async def park(self, rejected: Sequence[Rejected]) -> None:
        """Produce the raw records and wait for the broker; raises ``KafkaError`` if it fails.

        The records go out as whole batches (one per ``max_batch_size``) rather than one
        ``send`` each: a markers batch that is half garbage must not be slowed down by it.
        A batch refused for its content (``REFUSED_CONTENT``) is parked again one record at
        a time, and a record refused alone is parked as a stub (see the module docstring).
        """
        if not rejected:
            return
        self._log(rejected)
        groups = self._build(rejected, await self._invalid_partitions())
        refused = await self._send_all(groups)
        if not refused:
            return
        partition_of = {one: partition for partition, ones in groups.items() for one in ones}
        alone = await asyncio.gather(
            *(self._send_batches([one], partition_of[one]) for one in refused),
        )
        errors = [(one, error) for sent in alone for one, error in sent.items()]
        if not errors:
            return
        for one, error in errors:
            source = dict(one.headers).get(INVALID_SOURCE, b"?").decode()
            log.warning(
                "the broker refuses the raw record of invalid marker %s (%r); parking a stub "
                "without its key and value on %s",
                source,
                error,
                self._topic,
            )
        stubs: dict[int, list[_Parked]] = defaultdict(list)
        for one, error in errors:
            stubs[partition_of[one]].append(
                _Parked(
                    None,
                    b"",
                    [
                        *one.headers,
                        (INVALID_STUB, repr(error).encode("utf-8", "replace")[:512]),
                        (INVALID_SIZE, str(len(one.value or b"") + len(one.key or b"")).encode()),
                    ],
                )
            )
        stub_errors = await self._send_all(stubs)
        if stub_errors:
            raise next(iter(stub_errors.values()))

    async def _send_batches(
        self, parked: Sequence[_Parked], partition: int
    ) -> dict[_Parked, KafkaError]:
        """Produce ``parked`` in as few batches as fit and wait for every one.

        Returns the records of the batches the broker refused for their content, with the
        error; raises ``KafkaError`` for any other failure.
        """
        producer, topic = self._producer, self._topic
        sent: list[tuple[list[_Parked], Any]] = []
        members: list[_Parked] = []
        batch = producer.create_batch()
        for one in parked:
            key, value, headers = one.key, one.value, one.headers
            if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                batch.close()
                sent.append((members, await producer.send_batch(batch, topic, partition=partition)))
                members, batch = [], producer.create_batch()
                # The first record of an empty batch is always taken, whatever its size.
                batch.append(key=key, value=value, timestamp=None, headers=headers)
            members.append(one)
        batch.close()  # complete: sent without lingering
        sent.append((members, await producer.send_batch(batch, topic, partition=partition)))
        results = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
        refused: dict[_Parked, KafkaError] = {}
        for (group, _), result in zip(sent, results, strict=True):
            if isinstance(result, REFUSED_CONTENT):
                refused.update((one, result) for one in group)
            elif isinstance(result, BaseException):
                raise result
        return refused

    async def park_anomalies(self, anomalies: Sequence[tuple[PendingMarker, str]]) -> None:
        """Best effort: these markers are valid and already accounted for in the store.

        Produced as whole batches like the refused markers (not one ``send`` each); a batch
        the broker refuses is logged, not retried: nothing depends on these copies.
        """
        if not anomalies:
            return
        headers_of = _ParkedHeaders(self._markers_topic).of
        try:
            partitions = await self._invalid_partitions()
            groups: dict[int, list[_Parked]] = defaultdict(list)
            for pending, why in anomalies:
                source = pending.markers_partition
                groups[_invalid_partition(partitions, source)].append(
                    _Parked(
                        None,
                        encode_any(pending.marker),
                        headers_of("anomaly", why, source, pending.markers_offset),
                    )
                )
            refused = await self._send_all(groups)
        except KafkaError as exc:
            log.warning("could not park %d marker anomalies: %r", len(anomalies), exc)
            return
        if refused:
            log.warning(
                "the broker refused %d of %d marker anomalies: %r",
                len(refused),
                len(anomalies),
                next(iter(refused.values())),
            )
