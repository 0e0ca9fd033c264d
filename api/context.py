"""What the API works with: settings, store, Kafka clients, metrics, and the engine if any.

The composition root (``tracker.runtime``) builds one, in two ways:

* ``engine_api_context(tracker)`` in the ``kmq-tracker run`` process: the API shares the
  tracker's store, producer, originals reader, clock and metrics, reports the engine's health
  (through the :class:`~tracker.ports.EngineHandle` port), and wakes its redelivery loop after
  an action changed a due time.
* ``standalone_api_context(settings)`` to serve the API alone (``create_standalone_app``): it
  builds its own store and Kafka clients from the settings, and runs redrive jobs itself.

Either way, the views that show what Kafka holds (payload previews, marker history) read
through :class:`KafkaReads`: clients of the API's own, whose every read is awaited at most
``api_kafka_read_timeout``, so a request answers in bounded time even while the broker is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tracker.client.marker_sink import KafkaMarkerSink
from tracker.clock import Clock, to_millis
from tracker.errors import ClientClosed
from tracker.ids import MessageId
from tracker.kafka.client_security import kafka_client_options
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.kafka.originals import OriginalsReader
from tracker.kafka.scan import PartitionScanner
from tracker.metrics import Metrics
from tracker.ports import EngineHandle, OriginalsSource, RedriveService
from tracker.settings import TrackerSettings
from tracker.store import Store, StoreUnavailable
from tracker.store.console_logouts import ConsoleLogouts
from tracker.store.inspection import InspectionQueries
from tracker.store.operator_actions import OperatorActions
from tracker.store.redrive_jobs import RedriveJobStore

from .marker_tail import MarkerTail
from .models import Check, Readiness
from .rates import CounterRates

log = logging.getLogger("api")

Closer = Callable[[], Awaitable[None]]

#: Seconds a readiness check may take before it counts as failed.
READINESS_TIMEOUT = 5.0

#: Reads through one of :class:`KafkaReads`' clients that may be outstanding at once; a request
#: beyond it waits (within its bound) for one to end. Reads through a client are serialized
#: anyway (one consumer, one position per partition): more would only queue.
MAX_PENDING_READS = 8

T = TypeVar("T")


class ReadTimedOut(OriginalsUnavailable):
    """Kafka did not answer an API read within ``api_kafka_read_timeout`` (not known lost)."""


def not_served(exc: OriginalsUnavailable) -> str:
    """``payload_error`` for a record Kafka did not serve (it is not known to be lost)."""
    return str(exc) if isinstance(exc, ReadTimedOut) else f"Kafka unavailable: {exc}"


@dataclass(eq=False)
class _PendingRead:
    task: asyncio.Task[Any]
    started: float  #: loop time


class BoundedReads:
    """Reads through one Kafka client, each awaited at most until the request's deadline.

    Why not ``asyncio.timeout`` around the read: cancelling an aiokafka operation half-way can
    leave the consumer in a bad state (see ``OriginalsReader.stop``), and the reader would then
    have to be rebuilt. So a read runs as a task of its own that is never cancelled (except at
    :meth:`close`): the request waits for it with ``asyncio.wait(..., timeout=...)``, and when
    the deadline passes it answers without the result, while the read finishes in the
    background (bounded by the client's own timeouts) and its result is dropped.

    Abandoned reads must not pile up during a long outage, so:

    * a read of the same thing (``key``) that is still running is joined, not started again:
      an operator who reloads a view waits for the same read, and sees its result once the
      broker answers;
    * while a read has been running for longer than the bound, Kafka is known not to answer
      (through this client): another read is not started, the request is answered at once;
    * at most :data:`MAX_PENDING_READS` reads are outstanding; a request beyond that waits for
      one to end, within its own deadline.

    A caller that can show a slightly older answer passes ``max_age``: a read of the same
    thing that succeeded less than ``max_age`` seconds ago is reused. The console's overview
    does so for the tracker's health (the bounds of the markers topic): a room of operators
    and dashboards watching it costs Kafka one read every few seconds, not one per refresh.
    The result is shared between those callers: they must not change it.
    """

    def __init__(self, what: str, timeout: float, *, limit: int = MAX_PENDING_READS) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        self.what = what
        self.timeout = timeout
        self.limit = limit
        self._pending: dict[Hashable, _PendingRead] = {}
        #: the last successful result of the reads asked with ``max_age``: (loop time, result)
        self._recent: dict[Hashable, tuple[float, Any]] = {}

    @property
    def pending(self) -> int:
        """Reads still running, awaited by a request or abandoned."""
        return len(self._pending)

    async def run(
        self,
        key: Hashable,
        read: Callable[[], Coroutine[Any, Any, T]],
        deadline: float,
        *,
        max_age: float = 0.0,
    ) -> T:
        """``await read()``'s result, or :class:`ReadTimedOut` once the loop time ``deadline``
        has passed (the read then goes on, see the class). ``key`` names what is read;
        ``max_age`` > 0 accepts the result of a read of ``key`` that ended that recently."""
        loop = asyncio.get_running_loop()
        if max_age > 0:
            recent = self._recent.get(key)
            if recent is not None and loop.time() - recent[0] < max_age:
                cached: T = recent[1]
                return cached
        while (pending := self._pending.get(key)) is None:
            now = loop.time()
            overdue = max((now - p.started for p in self._pending.values()), default=0.0)
            if overdue > self.timeout:
                raise ReadTimedOut(
                    f"Kafka did not answer within {self.timeout:g} s (an earlier read has "
                    f"been waiting for it for {overdue:.0f} s)"
                )
            if now >= deadline:
                raise self._timed_out()
            if len(self._pending) < self.limit:
                pending = self._start(key, read, now)
                break
            waits = [p.task for p in self._pending.values()]
            await asyncio.wait(waits, timeout=deadline - now, return_when=asyncio.FIRST_COMPLETED)
        # Not asyncio.wait_for: that would cancel the read when the deadline passes.
        done, _ = await asyncio.wait({pending.task}, timeout=max(deadline - loop.time(), 0.0))
        if not done:
            raise self._timed_out()
        result: T = pending.task.result()
        if max_age > 0:
            now = loop.time()
            # Kept no longer than a caller accepts: the dict holds only recent answers.
            for old in [k for k, (at, _) in self._recent.items() if now - at >= max_age]:
                del self._recent[old]
            self._recent[key] = (now, result)
        return result

    def _timed_out(self) -> ReadTimedOut:
        return ReadTimedOut(f"Kafka did not answer within {self.timeout:g} s")

    def _start(
        self, key: Hashable, read: Callable[[], Coroutine[Any, Any, T]], now: float
    ) -> _PendingRead:
        task = asyncio.create_task(read(), name=f"api {self.what} read")
        pending = _PendingRead(task, now)
        self._pending[key] = pending

        def finished(task: asyncio.Task[Any]) -> None:
            if self._pending.get(key) is pending:
                del self._pending[key]
            if task.cancelled():
                return
            # Retrieved here, so an abandoned read's failure is not reported as "never
            # retrieved"; a request waiting for it still gets it from task.result().
            error = task.exception()
            if error is not None and not isinstance(error, OriginalsUnavailable | ClientClosed):
                log.warning("%s read failed", self.what, exc_info=error)

        task.add_done_callback(finished)
        return pending

    async def close(self) -> None:
        """Cancel the reads still running (before their client is stopped)."""
        tasks = [p.task for p in self._pending.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class KafkaReads:
    """What the message and dead-letter views read from Kafka, within ``timeout`` seconds.

    The API reads through clients of its own rather than the tracker's: an originals reader
    serializes its reads, so an operator's read stuck on an unreachable partition would hold up
    the redelivery loop (and a redelivery round the operator's read), and the engine's clients
    keep their own, longer timeouts. The clients connect on first use and keep their default
    timeouts (30 s): a slow read is not cut short, :class:`BoundedReads` bounds the wait.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        client_config: dict[str, Any],
        timeout: float,
        *,
        markers_topic: str,
        history_window: int,
    ) -> None:
        self.timeout = timeout
        self.originals = OriginalsReader(bootstrap_servers, client_config=client_config)
        self.scanner = PartitionScanner(bootstrap_servers, client_config=client_config)
        #: The markers partitions' last records, searched for a message's marker history
        #: (None when ``history_window`` is 0: the views show no history).
        self.marker_tail = (
            MarkerTail(self.scanner, markers_topic, history_window) if history_window > 0 else None
        )
        #: payload previews (through ``originals``) and marker histories (through ``scanner``)
        self.payloads = BoundedReads("payload preview", timeout)
        self.history = BoundedReads("marker history", timeout)
        self._starting = asyncio.Lock()
        self._closed = False

    def deadline(self) -> float:
        """The loop time by which a request's Kafka reads must have answered."""
        return asyncio.get_running_loop().time() + self.timeout

    async def fetch(self, target: MessageId, deadline: float) -> OriginalRecord | Missing | None:
        """The record at ``target``; raises :class:`OriginalsUnavailable` (or its subclass
        :class:`ReadTimedOut`) when Kafka does not serve it by ``deadline``."""
        return await self.payloads.run(target, lambda: self._fetch(target), deadline)

    async def _fetch(self, target: MessageId) -> OriginalRecord | Missing | None:
        async with self._starting:
            if self._closed:
                raise ClientClosed("the API's Kafka reads are closed")
            await self.originals.start()
        return (await self.originals.fetch([target])).get(target)

    async def close(self) -> None:
        self._closed = True
        await self.payloads.close()
        await self.history.close()
        async with self._starting:
            await self.originals.stop()
        await self.scanner.stop()


@dataclass(eq=False)
class ApiContext:
    """Everything a request handler may need; built once per app (no module globals)."""

    settings: TrackerSettings
    store: Store
    metrics: Metrics
    markers: KafkaMarkerSink
    #: The producer (``acks=all``) the markers sink and redrive jobs write with.
    producer: Any
    originals: OriginalsSource
    scanner: PartitionScanner
    clock: Clock
    #: The views' reads from Kafka, bounded by ``api_kafka_read_timeout`` (clients of their own).
    reads: KafkaReads
    #: The engine running in this process, if any (its health; woken after an action).
    engine: EngineHandle | None = None
    #: A runner to wake when a job is created; run by the app itself when ``run_redrive``.
    redrive: RedriveService | None = None
    run_redrive: bool = False
    #: History of the redeliveries counter, for per-topic redelivery rates.
    rates: CounterRates = field(init=False)
    #: The store's admin side: what operators read, their actions, redrive jobs.
    queries: InspectionQueries = field(init=False)
    actions: OperatorActions = field(init=False)
    jobs: RedriveJobStore = field(init=False)
    #: Console sessions logged out before their expiry.
    logouts: ConsoleLogouts = field(init=False)
    _closers: list[Closer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rates = CounterRates(self.metrics.redeliveries)
        topic = self.settings.markers_topic
        self.queries = InspectionQueries(self.store, topic)
        self.actions = OperatorActions(self.store, topic)
        self.jobs = RedriveJobStore(self.store, topic)
        self.logouts = ConsoleLogouts(self.store, topic)

    def close_with(self, closer: Closer) -> None:
        """Have :meth:`close` call ``closer`` (last added, first called)."""
        self._closers.append(closer)

    async def close(self) -> None:
        """Close what this context opened (not what it shares with a tracker)."""
        closers, self._closers = self._closers, []
        await close_all(closers)

    # -- helpers ----------------------------------------------------------------------------------

    def now_ms(self) -> int:
        return to_millis(self.clock.now())

    def wake_redelivery(self, due_ms: int) -> None:
        """An action set a due time: wake the local redelivery loop if it would sleep past it."""
        if self.engine is not None:
            self.engine.wake_redelivery(due_ms)

    def wake_redrive(self) -> None:
        if self.redrive is not None:
            self.redrive.notify()

    async def readiness(self) -> Readiness:
        """Database and broker reachable; with the engine, also markers partitions owned.

        Bounded by :data:`READINESS_TIMEOUT`: a probe must get an answer, not hang on an
        unreachable database.
        """
        try:
            async with asyncio.timeout(READINESS_TIMEOUT):
                return await self._readiness()
        except TimeoutError:
            return Readiness(
                ready=False,
                checks={
                    "timeout": Check(
                        ok=False,
                        detail=f"the checks did not finish within {READINESS_TIMEOUT:g} s "
                        "(database or Kafka not answering)",
                    )
                },
            )

    async def _readiness(self) -> Readiness:
        if self.engine is not None:
            health = await self.engine.health()
            owned = health.owned_partitions
            checks = {
                "engine": Check(
                    ok=health.running,
                    detail="running" if health.running else "not running (starting or stopping)",
                ),
                "store": Check(
                    ok=health.store_ok,
                    detail="database answers" if health.store_ok else str(health.last_error),
                ),
                "broker": Check(
                    ok=health.broker_ok,
                    detail="Kafka answers" if health.broker_ok else str(health.last_error),
                ),
                "partitions": Check(
                    ok=bool(owned),
                    detail=f"owns markers partitions {owned}"
                    if owned
                    else "no markers partitions assigned (yet)",
                ),
            }
            return Readiness(ready=health.ready and bool(owned), checks=checks)
        checks = {}
        try:
            await self.store.ping()
            checks["store"] = Check(ok=True, detail="database answers")
        except StoreUnavailable as exc:
            checks["store"] = Check(ok=False, detail=str(exc))
        topic = self.settings.markers_topic
        try:
            counts = await self.scanner.partition_counts([topic])
        except OriginalsUnavailable as exc:
            checks["broker"] = Check(ok=False, detail=str(exc))
        else:
            if counts.get(topic):
                checks["broker"] = Check(
                    ok=True, detail=f"Kafka answers; markers topic {topic!r} exists"
                )
            else:
                checks["broker"] = Check(
                    ok=False, detail=f"Kafka answers, but the markers topic {topic!r} is missing"
                )
        return Readiness(ready=all(c.ok for c in checks.values()), checks=checks)


def kafka_reads(settings: TrackerSettings) -> KafkaReads:
    """The API's own bounded Kafka reads, from the settings."""
    return KafkaReads(
        settings.kafka_bootstrap_servers,
        kafka_client_options(settings),
        settings.api_kafka_read_timeout.total_seconds(),
        markers_topic=settings.markers_topic,
        history_window=settings.api_marker_history_scan,
    )


async def close_all(closers: list[Closer]) -> None:
    """Call each of ``closers``, last first; a failure does not stop the others."""
    for close in reversed(closers):
        with contextlib.suppress(Exception):
            await close()
