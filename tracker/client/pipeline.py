"""Fetching and STARTing ahead of the application: the client's pipeline (protocol v2).

A consumer that waits for each batch's START acknowledgement before fetching the next one
spends most of its time waiting for the broker: a batch of 500 costs one round trip whatever
the application does. The pipeline keeps up to ``depth`` batches in flight instead: a
background task fetches a batch, plans it, hands its markers to the sink (which sends them at
once) and goes on to the next fetch without waiting; the application's side takes the batches
in order and waits only for the acknowledgement of the one it takes, which has usually arrived
by then. So round trips overlap each other and the application's work.

How far ahead it fetches follows the application, not only ``depth``: a prefetched batch's
lease runs while it waits, and a batch fetched ahead is read twice if the consumer stops or
loses its partition first. So the pipeline keeps waiting only as much of the application's
work (as records per second of processing, measured from each hand-over to the application's
next request) as hides the round trips: ``READY_COVER`` times the measured time from a
batch's fetch to its STARTs' acknowledgement, at least ``MIN_AHEAD_S``, at most ``ahead_s``
(see :func:`seconds_ahead`); always at least one batch, and one batch only until the first
measurement. A fast application gets the batches that hide the START round trips (about
twenty on a local broker, never more than ``depth``); a slow one gets one batch ahead, whose
lease has barely started when it is taken, instead of ``depth`` batches that expire while they
wait. It also holds at most ``max_bytes`` of records as ``weigh`` counts them (the consumer
passes aiokafka's ``fetch_max_bytes`` and the values' sizes), so that large messages do not
turn a depth of batches into gigabytes.

The KMQ invariant is kept where it is decided, on the application's side: a batch is handed
over only after its STARTs are acknowledged, and its offsets are committed only after that.
When a START write fails, every batch behind it is dropped too (none was handed over or
committed) and the partitions are sought back to the failed batch's first offsets, so they are
read again in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from tracker.errors import MarkerWriteFailed
from tracker.protocol import AnyMarker

log = logging.getLogger(__name__)


#: How many times the time a batch takes to get ready the pipeline keeps ahead: enough for
#: the acknowledgements' jitter.
READY_COVER = 4
#: The least time of work kept ahead of a fast application (the first batches, before the
#: round trips are measured, and a broker that answers in microseconds).
MIN_AHEAD_S = 0.02


def seconds_ahead(ahead_s: float, ready_s: float | None) -> float:
    """How much of the application's work the pipeline keeps ahead: what hides the round
    trips of getting a batch ready (``READY_COVER`` times ``ready_s``, at least
    ``MIN_AHEAD_S``), never more than ``ahead_s``.

    Not more than that: what waits ahead runs its leases, is read twice after a rebalance or a
    stop, and is held in memory (at a fixed 128 batches, tens of thousands of records on a
    fast consumer; the throughput and the GC's collections measured the same either way).
    """
    cover = MIN_AHEAD_S if ready_s is None else max(MIN_AHEAD_S, READY_COVER * ready_s)
    return min(ahead_s, cover)


@dataclass(slots=True)
class InFlight:
    """A fetched batch whose markers are on their way to the broker."""

    fetched: dict[Any, list[Any]]
    plans: list[Any]
    acked: asyncio.Future[None] | None  #: the markers' acknowledgement (None: no markers)
    sent_at: float  #: time.monotonic() when its STARTs were sent: their leases run from then
    count: int = 0  #: the records it holds
    size: int = 0  #: their size in bytes, as the pipeline's ``weigh`` counts it
    generation: int = 0  #: the consumer's assignment generation when it was fetched


class StartPipeline:
    """Up to ``depth`` fetched batches with their STARTs in flight, taken in order."""

    def __init__(
        self,
        *,
        fetch: Callable[[], Awaitable[dict[Any, list[Any]]]],
        plan: Callable[[dict[Any, list[Any]]], tuple[list[Any], Sequence[AnyMarker]]],
        send: Callable[[Sequence[AnyMarker]], Awaitable[None]],
        seek: Callable[[dict[Any, int]], None],
        depth: int,
        ahead_s: float = 1.0,
        max_bytes: int | None = None,
        weigh: Callable[[dict[Any, list[Any]]], int] | None = None,
        generation: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if depth < 1:
            raise ValueError("the pipeline depth must be at least 1")
        if ahead_s <= 0:
            raise ValueError("the pipeline's time ahead must be positive")
        self._fetch = fetch
        self._plan = plan
        self._send = send
        self._seek = seek
        self._queue: asyncio.Queue[InFlight] = asyncio.Queue(maxsize=depth)
        self._head: InFlight | None = None  #: taken from the queue, not handed over yet
        self._task: asyncio.Task[None] | None = None
        self._ahead_s = ahead_s
        self._clock = clock
        self._max_bytes = max_bytes
        self._weigh = weigh
        self._generation = generation
        self._queued = 0  #: records fetched and not handed over yet
        self._queued_bytes = 0  #: their size, as ``weigh`` counts it
        self._rate: float | None = None  #: the application's records per second (EWMA)
        #: seconds from a batch's fetch to its STARTs' acknowledgement (EWMA)
        self._ready_s: float | None = None
        self._handed: tuple[int, float] | None = None  #: the last hand-over: records, when
        self._room = asyncio.Event()  #: set whenever the application takes a batch
        self._putting: InFlight | None = None  #: fetched, waiting for room in the queue
        self._fetched: list[InFlight] = []  #: every batch fetched and not handed over (or dropped)

    def _may_fetch(self) -> bool:
        """At least one batch ahead; more while they hold less than :func:`seconds_ahead`
        of the application's work."""
        if self._queued == 0:
            return True
        if self._max_bytes is not None and self._queued_bytes >= self._max_bytes:
            return False
        rate = self._rate  # unknown until the application has taken a batch: one ahead
        return rate is not None and self._queued < rate * seconds_ahead(
            self._ahead_s, self._ready_s
        )

    def _ready(self, began: float, acked: asyncio.Future[None] | None = None) -> None:
        """A batch's STARTs are acknowledged ``clock() - began`` after it was fetched: the
        round trip that the batches ahead must hide."""
        if acked is not None and (acked.cancelled() or acked.exception() is not None):
            return
        took = self._clock() - began
        ready = self._ready_s
        self._ready_s = took if ready is None else 0.8 * ready + 0.2 * took

    async def _run(self) -> None:
        while True:
            while not self._may_fetch():
                self._room.clear()
                await self._room.wait()
            fetched = await self._fetch()
            count = sum(map(len, fetched.values()))
            if not count:
                continue
            began = self._clock()  # not the fetch's wait for data: idle time hides nothing
            plans, markers = self._plan(fetched)
            acked: asyncio.Future[None] | None = None
            if markers:
                acked = sending = asyncio.ensure_future(self._send(markers))
                sending.add_done_callback(functools.partial(self._ready, began))
            else:
                self._ready(began)
            size = 0 if self._weigh is None else self._weigh(fetched)
            self._queued += count
            self._queued_bytes += size
            # Held here until the queue takes it: a put cancelled by _read_again or close
            # does not insert it, and those must still see it (seek back, give it back).
            # Tagged when the records are here: a fetch that returns after a rebalance returns
            # records of the new assignment.
            made_in = 0 if self._generation is None else self._generation()
            self._putting = InFlight(fetched, plans, acked, self._clock(), count, size, made_in)
            self._fetched.append(self._putting)
            await self._queue.put(self._putting)
            self._putting = None

    def _taking(self) -> None:
        """The application asks for the next batch: it has processed the last one."""
        if self._handed is None:
            return
        count, at = self._handed
        self._handed = None
        rate = count / max(self._clock() - at, 1e-6)
        self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate

    def _hand_over(self, head: InFlight) -> InFlight:
        self._forget(head)
        self._handed = (head.count, self._clock())
        return head

    def _forget(self, head: InFlight) -> None:
        """It leaves the pipeline (handed over or dropped): room for more."""
        self._queued -= head.count
        self._queued_bytes -= head.size
        self._fetched.remove(head)
        _retrieve(head.acked)
        self._room.set()

    async def next(self, wait_s: float) -> InFlight | None:
        """The next batch whose markers are acknowledged, or None after ``wait_s`` seconds.

        Raises :class:`MarkerWriteFailed` if its markers were not acknowledged (the batch
        and everything fetched after it will be read again), and what fetching raised. A
        caller cancelled while waiting leaves the batch to the next call.
        """
        task = self._task
        if task is not None and task.done():
            self._task = None
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise error  # fetching failed; the next call starts again
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="kmq-start-pipeline"
            )
        while True:
            if self._head is None:
                self._taking()
                if not self._queue.empty():  # steady state: no waiting, no task per call
                    self._head = self._queue.get_nowait()
                else:
                    try:
                        self._head = await asyncio.wait_for(self._queue.get(), wait_s)
                    except TimeoutError:
                        return None
            head = self._head
            if self._generation is not None and head.generation != self._generation():
                # Fetched before a rebalance: the consumer reads these partitions again from
                # their committed offsets (or another member does), so handing it over would
                # deliver it twice. Its STARTs are acknowledged: it stays covered until then.
                self._head = None
                self._forget(head)
                log.info("dropped a batch of %d records fetched before a rebalance", head.count)
                continue
            if head.acked is not None and not head.acked.done():
                with contextlib.suppress(Exception):  # its outcome is looked at below
                    await asyncio.shield(head.acked)
                continue  # look again: a rebalance may have begun while it waited
            break
        if head.acked is not None:
            try:
                head.acked.result()
            except (MarkerWriteFailed, KafkaError) as exc:
                await self._read_again()
                if isinstance(exc, MarkerWriteFailed):
                    raise
                raise MarkerWriteFailed(f"markers not acknowledged: {exc!r}") from exc
        self._head = None
        return self._hand_over(head)

    def waiting(self) -> list[InFlight]:
        """The batches fetched and not handed over yet, in fetch order."""
        return list(self._fetched)

    async def _read_again(self) -> None:
        """Drop the head and every batch behind it; seek back to where the head began."""
        first: dict[Any, int] = {}
        for item in await self._drain():
            for tp, records in item.fetched.items():
                if records and (tp not in first or records[0].offset < first[tp]):
                    first[tp] = records[0].offset
        self._seek(first)

    async def _drain(self) -> list[InFlight]:
        """Stop fetching; take every batch not handed over, in fetch order."""
        await self._stop_task()
        left = [] if self._head is None else [self._head]
        self._head = None
        while not self._queue.empty():
            left.append(self._queue.get_nowait())
        if self._putting is not None:
            left.append(self._putting)
            self._putting = None
        for item in left:
            _retrieve(item.acked)
        self._fetched.clear()
        self._queued = self._queued_bytes = 0
        self._room.set()
        return left

    async def _stop_task(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError, Exception):
                await task

    async def close(self) -> list[InFlight]:
        """Stop fetching; return the batches acknowledged but never handed over."""
        left = await self._drain()
        return [
            item
            for item in left
            if item.acked is None
            or (item.acked.done() and not item.acked.cancelled() and item.acked.exception() is None)
        ]


def _retrieve(future: asyncio.Future[None] | None) -> None:
    """Mark a dropped batch's outcome as seen (no "exception never retrieved" noise)."""
    if future is None:
        return
    if future.done():
        if not future.cancelled():
            future.exception()
    else:
        future.add_done_callback(lambda f: None if f.cancelled() else f.exception())
