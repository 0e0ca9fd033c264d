"""Redrive jobs: republish dead letters to their topic (or another), rate-limited, exactly once.

A job is created by the admin API (``POST /v1/redrive-jobs``) with a snapshot of the dead letters
it covers (its *items*). A :class:`RedriveRunner` in any replica claims a job with a lease, and
republishes the items in id order at the job's rate (a token bucket): for each dead letter the
record is read back from the DLQ topic, its ``kmq-dlq-*`` headers are dropped, and it is
produced to the target with the headers ``kmq-redrive-job`` and ``kmq-redrive-item`` (the dead
letter's id), so every republished record says where it came from.

Never twice (see also :mod:`tracker.store.redrive_jobs`):

1. Before anything is produced in a lease, the target partitions' end offsets are recorded in
   the job (``scan_offsets``; from fetch responses, since tansu's ListOffsets is wrong after
   batched produces).
2. Each item's dead letter is reserved for the job before it is produced (other jobs skip it).
3. Right after the broker acknowledged a batch, its items are marked done in one transaction,
   fenced by the lease token.
4. A runner that takes a job over (its previous runner crashed, or a produce failed with an
   unknown outcome) first scans the target partitions from the recorded offsets for records
   carrying this job's header and marks those items done; only the rest is produced again.

A crash between 3's acknowledgement and its transaction is thus repaired by 4 instead of
producing a second copy. The lease is renewed while the job runs; a runner that cannot renew
stops before producing more (its lease may have run out and another replica may be in step 4).

The one assumption: when a lease has run out, its owner has nothing in flight any more. A
produce request outlives its sender's lease only if the broker stalls for longer than the
lease, so ``redrive_lease`` (60 s) is kept above the producer's request timeout (40 s); on a
broker with transactions this could be made airtight, but tansu has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from tracker.clock import Clock, SystemClock, to_millis
from tracker.domain.jobs import ItemState, JobState
from tracker.engine.wakeup import wait_any
from tracker.errors import KmqError
from tracker.headers import job_marks, redrive_headers, redrive_marks
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.kafka.scan import PartitionScanner
from tracker.metrics import Metrics
from tracker.ports import OriginalsSource
from tracker.ratelimit import TokenBucket
from tracker.store import StoreUnavailable
from tracker.store.redrive_jobs import RedriveJobRecord
from tracker.store.redrive_leases import ProducedItem, RedriveLeaseStore, RedriveWork
from tracker.store.store_errors import LeaseLost

log = logging.getLogger(__name__)

T = TypeVar("T")


DEFAULT_CHUNK = 500  #: items loaded (and their DLQ records read) at a time
DEFAULT_MAX_BATCH = 500  #: records produced per acknowledged batch (at most)

Sleep = Callable[[float], Awaitable[None]]
OnProduced = Callable[[Sequence[ProducedItem]], Awaitable[None]]


class _ProduceFailed(KmqError):
    """A produce failed: its outcome is unknown until the target is scanned again."""


@dataclass(slots=True)
class _Lease:
    job_id: int
    token: str
    #: Monotonic time from which the lease is renewed before the next batch is produced:
    #: a third of the lease, so a runner never produces on a lease that may have run out.
    renew_at: float


class RedriveRunner:
    """Runs redrive jobs, one at a time, until stopped. Safe to run in every replica."""

    def __init__(
        self,
        *,
        jobs: RedriveLeaseStore,
        producer: Any,
        originals: OriginalsSource,
        scanner: PartitionScanner,
        owner: str,
        metrics: Metrics,
        lease_seconds: float = 60.0,
        clock: Clock | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        poll_interval: float = 2.0,
        chunk: int = DEFAULT_CHUNK,
        max_batch: int = DEFAULT_MAX_BATCH,
        on_produced: OnProduced | None = None,
    ) -> None:
        """``scanner`` must be started by the caller (and stopped after :meth:`run`).

        ``on_produced`` is called after a batch was acknowledged by the broker and before it
        is recorded: a seam for tests that simulate a crash in exactly that window.
        """
        self._jobs = jobs
        self._producer = producer
        self._originals = originals
        self._scanner = scanner
        self._owner = owner
        self._metrics = metrics
        self._lease_ms = int(lease_seconds * 1000)
        self._lease_seconds = lease_seconds
        self._clock: Clock = clock or SystemClock()
        self._monotonic = monotonic
        self._sleep = sleep
        self._poll = poll_interval
        self._chunk = chunk
        self._max_batch = max_batch
        self._on_produced = on_produced
        self._wake = asyncio.Event()
        self.last_error: str | None = None
        self.current_job: int | None = None

    def notify(self) -> None:
        """A job was created or cancelled: look for work now rather than at the next poll."""
        self._wake.set()

    def _now_ms(self) -> int:
        return to_millis(self._clock.now())

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Claim and run jobs until ``stopping`` is set (then give the current job up)."""
        backoff = 0.5
        while not stopping.is_set():
            token = uuid.uuid4().hex
            try:
                job = await self._jobs.claim_job(self._owner, token, self._now_ms(), self._lease_ms)
            except StoreUnavailable as exc:
                self.last_error = f"store: {exc}"
                log.warning("redrive paused, store unavailable: %s", exc)
                await self._pause(stopping, backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.5
            if job is None:
                await self._pause(stopping, self._poll)
                continue
            await self._run_job(job, token, stopping)

    async def _pause(self, stopping: asyncio.Event, seconds: float) -> None:
        self._wake.clear()
        await wait_any(self._wake, stopping, timeout=seconds)

    async def _run_job(self, job: RedriveJobRecord, token: str, stopping: asyncio.Event) -> None:
        start = self._monotonic()
        lease = _Lease(
            job.id,
            token,
            renew_at=start + self._lease_seconds / 3,
        )
        self.current_job = job.id
        log.info(
            "running redrive job %s (%d items, %g/s) as %s", job.id, job.total, job.rate, token
        )
        backoff = 0.5
        try:
            while True:
                try:
                    await self._work(job, lease, stopping)
                except (_ProduceFailed, OriginalsUnavailable) as exc:
                    self.last_error = str(exc)
                    log.warning("redrive job %s: %s; retrying", job.id, exc)
                    with contextlib.suppress(StoreUnavailable):
                        await self._jobs.set_error(job.id, token, str(exc), self._now_ms())
                    await self._pause(stopping, backoff)
                    backoff = min(backoff * 2, 10.0)
                    if stopping.is_set():
                        await self._release(lease)
                        return
                    refreshed = await self._jobs.get_job(job.id)
                    if refreshed is None:
                        return
                    job = refreshed
                else:
                    return
        except LeaseLost:
            log.warning("redrive job %s: lease lost to another replica; stopping it here", job.id)
        except StoreUnavailable as exc:
            self.last_error = f"store: {exc}"
            log.warning("redrive job %s paused, store unavailable: %s", job.id, exc)
            await self._pause(stopping, 1.0)
        finally:
            self.current_job = None

    async def _release(self, lease: _Lease) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self._jobs.release_lease(lease.job_id, lease.token, self._now_ms())

    async def _renew(self, lease: _Lease, *, force: bool = False) -> bool:
        """Renew the lease when due (or ``force``); returns whether a cancel was requested."""
        now = self._monotonic()
        if not force and now < lease.renew_at:
            return False
        cancel = await self._jobs.renew_lease(
            lease.job_id, lease.token, self._now_ms(), self._lease_ms
        )
        lease.renew_at = now + self._lease_seconds / 3
        return cancel

    # -- one lease ------------------------------------------------------------------------------

    async def _work(self, job: RedriveJobRecord, lease: _Lease, stopping: asyncio.Event) -> None:
        """Recover, record where this lease starts, then republish until done or stopped."""
        targets = await self._jobs.job_targets(job)
        counts = await self._scanner.partition_counts(targets)
        if job.scan_offsets is not None:
            sending = await self._jobs.sending_items(job.id)
            if sending:
                await self._recover(job, lease, counts, sending)
        tps = [TopicPartition(t, p) for t, n in counts.items() if n for p in range(n)]
        ends = await self._scanner.high_watermarks(tps)
        offsets: dict[str, dict[int, int]] = {}
        for tp, end in ends.items():
            offsets.setdefault(tp.topic, {})[tp.partition] = end
        await self._jobs.set_scan_offsets(job.id, lease.token, offsets, self._now_ms())
        missing_topics = {t for t, n in counts.items() if not n}
        bucket = TokenBucket(job.rate, clock=self._monotonic, sleep=self._sleep)
        cancel = await self._renew(lease, force=True)
        while True:
            if cancel:
                await self._jobs.finish_job(job.id, lease.token, JobState.CANCELLED, self._now_ms())
                log.info("redrive job %s cancelled", job.id)
                return
            if stopping.is_set():
                await self._release(lease)
                return
            work = await self._jobs.next_work(job.id, self._chunk)
            if not work:
                await self._jobs.finish_job(job.id, lease.token, JobState.DONE, self._now_ms())
                log.info("redrive job %s done", job.id)
                return
            ready = await self._prepare(job, lease, work, missing_topics)
            cancel = await self._send(job, lease, ready, bucket, stopping)
            if not cancel:
                cancel = await self._renew(lease)

    async def _recover(
        self,
        job: RedriveJobRecord,
        lease: _Lease,
        counts: dict[str, int | None],
        sending: set[int],
    ) -> None:
        """Mark done the reserved items a previous lease produced but did not record."""
        starts = job.scan_offsets or {}
        tps = [TopicPartition(t, p) for t, n in counts.items() if n for p in range(n)]
        ends = await self._scanner.high_watermarks(tps)
        ranges = {
            tp: (starts.get(tp.topic, {}).get(tp.partition, 0), end) for tp, end in ends.items()
        }
        found: dict[int, ProducedItem] = {}

        def collect(record: Any) -> None:
            marks = redrive_marks(record.headers)
            if marks is not None and marks[0] == job.id and marks[1] in sending:
                found[marks[1]] = ProducedItem(
                    marks[1], record.topic, record.partition, record.offset
                )

        await self._scanner.scan(ranges, collect)
        if found:
            await self._jobs.mark_done(job.id, lease.token, list(found.values()), self._now_ms())
        log.info(
            "redrive job %s: %d of %d reserved items were already produced (recorded now); "
            "the rest is sent again",
            job.id,
            len(found),
            len(sending),
        )

    async def _prepare(
        self,
        job: RedriveJobRecord,
        lease: _Lease,
        work: list[RedriveWork],
        missing_topics: set[str],
    ) -> list[tuple[RedriveWork, str, OriginalRecord]]:
        """Reserve pending items, read their DLQ records; skip what cannot be sent."""
        now_ms = self._now_ms()
        pending = [w.dead_letter_id for w in work if w.state is ItemState.PENDING]
        reserved = set((await self._jobs.reserve(job.id, lease.token, pending, now_ms)).reserved)
        sendable = [w for w in work if w.state is ItemState.SENDING or w.dead_letter_id in reserved]
        skip: list[tuple[int, str]] = []
        wanted: list[RedriveWork] = []
        for item in sendable:
            target = job.target_topic or item.origin_topic
            if not item.dlq_topic:
                skip.append((item.dead_letter_id, "the dead letter no longer exists"))
            elif target in missing_topics:
                skip.append((item.dead_letter_id, f"target topic {target!r} does not exist"))
            else:
                wanted.append(item)
        positions = [MessageId(w.dlq_topic, w.dlq_partition, w.dlq_offset) for w in wanted]
        found = await self._originals.fetch(positions) if positions else {}
        ready: list[tuple[RedriveWork, str, OriginalRecord]] = []
        for item, position in zip(wanted, positions, strict=True):
            record = found.get(position)
            if isinstance(record, OriginalRecord):
                ready.append((item, job.target_topic or item.origin_topic, record))
            elif isinstance(record, Missing):
                skip.append(
                    (item.dead_letter_id, f"DLQ record {position} is gone: {record.reason}")
                )
            else:  # pragma: no cover - fetch answers every position or raises
                raise OriginalsUnavailable(f"no answer for DLQ record {position}")
        await self._jobs.skip_reserved(job.id, lease.token, skip, now_ms)
        return ready

    async def _send(
        self,
        job: RedriveJobRecord,
        lease: _Lease,
        ready: list[tuple[RedriveWork, str, OriginalRecord]],
        bucket: TokenBucket,
        stopping: asyncio.Event,
    ) -> bool:
        """Produce ``ready`` at the job's rate, recording each acknowledged batch.

        Returns whether a cancel was requested (the rest of ``ready`` is then left unsent).
        """
        index = 0
        while index < len(ready):
            if stopping.is_set():
                return False
            wanted = min(self._max_batch, len(ready) - index)
            granted = await _unless_stopped(
                bucket.take(wanted, max_wait=self._lease_seconds / 4), stopping
            )
            if granted is None:
                return False  # stopped while waiting for a token: nothing taken, nothing sent
            if self._monotonic() >= lease.renew_at and await self._renew(lease):
                return True
            if granted == 0:
                continue  # a slow rate: the lease was renewed while waiting for a token
            batch = ready[index : index + granted]
            index += granted
            started = time.perf_counter()
            sent: list[tuple[RedriveWork, str, asyncio.Future[Any]]] = []
            failure: BaseException | None = None
            for item, target, record in batch:
                try:
                    future = await self._producer.send(
                        target,
                        value=record.value,
                        key=record.key,
                        headers=redrive_headers(
                            record.headers, job_marks(job.id, item.dead_letter_id)
                        ),
                    )
                except (KafkaError, KmqError) as exc:
                    failure = exc
                    break
                sent.append((item, target, future))
            results = await asyncio.gather(*(f for _, _, f in sent), return_exceptions=True)
            produced: list[ProducedItem] = []
            for (item, target, _), result in zip(sent, results, strict=True):
                if isinstance(result, BaseException):
                    failure = failure or result
                    continue
                produced.append(
                    ProducedItem(item.dead_letter_id, target, result.partition, result.offset)
                )
            if self._on_produced is not None:
                await self._on_produced(produced)
            cancel = await self._jobs.mark_done(job.id, lease.token, produced, self._now_ms())
            for done in produced:
                self._metrics.redrive_published.labels(done.topic).inc()
            self._metrics.redrive_batch_seconds.observe(time.perf_counter() - started)
            if failure is not None:
                raise _ProduceFailed(f"producing redriven records failed: {failure!r}")
            if cancel:
                return True
        return False


async def _unless_stopped(waiting: Awaitable[T], stopping: asyncio.Event) -> T | None:
    """``await waiting``, or None (``waiting`` cancelled) as soon as ``stopping`` is set.

    A token wait at a slow rate lasts up to a quarter of the lease (seconds): a shutdown must
    not wait it out.
    """
    task = asyncio.ensure_future(waiting)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # our caller is cancelled: the wait goes with it
        raise
    finally:
        stop.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
