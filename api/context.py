"""What the API works with: settings, store, Kafka clients, metrics, and the engine if any.

Two ways to get one:

* :meth:`ApiContext.from_tracker` in the ``kmq-tracker run`` process: the API shares the
  tracker's store, producer, originals reader, clock and metrics, reports the engine's health,
  and wakes its redelivery loop after an action changed a due time.
* :meth:`ApiContext.standalone` to serve the API alone (``create_standalone_app``): it builds
  its own store and Kafka clients from the settings, and runs redrive jobs itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer

from tracker.client.markers import KafkaMarkerSink
from tracker.clock import Clock, SystemClock, to_millis
from tracker.engine.redeliver import OriginalsSource
from tracker.engine.redrive import RedriveRunner
from tracker.kafka.originals import OriginalsReader, OriginalsUnavailable
from tracker.kafka.scan import PartitionScanner
from tracker.kafka.security import kafka_client_options
from tracker.metrics import Metrics
from tracker.settings import TrackerSettings
from tracker.store import Store, StoreUnavailable
from tracker.store.admin import AdminStore
from tracker.store.migrate import check_schema, upgrade

from .models import Check, Readiness
from .rates import CounterRates

if TYPE_CHECKING:
    from tracker.engine.process import Tracker

log = logging.getLogger("api")

Closer = Callable[[], Awaitable[None]]

#: Seconds a readiness check may take before it counts as failed.
READINESS_TIMEOUT = 5.0


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
    admin: AdminStore
    tracker: Tracker | None = None
    #: A runner to wake when a job is created; run by the app itself when ``run_redrive``.
    redrive: RedriveRunner | None = None
    run_redrive: bool = False
    #: History of the redeliveries counter, for per-topic redelivery rates.
    rates: CounterRates = field(init=False)
    _closers: list[Closer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rates = CounterRates(self.metrics.redeliveries)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_tracker(cls, tracker: Tracker) -> ApiContext:
        """Share the running tracker's clients (call after ``tracker.start()``)."""
        settings = tracker.settings
        producer: Any = tracker.producer
        scanner = PartitionScanner(
            settings.kafka_bootstrap_servers, client_config=kafka_client_options(settings)
        )
        redrive = getattr(tracker, "redrive", None)
        context = cls(
            settings=settings,
            store=tracker.store,
            metrics=tracker.metrics,
            markers=KafkaMarkerSink(producer, settings.markers_topic),
            producer=producer,
            originals=tracker.originals,
            scanner=scanner,
            clock=tracker.clock,
            admin=AdminStore(tracker.store, settings.markers_topic),
            tracker=tracker,
            redrive=redrive if isinstance(redrive, RedriveRunner) else None,
        )
        context._closers.append(scanner.stop)
        return context

    @classmethod
    async def standalone(
        cls,
        settings: TrackerSettings,
        *,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        run_redrive: bool = True,
    ) -> ApiContext:
        """Build a store and Kafka clients of its own (close with :meth:`close`).

        Refuses an outdated schema (``migrate_on_start`` migrates first), like the tracker.
        """
        closers: list[Closer] = []
        try:
            store = Store.from_url(settings.database_url)
            closers.append(store.close)
            if settings.migrate_on_start:
                await upgrade(store.engine)
            await check_schema(store.engine)
            config = kafka_client_options(settings)
            producer = AIOKafkaProducer(
                bootstrap_servers=settings.kafka_bootstrap_servers,
                acks="all",
                linger_ms=2,
                **config,
            )
            await producer.start()
            closers.append(producer.stop)
            originals = OriginalsReader(settings.kafka_bootstrap_servers, client_config=config)
            await originals.start()
            closers.append(originals.stop)
            scanner = PartitionScanner(settings.kafka_bootstrap_servers, client_config=config)
            closers.append(scanner.stop)
        except BaseException:
            await _close_all(closers)
            raise
        metrics = metrics or Metrics()
        admin = AdminStore(store, settings.markers_topic)
        clock = clock or SystemClock()
        redrive = RedriveRunner(
            admin=admin,
            producer=producer,
            originals=originals,
            scanner=scanner,
            owner=f"{settings.replica_id}/api",
            metrics=metrics,
            lease_seconds=settings.redrive_lease.total_seconds(),
            clock=clock,
        )
        context = cls(
            settings=settings,
            store=store,
            metrics=metrics,
            markers=KafkaMarkerSink(producer, settings.markers_topic),
            producer=producer,
            originals=originals,
            scanner=scanner,
            clock=clock,
            admin=admin,
            redrive=redrive,
            run_redrive=run_redrive,
        )
        context._closers = closers
        return context

    async def close(self) -> None:
        """Close what this context opened (not what it shares with a tracker)."""
        closers, self._closers = self._closers, []
        await _close_all(closers)

    # -- helpers ----------------------------------------------------------------------------------

    def now_ms(self) -> int:
        return to_millis(self.clock.now())

    def wake_redelivery(self, due_ms: int) -> None:
        """An action set a due time: wake the local redelivery loop if it would sleep past it."""
        if self.tracker is not None:
            self.tracker.redeliverer.notify_due(due_ms)

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
        if self.tracker is not None:
            health = await self.tracker.health()
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


async def _close_all(closers: list[Closer]) -> None:
    for close in reversed(closers):
        with contextlib.suppress(Exception):
            await close()
