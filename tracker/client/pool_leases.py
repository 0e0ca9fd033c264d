"""The leases of a worker pool's batches: renewed together while their messages wait or run,
given back to the tracker when the pool lets messages go.

A :class:`~tracker.client.workers.WorkerPool` holds each taken batch under one lease (its range
STARTs and its copies). Renewal is per batch, not per message: one RANGE_EXTEND for what is
still unsettled, whatever the batch's size. Apart from the pool's scheduling because it is the
part that talks to the tracker about time, and the pool's crash-safety rests on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from tracker.errors import MarkerWriteFailed
from tracker.protocol import AnyMarker

from .message import KmqMessage, extensions, releases
from .open_ranges import OpenRange
from .pool_config import PoolSettings, WorkerStats
from .pool_source import BatchSource, TakenBatch

#: The pool's logger: these lines are the pool's lines.
log = logging.getLogger("tracker.client.workers")


@dataclass(slots=True, eq=False)
class BatchLease:
    """The lease of one taken batch: renewed together, forgotten when all its jobs are done."""

    ranges: list[OpenRange]
    loose: list[KmqMessage]
    renewed_at: float
    left: int  #: its messages the pool has not finished with


@dataclass(slots=True, eq=False)
class PoolJob:
    """One message in the pool: waiting in its lane, running, or done."""

    message: KmqMessage
    lease: BatchLease
    started: float = 0.0  #: when its handler started (the loop's clock)
    #: why the pool cancelled its handler: "timeout" (max_processing) or "stop" (drain over)
    cancelled_for: str | None = None
    released: bool = False  #: given back to the tracker


class PoolLeases:
    """The live leases of one pool; ``renew`` runs as one of its tasks."""

    def __init__(self, source: BatchSource, settings: PoolSettings, stats: WorkerStats) -> None:
        self._source = source
        self._settings = settings
        self._stats = stats
        self._live: list[BatchLease] = []

    def add(self, batch: TakenBatch) -> BatchLease:
        """The lease of a batch just taken (renewed from now on, until its jobs are done)."""
        lease = BatchLease(batch.ranges, batch.loose, batch.at, len(batch.messages))
        self._live.append(lease)
        return lease

    async def renew(self) -> None:
        """Every sixth of the lease, renew the batches whose lease is a third gone or more.

        So a renewal is written when between a half and two thirds of the lease is left: room
        for a late timer on a busy loop, the round trip and the tracker's ingest, before the
        tracker would count the message as abandoned.
        """
        s = self._settings
        lease_s = s.lease_ms / 1000
        while True:
            await asyncio.sleep(lease_s / 6)
            now = s.clock()
            live = [lease for lease in self._live if lease.left > 0]
            self._live = live
            markers: list[AnyMarker] = []
            for lease in live:
                if now - lease.renewed_at >= lease_s / 3:
                    lease.renewed_at = now
                    markers += extensions(lease.ranges, lease.loose, s.lease_ms)
            # And the batches fetched ahead, STARTed, not taken yet: their leases run too.
            markers += self._source.prefetched_extensions(s.lease_ms, lease_s / 3)
            if not markers:
                continue
            try:
                await self._source.send_all(markers)
            except MarkerWriteFailed as exc:
                log.warning("lease renewal not acknowledged (%s); will try again", exc)
                for lease in live:
                    lease.renewed_at = min(lease.renewed_at, now - lease_s / 3)
            else:
                self._stats.renewals += len(markers)

    def release(self, jobs: Iterable[PoolJob]) -> None:
        """Give unsettled messages back to the tracker; their leases are no longer renewed."""
        jobs = [job for job in jobs if not job.released]
        for job in jobs:
            job.released = True
            message = job.message
            if message.settled is None:
                self._stats.released += 1
                if message in job.lease.loose:  # a range's offsets are marked in the range
                    job.lease.loose.remove(message)
        for marker in releases(job.message for job in jobs):
            self._source.send_later(marker)
