"""The tracker's engine: one replica's loops, run on the connections it is given until stopped.

``Tracker`` is the engine's supervisor. The composition root (``tracker.runtime``) builds its
store and Kafka clients (:class:`~tracker.engine.connections.EngineConnections`) and the
services that run beside it (the API: the engine never imports it); the tracker builds its
loops on them (ingest, redelivery, payload keeper, redrive jobs), each a named task driven by
one stop event, starts and closes the connections, and runs the services. Ingest reaches the
other loops through ``tracker.engine.signals`` (:class:`EngineWakeups`).
``await tracker.run()`` runs until :meth:`Tracker.stop` (SIGTERM in ``kmq-tracker run``); on
the way out it finishes the current batch, applies what it read, commits and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

from tracker.clock import Clock, SystemClock, to_millis
from tracker.engine.connections import EngineConnections
from tracker.engine.ingest import MarkerIngest
from tracker.engine.parking import InvalidMarkerParker
from tracker.engine.payloads import PayloadKeeper
from tracker.engine.read_ahead import HeldOriginals, ReadAhead
from tracker.engine.redeliver import Redeliverer
from tracker.engine.redelivery_rounds import TrackerEvent
from tracker.engine.redrive_runner import RedriveRunner
from tracker.engine.topic_catalog import TopicCatalog
from tracker.engine.topic_setup import OutputTopics, prepare_tracker_topics
from tracker.kafka.clients import stop_consumer
from tracker.metrics import Metrics
from tracker.ports import EngineHealth
from tracker.settings import TrackerSettings
from tracker.store import StoreUnavailable
from tracker.store.migrate import check_schema, database_errors, upgrade
from tracker.store.redrive_leases import RedriveLeaseStore
from tracker.store.topic_binding import bind_markers_topic

log = logging.getLogger(__name__)

HEALTH_PING_TIMEOUT = 2.0  #: seconds the readiness check waits for the database

EventHook = Callable[[TrackerEvent], Awaitable[None] | None]


def _retrieve_outcome(task: asyncio.Task[None]) -> None:
    """Mark a background task's exception as seen (it is read where it matters)."""
    if not task.cancelled():
        task.exception()


class TrackerService(Protocol):
    """A part that runs beside the engine in the tracker's process (the API).

    The engine knows nothing of what it is: ``tracker.runtime`` builds it and hands it over.
    """

    name: str

    def bind(self) -> None:
        """Take what can fail fast (a listening port) before the database or Kafka is touched."""
        ...

    def serve(self, engine: Tracker, stopping: asyncio.Event) -> Coroutine[Any, Any, None]:
        """What to run as a side task once the engine runs, until ``stopping`` is set."""
        ...

    async def close(self) -> None:
        """Release what :meth:`bind` and :meth:`serve` took (also when never served)."""
        ...


class EngineWakeups:
    """The :class:`~tracker.engine.signals.IngestListener` of a tracker: ingest's news goes
    to the loops that sleep on it (redelivery, the payload keeper)."""

    def __init__(self, tracker: Tracker) -> None:
        self._tracker = tracker

    def due(self, due_ms: int) -> None:
        self._tracker.redeliverer.notify_due(due_ms)
        self._tracker.payloads.notify()

    def caught_up(self, safe_ms: int) -> None:
        self._tracker.redeliverer.notify_safe(safe_ms)

    def ownership_changed(self) -> None:
        self._tracker.redeliverer.notify_ownership()
        self._tracker.payloads.notify()
        self._tracker.warn_if_sqlite_shared()


