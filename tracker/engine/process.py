"""The tracker's engine: builds its parts from the settings and runs them until stopped.

``Tracker`` is the engine's factory and supervisor: it owns the store, the Kafka clients and
the side tasks (ingest, redelivery, payload keeper, redrive jobs), each a named task driven by
one stop event, and runs the services it is given beside them (the API, which
``tracker.runtime.create_tracker`` hands over: the engine never imports it). Ingest reaches
the other loops through ``tracker.engine.signals`` (:class:`EngineWakeups`).
``await tracker.run()`` runs until :meth:`Tracker.stop` (SIGTERM in ``kmq-tracker run``); on
the way out it finishes the current batch, applies what it read, commits and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tracker.clock import Clock, SystemClock
from tracker.engine.ingest import MarkerIngest
from tracker.engine.parking import InvalidMarkerParker
from tracker.engine.payloads import PayloadKeeper
from tracker.engine.redeliver import Redeliverer, TrackerEvent
from tracker.engine.redrive_runner import RedriveRunner
from tracker.engine.topic_catalog import TopicCatalog
from tracker.errors import KmqError
from tracker.kafka.client_security import kafka_client_options
from tracker.kafka.clients import stop_consumer
from tracker.kafka.originals import OriginalsReader
from tracker.kafka.scan import PartitionScanner
from tracker.kafka.topic_admin import ensure_topic, topic_timestamp_type
from tracker.metrics import Metrics
from tracker.ports import EngineHealth
from tracker.settings import TrackerSettings
from tracker.store import Store, StoreUnavailable
from tracker.store.migrate import check_schema, database_errors, upgrade
from tracker.store.redrive_leases import RedriveLeaseStore

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


#: The markers consumer's fetch settings unless ``kafka_consumer_config`` says otherwise. The
#: tracker may only act on a deadline once it has read every marker written before it, and it
#: learns how far the log went from fetch responses: a broker that answers a long poll only
#: when ``fetch_max_wait_ms`` runs out (the test broker does, mid-wait data or not) would hold
#: that knowledge back by up to the wait, and on any broker an idle markers topic tells that
#: nothing new was written only when the wait runs out. 100 ms bounds it; an idle tracker
#: then sends ten small fetch requests a second per broker, which no broker notices. (25 ms
#: cut the horizon's lag at p95 from ~130 to ~45 ms in the lateness bench, but on the test
#: broker a START and its SETTLE then came in separate responses and were flushed apart
#: instead of cancelling out: see docs/benchmarks.md.)
MARKERS_FETCH: dict[str, Any] = {"fetch_max_wait_ms": 100}


class Tracker:
    """One tracker replica."""

    def __init__(
        self,
        settings: TrackerSettings,
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
        self.store = Store.from_url(settings.database_url)
        self._on_event = on_event
        self._client_config: dict[str, Any] = kafka_client_options(settings)
        bootstrap = settings.kafka_bootstrap_servers
        self.catalog = TopicCatalog(settings, client_config=self._client_config)
        markers_fetch = {**MARKERS_FETCH, **self._client_config, **settings.kafka_consumer_config}
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=settings.tracker_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            client_id=f"kmq-tracker-{settings.replica_id}",
            **markers_fetch,
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", linger_ms=2, **self._client_config
        )
        self.originals = OriginalsReader(bootstrap, client_config=self._client_config)
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
            # A poll waits no longer than a fetch does: the horizon moves with each answer.
            poll_wait=max(0.01, int(markers_fetch.get("fetch_max_wait_ms", 500)) / 1000),
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
            ensure_topic=self._ensure_output_topic,
        )
        self._ensured: set[str] = set()
        self.payloads = PayloadKeeper(
            store=self.store,
            originals=self.originals,
            owned_partitions=lambda: sorted(self.ingest.owned_epochs()),
            clock=self.clock,
            metrics=self.metrics,
        )
        self.scanner = PartitionScanner(bootstrap, client_config=self._client_config)
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

    async def _ensure_output_topic(self, topic: str, like: str) -> None:
        """Before the first write to a DLQ or retry topic: as many partitions as ``like``?

        Creates the topic (``create_topics``) with the partition count of ``like``, the topic
        whose messages it receives, so that per-partition order and parallelism survive a
        redrive; an existing topic with fewer partitions is reported (a warning and
        ``kmq_output_topic_partitions_missing``), not changed. Partition counts are asked of
        the cluster (all-topics metadata, through the tracker's partition scanner): no client
        of the tracker subscribes to queue topics, and on Apache Kafka a consumer's metadata
        holds only the topics it subscribed to.
        """
        if topic in self._ensured:
            return
        try:
            # One all-topics metadata request (it creates nothing) answers for both.
            counts = await self.scanner.partition_counts([like, topic])
        except KmqError as exc:
            if self.settings.create_topics:
                raise  # the copy waits: it must not go to a topic auto-created with 1 partition
            # Only a check when the tracker creates nothing (a locked-down cluster may not
            # allow it): never a reason to hold a dead letter back.
            log.warning("cannot check the partitions of %r (%s); writing to it anyway", topic, exc)
            self._ensured.add(topic)
            return
        wanted, existing = counts[like] or 1, counts[topic]
        if existing is None and self.settings.create_topics:
            created = await ensure_topic(
                self.settings.kafka_bootstrap_servers,
                topic,
                partitions=wanted,
                replication_factor=self.settings.markers_replication_factor,
                configs=self.settings.output_topic_configs,
                client_config=self._client_config,
            )
            # Created: ensure_topic returned once all of them had a leader. Not created:
            # another replica did it a moment ago, with a count of its own.
            existing = wanted if created else (await self.scanner.partition_counts([topic]))[topic]
        if existing is None:
            log.warning(
                "topic %r does not exist (create_topics is off): writing to it relies on the "
                "broker's auto-creation (num.partitions), not %d partitions like %r",
                topic,
                wanted,
                like,
            )
        elif existing < wanted:
            log.warning(
                "topic %r has %d partitions, fewer than the %d of %r whose messages it "
                "receives: its records lose their partition order and parallelism; add "
                "partitions (kafka-topics.sh --alter --topic %s --partitions %d)",
                topic,
                existing,
                wanted,
                like,
                topic,
                wanted,
            )
        missing = 0 if existing is None else max(0, wanted - existing)
        self.metrics.output_topic_partitions_missing.labels(topic, like).set(missing)
        self._ensured.add(topic)

    # -- lifecycle --------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Schema and topics: migrate if asked, refuse an outdated schema, create topics."""
        async with database_errors(self.store.engine):
            if self.settings.migrate_on_start:
                await upgrade(self.store.engine)
            await check_schema(self.store.engine)
        if self.settings.create_topics:
            await ensure_topic(
                self.settings.kafka_bootstrap_servers,
                self.settings.markers_topic,
                partitions=self.settings.markers_partitions,
                replication_factor=self.settings.markers_replication_factor,
                configs={"message.timestamp.type": "LogAppendTime"},
                client_config=self._client_config,
            )
            await ensure_topic(
                self.settings.kafka_bootstrap_servers,
                self.settings.invalid_topic,
                partitions=1,
                replication_factor=self.settings.markers_replication_factor,
                client_config=self._client_config,
            )
        kind = await topic_timestamp_type(
            self.settings.kafka_bootstrap_servers,
            self.settings.markers_topic,
            client_config=self._client_config,
        )
        if kind == "CreateTime":
            log.warning(
                "markers topic %r uses CreateTime: deadlines follow the consumers' clocks; "
                "set message.timestamp.type=LogAppendTime (see docs/protocol.md, Time)",
                self.settings.markers_topic,
            )

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
