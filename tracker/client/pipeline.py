"""Fetching and STARTing ahead of the application: the client's pipeline (protocol v2).

A consumer that waits for each batch's START acknowledgement before fetching the next one
spends most of its time waiting for the broker: a batch of 500 costs one round trip whatever
the application does. The pipeline keeps up to ``depth`` batches in flight instead: a
background task fetches a batch, plans it, hands its markers to the sink (which sends them at
once) and goes on to the next fetch without waiting; the application's side takes the batches
in order and waits only for the acknowledgement of the one it takes, which has usually arrived
by then. So round trips overlap each other and the application's work.

The KMQ invariant is kept where it is decided, on the application's side: a batch is handed
over only after its STARTs are acknowledged, and its offsets are committed only after that.
When a START write fails, every batch behind it is dropped too (none was handed over or
committed) and the partitions are sought back to the failed batch's first offsets, so they are
read again in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from tracker.errors import MarkerWriteFailed
from tracker.protocol import AnyMarker

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """A fetched batch whose markers are on their way to the broker."""

    fetched: dict[Any, list[Any]]
    plans: list[Any]
    acked: asyncio.Future[None] | None  #: the markers' acknowledgement (None: no markers)
    sent_at: float  #: time.monotonic() when its STARTs were sent: their leases run from then


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
    ) -> None:
        if depth < 1:
            raise ValueError("the pipeline depth must be at least 1")
        self._fetch = fetch
        self._plan = plan
        self._send = send
        self._seek = seek
        self._queue: asyncio.Queue[InFlight] = asyncio.Queue(maxsize=depth)
        self._head: InFlight | None = None  #: taken from the queue, not handed over yet
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            fetched = await self._fetch()
            if not any(fetched.values()):
                continue
            plans, markers = self._plan(fetched)
            acked = asyncio.ensure_future(self._send(markers)) if markers else None
            await self._queue.put(InFlight(fetched, plans, acked, time.monotonic()))

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
        if self._head is None:
            if not self._queue.empty():  # steady state: no waiting, no task per call
                self._head = self._queue.get_nowait()
            else:
                try:
                    self._head = await asyncio.wait_for(self._queue.get(), wait_s)
                except TimeoutError:
                    return None
        head = self._head
        if head.acked is not None:
            try:
                if head.acked.done():
                    head.acked.result()
                else:
                    await asyncio.shield(head.acked)
            except (MarkerWriteFailed, KafkaError) as exc:
                await self._read_again()
                if isinstance(exc, MarkerWriteFailed):
                    raise
                raise MarkerWriteFailed(f"markers not acknowledged: {exc!r}") from exc
        self._head = None
        return head

    async def _read_again(self) -> None:
        """Drop the head and every batch behind it; seek back to where the head began."""
        await self._stop_task()
        dropped = [] if self._head is None else [self._head]
        self._head = None
        while not self._queue.empty():
            dropped.append(self._queue.get_nowait())
        first: dict[Any, int] = {}
        for item in dropped:
            _retrieve(item.acked)
            for tp, records in item.fetched.items():
                if records and (tp not in first or records[0].offset < first[tp]):
                    first[tp] = records[0].offset
        self._seek(first)

    async def _stop_task(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError, Exception):
                await task

    async def close(self) -> list[InFlight]:
        """Stop fetching; return the batches acknowledged but never handed over."""
        await self._stop_task()
        left = [] if self._head is None else [self._head]
        self._head = None
        while not self._queue.empty():
            left.append(self._queue.get_nowait())
        for item in left:
            _retrieve(item.acked)
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