class Tracker:
    """One tracker replica."""

    def __init__(
        self,
        settings: TrackerSettings,
        connections: EngineConnections,
        *,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        on_event: EventHook | None = None,
        services: Sequence[TrackerService] = (),
    ) -> None:
        self.settings = settings
        self._services = list(services)
        self.clock: Clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        self.store = connections.store
        self._consumer = connections.markers_consumer
        self._producer = connections.producer
        self.originals = connections.originals
        self.scanner = connections.scanner
        self._client_config = connections.client_config
        self.catalog = TopicCatalog(settings, client_config=self._client_config)
        self.ingest = MarkerIngest(
            consumer=self._consumer,
            store=self.store,
            parker=InvalidMarkerParker(
                self._producer, settings.invalid_topic, settings.markers_topic
            ),
            markers_topic=settings.markers_topic,
            replica_id=settings.replica_id,
            policy_for=self.catalog.resolved,
            clock=self.clock,
            metrics=self.metrics,
            coalesce_window=settings.coalesce_window.total_seconds(),
            ack_grace_ms=int(settings.ack_grace.total_seconds() * 1000),
            max_records=settings.ingest_max_records,
            max_pending=settings.max_pending_markers,
            check_marker=self.catalog,
            listener=EngineWakeups(self),
            poll_wait=connections.markers_poll_wait,
        )
        self.output_topics = OutputTopics(
            settings, scanner=self.scanner, metrics=self.metrics, client_config=self._client_config
        )
        self.redeliverer = Redeliverer(
            store=self.store,
            producer=self._producer,
            originals=self.originals,
            markers_topic=settings.markers_topic,
            progress=self.ingest,
            policy_for=self.catalog.policy,
            clock=self.clock,
            metrics=self.metrics,
            batch=settings.redelivery_batch,
            claim_lease_ms=int(settings.claim_lease.total_seconds() * 1000),
            max_idle=settings.max_idle_sleep.total_seconds(),
            on_event=on_event,
            ensure_topic=self.output_topics.ensure,
            read_ahead=self._read_ahead(settings),
        )
        self.payloads = PayloadKeeper(
            store=self.store,
            originals=self.originals,
            owned_partitions=lambda: sorted(self.ingest.owned_epochs()),
            clock=self.clock,
            metrics=self.metrics,
        )
        self.redrive = RedriveRunner(
            jobs=RedriveLeaseStore(self.store, settings.markers_topic),
            producer=self._producer,
            originals=self.originals,
            scanner=self.scanner,
            owner=settings.replica_id,
            metrics=self.metrics,
            lease_seconds=settings.redrive_lease.total_seconds(),
            clock=self.clock,
        )
        self._stopping = asyncio.Event()
        self._started = False
        self._running = False
        self._tasks: list[asyncio.Task[None]] = []
        self._ping: asyncio.Task[None] | None = None

    # -- wiring ---------------------------------------------------------------------------

    def _read_ahead(self, settings: TrackerSettings) -> ReadAhead | None:
        """Redelivery's read ahead (``tracker.engine.read_ahead``); None if turned off."""
        if settings.read_ahead_bytes <= 0:
            return None
        held = HeldOriginals(
            self.originals, max_bytes=settings.read_ahead_bytes, metrics=self.metrics
        )
        return ReadAhead(
            store=self.store,
            originals=held,
            owned_partitions=self.ingest.owned_epochs,
            clock=self.clock,
            max_idle=settings.max_idle_sleep.total_seconds(),
        )

    def warn_if_sqlite_shared(self) -> None:
        """SQLite is single-replica: a second tracker in the group would split the state."""
        if not self.store.is_sqlite:
            return
        total = self._consumer.partitions_for_topic(self.settings.markers_topic) or set()
        owned = self.ingest.owned_epochs()
        if owned and len(owned) < len(total):
            log.error(
                "MISCONFIGURED: the SQLite store supports exactly one tracker replica, but "
                "consumer group %r gave this replica only %d of %d markers partitions: another "
                "replica is running. Stop it, or use PostgreSQL for several replicas.",
                self.settings.tracker_group,
                len(owned),
                len(total),
            )

    # -- lifecycle --------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Schema and topics: migrate if asked, refuse an outdated schema or a database that
        serves another markers topic, create topics."""
        settings = self.settings
        async with database_errors(self.store.engine):
            if settings.migrate_on_start:
                await upgrade(self.store.engine)
            await check_schema(self.store.engine)
            await bind_markers_topic(
                self.store,
                settings.markers_topic,
                by=settings.replica_id,
                now_ms=to_millis(self.clock.now()),
            )
        await prepare_tracker_topics(self.settings, self._client_config)

    async def start(self) -> None:
        """Connect everything and start the side tasks (returns once they run)."""
        if self._started:
            return
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.close()  # no client or connection outlives a failed start
            raise

    async def _start(self) -> None:
        for service in self._services:
            service.bind()  # first: a taken port fails the start before anything connects
        await self.prepare()
        await self._producer.start()
        await self.originals.start()
        await self.catalog.start()
        self._consumer.subscribe([self.settings.markers_topic], listener=self.ingest.listener())
        await self._consumer.start()
        self._running = True
        self._tasks = [
            asyncio.create_task(self.ingest.run(self._stopping), name="kmq-ingest"),
            asyncio.create_task(self.redeliverer.run(self._stopping), name="kmq-redelivery"),
            asyncio.create_task(self.payloads.run(self._stopping), name="kmq-payloads"),
            asyncio.create_task(self.redrive.run(self._stopping), name="kmq-redrive"),
        ]
        for service in self._services:
            work = service.serve(self, self._stopping)
            self._tasks.append(asyncio.create_task(work, name=f"kmq-{service.name}"))
        log.info(
            "tracker %s running: markers %r, store %s",
            self.settings.replica_id,
            self.settings.markers_topic,
            self.store.engine.url.render_as_string(hide_password=True),
        )

    async def run(self) -> None:
        """Start, then wait until stopped (or a side task fails), then shut down."""
        await self.start()
        try:
            stop = asyncio.ensure_future(self._stopping.wait())
            done, _ = await asyncio.wait([*self._tasks, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            for task in done:
                if task is not stop and task.exception() is not None:
                    log.error("task %s failed", task.get_name(), exc_info=task.exception())
                    raise task.exception()  # type: ignore[misc]
        finally:
            await self.close()

    def stop(self) -> None:
        """Ask the tracker to shut down gracefully (safe from signal handlers)."""
        self._stopping.set()

    async def close(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await asyncio.wait_for(asyncio.shield(task), 30)
                except TimeoutError:
                    task.cancel()
                except Exception:
                    log.exception("task %s failed while stopping", task.get_name())
        self._tasks = []
        for service in self._services:
            try:
                await service.close()
            except Exception:
                log.exception("closing %s failed", service.name)
        await self.scanner.stop()
        if self._running:
            self._running = False
            await self.ingest.release_all()
        with contextlib.suppress(Exception):
            await stop_consumer(self._consumer)  # also when never started: aiokafka warns
        await self.catalog.stop()
        await self.originals.stop()
        with contextlib.suppress(Exception):
            await self._producer.stop()
        if self._ping is not None:
            # Bounded: a ping stuck on a locked database must not hold the shutdown.
            self._ping.cancel()
            await asyncio.wait({self._ping}, timeout=HEALTH_PING_TIMEOUT)
            self._ping = None
        await self.store.close()

    async def _store_answers(self) -> bool:
        """Whether the database answered a ping within ``HEALTH_PING_TIMEOUT``.

        One ping runs at a time, in the background, and health checks share it: a locked
        SQLite file or a hung connection cannot be timed out from outside (cancelling the
        waiting coroutine still leaves the driver's thread blocked, and the connection's
        cleanup queues behind it for the whole busy timeout), so a probe that waited for its
        own ping would hang with it, and every new probe would pile up another blocked ping.
        While the ping is unanswered, the store reads as down.
        """
        ping = self._ping
        if ping is None or ping.done():
            ping = self._ping = asyncio.create_task(self.store.ping(), name="kmq-health-ping")
            ping.add_done_callback(_retrieve_outcome)
        done, _ = await asyncio.wait({ping}, timeout=HEALTH_PING_TIMEOUT)
        if not done or ping.cancelled():
            return False
        error = ping.exception()
        if error is not None and not isinstance(error, StoreUnavailable):
            log.warning("database ping failed: %r", error)
        return error is None

    @property
    def producer(self) -> Any:
        """The tracker's Kafka producer (shared with the API it serves)."""
        return self._producer

    async def __aenter__(self) -> Tracker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- health ---------------------------------------------------------------------------

    def engine_state(self) -> tuple[bool, str | None]:
        """Whether the engine runs, and its last error: the part of :meth:`health` that needs
        no round trip (the console's overview shows it on every refresh)."""
        # A side task that ended (ingest, redelivery, ...) means this replica no longer does
        # its job, even if the process is still up.
        running = (
            self._running
            and not self._stopping.is_set()
            and not any(task.done() for task in self._tasks)
        )
        return running, self.ingest.last_error or self.redeliverer.last_error

    def wake_redelivery(self, due_ms: int) -> None:
        """Something outside the markers (an operator's action) set a due time."""
        self.redeliverer.notify_due(due_ms)

    async def health(self) -> EngineHealth:
        store_ok = self.ingest.store_ok and await self._store_answers()
        running, last_error = self.engine_state()
        return EngineHealth(
            running=running,
            store_ok=store_ok,
            broker_ok=self.ingest.broker_answering(),
            owned_partitions=sorted(self.ingest.owned_epochs()),
            last_error=last_error,
        )
