"""A queue workload for the crash-safety and replica tests, and the accounting of its outcome.

* :func:`produce_over_time` sends ``count`` messages in small batches spread over time.
* :class:`Worker` is one :class:`~tracker.client.KmqConsumer` in the background; a predicate
  decides, per received message, whether it is acked or dropped (the worker "crashes" holding
  it: no marker at all, so only the tracker can bring it back). Every reception is recorded.
* :class:`Ledger` joins what the queue topic holds (originals and the tracker's copies, from a
  :class:`~engine_support.TopicWatcher`) with what the worker received and acked, and answers
  "was anything lost / redelivered after its ack / duplicated".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from tracker import headers as h
from tracker.client import KmqMessage, KmqProducer
from tracker.ids import MessageId
from tracker.protocol import Marker, MarkerKind, RangeMarker, decode_marker
from tracker.protocol_v2 import RangeKind

from .engine_support import Seen, consumer


async def produce_over_time(
    bootstrap: str,
    topic: str,
    count: int,
    *,
    batch: int,
    interval: float,
    sent: dict[MessageId, int] | None = None,
    first: int = 0,
) -> dict[MessageId, int]:
    """Send ``m<first>`` .. ``m<first+count-1>`` (``batch`` at a time, ``interval`` s apart).

    Returns (and fills ``sent`` as it goes) ``{position: index}`` of every acknowledged send.
    """
    out: dict[MessageId, int] = {} if sent is None else sent
    end = first + count
    async with KmqProducer(bootstrap, linger_ms=5) as producer:
        for start in range(first, end, batch):
            indexes = range(start, min(end, start + batch))
            futures = [
                await producer.send_nowait(topic, f"m{i}".encode(), key=f"k{i}".encode())
                for i in indexes
            ]
            for i, future in zip(indexes, futures, strict=True):
                metadata = await future
                out[MessageId(topic, metadata.partition, metadata.offset)] = i
            if start + batch < end:
                await asyncio.sleep(interval)
    return out


async def produce_cycle_share(
    bootstrap: str,
    topic: str,
    *,
    total: int,
    cycles: int,
    cycle: int,
    batch: int,
    interval: float,
    sent: dict[MessageId, int],
) -> dict[MessageId, int]:
    """Send cycle ``cycle``'s share of ``total`` messages split evenly over ``cycles`` cycles.

    The kill tests pace production by their kill cycles rather than by a guess of how long a
    cycle takes: each cycle's share is sent while its incarnation works and the next one starts.
    The shares are contiguous (``m0`` .. ``m<total-1>`` over all cycles).
    """
    first, end = total * cycle // cycles, total * (cycle + 1) // cycles
    return await produce_over_time(
        bootstrap, topic, end - first, batch=batch, interval=interval, sent=sent, first=first
    )


def message_index(message: KmqMessage | Seen) -> int:
    """The ``i`` of a workload payload ``m<i>``."""
    value = message.value or b""
    assert value.startswith(b"m"), f"not a workload message: {value!r}"
    return int(value[1:])


@dataclass(frozen=True, slots=True)
class Reception:
    """One message handed to the worker."""

    id: MessageId
    origin: MessageId
    attempt: int
    index: int
    acked: bool
    at: float  #: time.time() when it was handed over


class Worker:
    """A KmqConsumer in the background; ``should_ack(message)`` says ack (True) or drop."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        group: str,
        markers: str,
        should_ack: Callable[[KmqMessage], bool],
        *,
        processing_timeout: timedelta | None = None,
        marker_version: int = 2,
    ) -> None:
        self._args = (bootstrap, topic, group, markers)
        self._should_ack = should_ack
        self._timeout = processing_timeout
        self.marker_version = marker_version
        self.received: list[Reception] = []
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._joined = asyncio.Event()

    async def _run(self) -> None:
        async with consumer(
            *self._args, processing_timeout=self._timeout, marker_version=self.marker_version
        ) as c:
            self._joined.set()
            while not self._stop.is_set():
                for message in await c.getmany(timedelta(milliseconds=200)):
                    ack = self._should_ack(message)
                    self.received.append(
                        Reception(
                            message.id,
                            message.origin,
                            message.attempt,
                            message_index(message),
                            ack,
                            time.time(),
                        )
                    )
                    if ack:
                        await message.ack()
            await c.flush()

    async def __aenter__(self) -> Worker:
        self._task = asyncio.create_task(self._run(), name="workload-worker")
        return self

    async def wait_joined(self, within: float = 30.0) -> None:
        assert self._task is not None
        done = asyncio.ensure_future(self._joined.wait())
        await asyncio.wait({done, self._task}, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            done.cancel()
            if self._task.done():
                self._task.result()  # raises the worker's error
            raise AssertionError("the worker did not start within the deadline")

    def check_alive(self) -> None:
        """Raise the worker's exception if it died."""
        if self._task is not None and self._task.done():
            self._task.result()
            raise AssertionError("the worker stopped on its own")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task

    def acked_attempts(self) -> dict[MessageId, set[int]]:
        out: dict[MessageId, set[int]] = defaultdict(set)
        for r in self.received:
            if r.acked:
                out[r.origin].add(r.attempt)
        return out


def copy_identity(record: Seen) -> tuple[MessageId, int] | None:
    """``(origin, attempt)`` of a tracker copy, None for an original record."""
    origin = record.header(h.ORIGIN)
    if origin is None:
        return None
    attempt = int(record.header(h.ATTEMPT) or b"1")
    return MessageId.parse(origin.decode()), attempt


@dataclass
class Ledger:
    """The fate of every produced message, from the queue topic and the worker's receptions."""

    sent: dict[MessageId, int]  #: original position -> index
    originals: list[MessageId]  #: originals found in the topic (records without kmq-origin)
    copies: Counter[tuple[MessageId, int]]  #: (origin, attempt) -> copies in the topic
    acked: dict[MessageId, set[int]]  #: origin -> attempts the worker acked
    copy_records: list[Seen] = field(default_factory=list)

    @classmethod
    def build(cls, sent: dict[MessageId, int], records: Iterable[Seen], worker: Worker) -> Ledger:
        originals: list[MessageId] = []
        copies: Counter[tuple[MessageId, int]] = Counter()
        copy_records: list[Seen] = []
        for record in records:
            identity = copy_identity(record)
            if identity is None:
                originals.append(MessageId(record.topic, record.partition, record.offset))
            else:
                copies[identity] += 1
                copy_records.append(record)
        return cls(dict(sent), originals, copies, worker.acked_attempts(), copy_records)

    def never_acked(self) -> list[MessageId]:
        """(a) Lost: produced, but no delivery of it (first or copy) was ever acked."""
        return sorted(origin for origin in self.sent if not self.acked.get(origin))

    def acked_then_redelivered(self) -> list[tuple[MessageId, int]]:
        """(b) ``(origin, n)`` where attempt n was acked yet a copy with attempt n+1 exists."""
        bad: list[tuple[MessageId, int]] = []
        for origin, attempts in self.acked.items():
            bad += [(origin, n) for n in sorted(attempts) if self.copies[(origin, n + 1)] > 0]
        return bad

    def acked_then_copied(self, markers: MarkerLog) -> list[tuple[MessageId, int]]:
        """(b) as the tracker could know it, the markers topic deciding: ``(origin, n)`` whose
        ack was written and *then* a copy of attempt n+1 produced.

        Two kinds of copy follow an ack of the app without breaking one (docs/reliability.md,
        "When duplicates happen"), and are left out:

        * the copy was produced before the ack was written: the tracker acted on an earlier
          delivery's lease (a batch STARTed, its offset commit failed at a rebalance, and the
          partition's next owner read it again after the lease ran out, then acked it);
        * a START of attempt n fell between the ack and the copy: the acked attempt was read
          again (a commit lost at a rebalance) and that new delivery was not settled.

        An ack the worker made that never reached the markers topic counts: nothing excuses it.
        """
        copied_ms: dict[tuple[MessageId, int], int] = {}
        for record in self.copy_records:
            identity = copy_identity(record)
            assert identity is not None
            copied_ms[identity] = min(record.timestamp_ms, copied_ms.get(identity, 1 << 62))
        bad: list[tuple[MessageId, int]] = []
        for origin, n in self.acked_then_redelivered():
            acked_at = markers.acked_ms.get((origin, n))
            copied_at = copied_ms[(origin, n + 1)]
            if acked_at is not None and copied_at <= acked_at:
                continue
            starts = markers.started_ms.get((origin, n), ())
            if acked_at is not None and any(acked_at < at <= copied_at for at in starts):
                continue
            bad.append((origin, n))
        return bad

    def story(self, origin: MessageId, markers: MarkerLog, workers: Iterable[Worker]) -> str:
        """What happened to one message, for an assertion's message (epoch ms)."""
        copies = sorted(
            (identity[1], record.timestamp_ms)
            for record in self.copy_records
            if (identity := copy_identity(record)) is not None and identity[0] == origin
        )
        receptions = [
            f"worker {i} (v{w.marker_version}) attempt {r.attempt} acked={r.acked} at "
            f"{r.at * 1000:.0f}"
            for i, w in enumerate(workers)
            for r in w.received
            if r.origin == origin
        ]
        marks = {k: v for k, v in markers.acked_ms.items() if k[0] == origin}
        starts = {k: v for k, v in markers.started_ms.items() if k[0] == origin}
        return (
            f"{origin}: copies (attempt, ms) {copies}; acks written {marks}; "
            f"STARTs written {starts}; received {receptions}"
        )

    def duplicates(self) -> dict[tuple[MessageId, int], int]:
        """(c) ``(origin, attempt)`` republished more than once -> the extra copies."""
        return {key: n - 1 for key, n in self.copies.items() if n > 1}

    def strangers(self) -> list[tuple[MessageId, int]]:
        """Copies whose origin is not a produced message (should never happen)."""
        return [key for key in self.copies if key[0] not in self.sent]

    def summary(self) -> str:
        attempts = Counter(attempt for _, attempt in self.copies.elements())
        first_acked = sum(1 for origin in self.sent if 1 in self.acked.get(origin, ()))
        return (
            f"{len(self.sent)} produced, {len(self.originals)} originals in the topic, "
            f"{first_acked} acked on first delivery, {sum(self.copies.values())} copies "
            f"(by attempt {dict(sorted(attempts.items()))}), "
            f"{sum(self.duplicates().values())} duplicate copies, "
            f"{len(self.never_acked())} never acked, "
            f"{len(self.acked_then_redelivered())} redelivered after an ack"
        )


@dataclass
class MarkerLog:
    """When the markers topic first says each ``(origin, attempt)`` was acked, and every time
    it was STARTed (the records' timestamps, ms): what the tracker could know, and when."""

    acked_ms: dict[tuple[MessageId, int], int]
    started_ms: dict[tuple[MessageId, int], list[int]]

    @classmethod
    def read(cls, records: Iterable[Seen]) -> MarkerLog:
        acked: dict[tuple[MessageId, int], int] = {}
        started: dict[tuple[MessageId, int], list[int]] = defaultdict(list)
        for record in records:
            marker = decode_marker(record.value)
            at = record.timestamp_ms
            if isinstance(marker, RangeMarker):
                if marker.kind is RangeKind.RANGE_SETTLE:
                    for message in marker.messages():
                        acked.setdefault((message, 1), at)
                elif marker.kind is RangeKind.RANGE_START:
                    for message in marker.messages():
                        started[(message, 1)].append(at)
            elif isinstance(marker, Marker):
                if marker.kind is MarkerKind.ACK:
                    acked.setdefault((marker.origin, marker.attempt), at)
                elif marker.kind is MarkerKind.START:
                    started[(marker.origin, marker.attempt)].append(at)
        return cls(acked, dict(started))
