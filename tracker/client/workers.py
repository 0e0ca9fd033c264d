"""Processing with bounded concurrency: the worker pool behind ``KmqConsumer.run``.

In a classic consumer group one slow message holds up its whole partition, and a group never has
more busy workers than partitions. kmq lifts both limits without changing the group protocol: a
message is covered by its START before its offset is committed, and is settled on its own, so a
consumer may work on many messages of one partition at once and commit offsets without waiting
for them (what Kafka share groups, KIP-932, and Confluent Parallel Consumer offer).

The pool takes batches from the consumer (already STARTed and handed over, exactly as
``async for`` gets them), keeps them in per-key or per-partition *lanes*
(:mod:`tracker.client.ordering`) and runs up to ``concurrency`` handlers at once, one long-lived
worker task per slot (a worker whose handler returns starts the next ready message at once). It
takes the next batch only while fewer than ``concurrency`` messages are ready to start and fewer
than ``max_waiting`` wait in all: when every slot is busy, the consumer stops fetching (the START
pipeline fetches only what the application takes), so memory stays bounded whatever the backlog.

Leases are renewed per batch, not per message: every sixth of the lease, each batch whose lease is
a third gone or more gets one RANGE_EXTEND for the offsets still unsettled (waiting or in
progress), plus a per-message EXTEND for copies. A handler that runs longer than
``max_processing`` is cancelled and its message retried (a blocking one cannot be cancelled: its
slot and lane stay taken until its thread returns, its result unused). While full, the pool
takes nothing but polls the group with every partition paused, so it stays a member.

On stop, on cancellation of ``run`` and on the revocation of partitions, the pool takes nothing
new and lets what it holds finish, waiting messages included (so per-key order survives a
rebalance), for up to ``drain_timeout``; what is left is given back to the tracker with an EXTEND
of 1 ms (redelivered at once). On stop, handlers still running then are cancelled and their
messages given back; on a revocation they run on and settle their messages when they finish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
from collections.abc import Callable
from datetime import timedelta

from tracker.errors import KmqError, MarkerWriteFailed

from .handlers import HandlerCaller, HandlerReturnedAwaitable, RejectMessage, RetryMessage
from .message import KmqMessage
from .message_batch import each_once
from .ordering import Lanes, lane_function
from .pool_config import PoolSettings, WorkerStats
from .pool_leases import BatchLease, PoolJob, PoolLeases
from .pool_source import BatchSource, TakenBatch

log = logging.getLogger(__name__)

#: The pool whose handler runs in this context (tasks a handler starts inherit it).
HANDLING: contextvars.ContextVar[WorkerPool | None] = contextvars.ContextVar(
    "kmq_handling", default=None
)

#: How long ``stop`` waits for handlers it cancelled, and for the pool's tasks, to end: a handler
#: that ignores its cancellation is left behind (its message already given back).
ABANDON_WAIT_S = 2.0

#: How long one ``take`` waits for a batch: what a stop request may wait for the loop to notice.
TAKE_WAIT_S = 0.2
#: Pause before taking again after a batch's STARTs were not acknowledged.
RETRY_PAUSE_S = 0.5


class WorkerPool:
    """Runs a handler on up to ``concurrency`` messages at once (see the module docstring)."""

    def __init__(self, source: BatchSource, caller: HandlerCaller, settings: PoolSettings) -> None:
        self._source = source
        self._caller = caller
        self._settings = settings
        lane = lane_function(settings.ordering)
        self._lanes: Lanes[PoolJob] = Lanes(lambda job: lane(job.message))
        #: worker task -> the job it runs (absent: the worker waits for one)
        self._running: dict[asyncio.Task[None], PoolJob] = {}
        self._workers: list[asyncio.Task[None]] = []
        #: idle workers, each waiting on its future for the next job (None: exit)
        self._idle: collections.deque[asyncio.Future[PoolJob | None]] = collections.deque()
        #: The pool has room for another batch, or a stop was asked for: what the take loop
        #: waits on while full. Set only when room appears, not at every finished job: a take
        #: loop woken per job only to find the pool still full cost a task and a timer each.
        self._room = asyncio.Event()
        self._progress = asyncio.Event()  #: a job finished, or a stop was asked for
        self._stop = False
        self._dispatching = True
        self._fatal: BaseException | None = None
        self._finished = asyncio.Event()
        self.stats = WorkerStats()
        self._leases = PoolLeases(source, settings, self.stats)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> WorkerStats:
        """Take batches and run their handlers until :meth:`request_stop`, cancellation or a
        handler's ``BaseException`` (re-raised here after the drain)."""
        loop = asyncio.get_running_loop()
        side_tasks = [
            loop.create_task(self._leases.renew(), name="kmq-lease-renewal"),
            loop.create_task(self._watch_deadlines(), name="kmq-handler-deadlines"),
        ]
        context = contextvars.copy_context()
        context.run(HANDLING.set, self)
        self._workers = [
            loop.create_task(self._worker(), name=f"kmq-worker-{i}", context=context)
            for i in range(self._settings.concurrency)
        ]
        for worker in self._workers:
            worker.add_done_callback(self._worker_ended)
        try:
            await self._take_batches()
        finally:
            try:
                self._stop = True
                await self._drain(lambda job: True, self._settings.drain_s, abandon=True)
            finally:
                try:
                    self._dispatching = False
                    self._leases.release(
                        self._lanes.remove(lambda job: True)
                    )  # if the drain was cut
                    tasks = side_tasks + self._workers
                    for task in tasks:
                        task.cancel()
                    await asyncio.wait(tasks, timeout=ABANDON_WAIT_S)
                    self._caller.close()
                finally:
                    self._finished.set()
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def _take_batches(self) -> None:
        s = self._settings
        while not self._stop:
            if not self._has_room():
                # Full: take nothing (so nothing is fetched), but keep the membership.
                self._room.clear()
                try:
                    await asyncio.wait_for(self._room.wait(), s.keepalive_s)
                except TimeoutError:
                    await self._source.keep_alive()
                continue
            try:
                batch = await self._source.take(TAKE_WAIT_S)
            except MarkerWriteFailed as exc:
                # Not handed over, offsets not committed: the batch is read again.
                log.warning("STARTs not acknowledged (%s); reading the batch again", exc)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if batch is None:
                continue
            if self._stop:
                self._leases.release(
                    [PoolJob(m, BatchLease([], [], 0, 0)) for m in each_once(batch.messages)]
                )
            else:
                self._add(batch)

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        """A worker ends only when the pool stops; if one ends otherwise, stop the pool
        rather than run on with fewer workers (or none) while leases are renewed."""
        if task.cancelled() or self._stop:
            return
        error = task.exception() or RuntimeError(f"{task.get_name()} ended")
        log.error("a worker of the pool ended unexpectedly: stopping the pool", exc_info=error)
        if self._fatal is None:
            self._fatal = error
        self.request_stop()

    def request_stop(self) -> None:
        """Take nothing more; :meth:`run` drains and returns."""
        self._stop = True
        self._room.set()
        self._progress.set()

    @property
    def drain_s(self) -> float:
        return self._settings.drain_s

    def runs_here(self) -> bool:
        """Whether the caller runs inside one of this pool's handlers (or a task it started)."""
        return HANDLING.get() is self

    async def finished(self) -> None:
        """Wait until :meth:`run` has drained and is about to return."""
        await self._finished.wait()

    def _add(self, batch: TakenBatch) -> None:
        lease = self._leases.add(batch)
        add = self._lanes.add
        for message in each_once(batch.messages):
            add(PoolJob(message, lease))
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand ready jobs to idle workers (a busy worker takes its next job itself)."""
        idle, lanes = self._idle, self._lanes
        while idle and self._dispatching:
            waiter = idle.popleft()
            if waiter.done():  # its worker was cancelled
                continue
            job = lanes.pop_ready()
            if job is None:
                idle.appendleft(waiter)
                return
            waiter.set_result(job)

    def _start(self, task: asyncio.Task[None], job: PoolJob) -> None:
        job.started = asyncio.get_running_loop().time()
        running = self._running
        running[task] = job
        stats = self.stats
        stats.most_in_progress = max(stats.most_in_progress, len(running))

    async def _worker(self) -> None:
        """Run jobs one after another; wait (idle) only when none is ready; end when the pool
        stops handing out jobs.

        A long-lived worker per slot, not a task per message: when a handler returns, its
        worker starts the next ready message at once, without a new task, a done callback and
        the loop iterations between them (they left a slot idle for ~0.3 ms per message).
        """
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - run() starts workers as tasks
            raise RuntimeError("a worker runs as a task")
        lanes = self._lanes
        while self._dispatching:
            job = lanes.pop_ready()
            if job is None:
                waiter: asyncio.Future[PoolJob | None] = loop.create_future()
                self._idle.append(waiter)
                try:
                    job = await waiter
                except asyncio.CancelledError:
                    if not waiter.cancelled() and (handed := waiter.result()) is not None:
                        # Handed a job as it was cancelled (the pool is going away).
                        self._leases.release([handed])
                        self._finish(handed)
                    raise
                if job is None:
                    return
            self._start(task, job)
            try:
                await self._work(job, task)
            finally:
                del self._running[task]
                self._finish(job)

    def _finish(self, job: PoolJob) -> None:
        job.lease.left -= 1
        self._lanes.done(job)
        self._dispatch()  # the lane's next job may be ready for an idle worker
        self._progress.set()
        self._wake_taker_if_room()

    def _has_room(self) -> bool:
        """Whether the take loop may take the next batch (see the module docstring)."""
        lanes, s = self._lanes, self._settings
        return lanes.ready < s.concurrency and lanes.waiting < s.max_waiting

    def _wake_taker_if_room(self) -> None:
        """Wake the take loop if it waits for room and there is some now."""
        if not self._room.is_set() and self._has_room():
            self._room.set()

    # -- one message ----------------------------------------------------------------------

    async def _work(self, job: PoolJob, task: asyncio.Task[None]) -> None:
        """Run the handler; settle the message as its outcome says.

        The pool cancels a handler for two reasons, kept in ``job.cancelled_for``: "timeout"
        (it ran past ``max_processing``: retried, whatever the handler did with the
        cancellation) and "stop" (the drain is over: given back, even if the handler returned:
        it cannot be known to have finished). Each costs one ``uncancel`` so that the
        long-lived worker's cancellation count stays right.
        """
        message = job.message
        error: BaseException | None = None
        try:
            await self._caller(message)
        except BaseException as exc:  # sorted out below
            error = exc
        why = job.cancelled_for
        if why is not None and task.cancelling():
            task.uncancel()
        if error is not None and not isinstance(error, Exception | asyncio.CancelledError):
            # Not the message's fault, and not ours to swallow: give the message back, stop
            # the pool, and let run() raise it.
            self._stop_with(error, job)
        elif why == "stop":
            self._leases.release([job])
            if isinstance(error, asyncio.CancelledError):
                raise error
        elif why == "timeout":
            await self._timed_out(message)
            if self._caller.blocking:
                # A thread cannot be interrupted: the slot and the lane stay taken until it
                # ends, so no two messages of a key run at once and no more than
                # `concurrency` threads are busy.
                await self._caller.thread_ended(task)
        elif error is None:
            await self._settle(message, "ack")
        elif isinstance(error, RetryMessage):
            await self._settle(message, "retry", error.reason, error.delay)
        elif isinstance(error, RejectMessage):
            await self._settle(message, "reject", error.reason)
        elif isinstance(error, HandlerReturnedAwaitable):
            self._stop_with(error, job)  # a programming error: every message would fail
        elif isinstance(error, asyncio.CancelledError):
            if self._stop and task.cancelling():  # the pool is going away
                self._leases.release([job])
                raise error
            # Not by the pool: the handler's own business, a failure.
            await self._failed(message, RuntimeError("the handler was cancelled"))
        else:
            await self._failed(message, error)

    async def _watch_deadlines(self) -> None:
        """Cancel handlers that run longer than ``max_processing``.

        One look over the running handlers every eighth of ``max_processing`` (at most a
        second), rather than a timer per message: a timer costs more than the rest of a
        message's bookkeeping, and a deadline of minutes does not need a finer grain.
        """
        limit = self._settings.max_processing_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(max(limit / 8, 0.005), 1.0))
            late = loop.time() - limit
            for task, job in self._running.items():
                if job.started <= late and job.cancelled_for is None:
                    job.cancelled_for = "timeout"
                    task.cancel()

    def _stop_with(self, exc: BaseException, job: PoolJob) -> None:
        self._leases.release([job])
        if self._fatal is None:
            self._fatal = exc
        self.request_stop()

    async def _timed_out(self, message: KmqMessage) -> None:
        self.stats.timed_out += 1
        limit = self._settings.max_processing_s
        log.warning("handler for %s ran longer than %.3g s: retried", message.id, limit)
        await self._settle(message, "retry", f"handler ran longer than {limit:.3g} s")

    async def _failed(self, message: KmqMessage, exc: BaseException) -> None:
        log.warning("handler failed for %s: retried", message.id, exc_info=exc)
        await self._settle(message, "retry", f"{type(exc).__name__}: {exc}")

    async def _settle(
        self, message: KmqMessage, how: str, reason: str = "", delay: timedelta | None = None
    ) -> None:
        """Settle as the handler's outcome says, unless the handler settled it itself.

        The verbs queue their marker without waiting for the broker.
        """
        stats = self.stats
        if message.settled is not None:
            stats.settled_by_handler += 1
            return
        try:
            if how == "ack":
                await message.ack()
                stats.acked += 1
            elif how == "reject":
                await message.reject(reason)
                stats.rejected += 1
            else:
                await message.retry(delay, reason=reason)
                stats.retried += 1
        except KmqError:  # e.g. a marker the sink refused: the lease still covers it
            log.exception("could not settle %s; the tracker will redeliver it", message.id)

    # -- draining -------------------------------------------------------------------------

    async def drain_partitions(self, partitions: set[tuple[str, int]], timeout_s: float) -> None:
        """The group takes ``partitions`` away: finish what the pool holds of them (waiting
        messages too) within ``timeout_s``, give back what is left. Handlers still running
        then run on."""

        def revoked(job: PoolJob) -> bool:
            message = job.message
            return (message.topic, message.partition) in partitions

        await self._drain(revoked, timeout_s, abandon=False)

    async def _drain(
        self, matches: Callable[[PoolJob], bool], timeout_s: float, *, abandon: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def holding() -> bool:
            return any(map(matches, self._running.values())) or self._lanes.any_waiting(matches)

        while holding():
            left = deadline - loop.time()
            if left <= 0:
                break
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)
        given_back = self._lanes.remove(matches)
        if given_back:
            log.info("gave %d waiting messages back to the tracker", len(given_back))
            self._leases.release(given_back)
            for job in given_back:
                job.lease.left -= 1
            self._wake_taker_if_room()  # a revocation's drain: the take loop goes on
        if not abandon:
            return
        self._dispatching = False
        for waiter in self._idle:  # idle workers end
            if not waiter.done():
                waiter.set_result(None)
        self._idle.clear()
        tasks = [task for task, job in self._running.items() if matches(job)]
        if tasks:
            log.warning(
                "%d handlers still running after the drain timeout: cancelled, their "
                "messages given back to the tracker",
                len(tasks),
            )
            for task in tasks:
                self._running[task].cancelled_for = "stop"
                task.cancel()
            _, stuck = await asyncio.wait(tasks, timeout=ABANDON_WAIT_S)
            if stuck:
                self._leases.release(self._running[task] for task in stuck if task in self._running)
                log.error(
                    "%d handlers ignored their cancellation; left running (their messages "
                    "were given back)",
                    len(stuck),
                )
