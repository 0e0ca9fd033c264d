"""The composition root: the one place that builds the engine and the API and joins them.

Everything else receives its parts: the engine (``tracker.engine.process.Tracker``) runs on
the store and Kafka clients built here and knows nothing of the API; the API
(``api.context.ApiContext``) speaks to the engine only through ``tracker.ports``. Here:

* :func:`create_tracker`: a tracker replica on the connections of :func:`engine_connections`,
  serving the API beside its engine when ``api_enabled`` (what ``kmq-tracker run`` starts);
* :func:`engine_api_context`: the API's context for a tracker's engine, sharing its store,
  producer, originals reader, clock and metrics;
* :func:`standalone_api_context`, :func:`create_standalone_app` and :func:`serve_standalone`:
  the API alone, with a store and Kafka clients of its own, running redrive jobs itself
  (``kmq-tracker api``, or ``uvicorn --factory tracker.runtime:create_standalone_app``).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Coroutine
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from fastapi import FastAPI

from api.app import create_app, create_app_from_factory
from api.context import ApiContext, Closer, close_all, kafka_reads
from api.server import bind_http, serve
from tracker.client.marker_sink import KafkaMarkerSink
from tracker.clock import Clock, SystemClock, to_millis
from tracker.engine.connections import (
    EngineConnections,
    markers_fetch_options,
    markers_poll_wait,
)
from tracker.engine.process import EventHook, Tracker
from tracker.engine.redrive_runner import RedriveRunner
from tracker.kafka.client_security import kafka_client_options
from tracker.kafka.originals import OriginalsReader
from tracker.kafka.scan import PartitionScanner
from tracker.metrics import Metrics
from tracker.settings import TrackerSettings
from tracker.settings_loading import load_settings
from tracker.store import Store
from tracker.store.migrate import check_schema, database_errors, upgrade
from tracker.store.redrive_leases import RedriveLeaseStore
from tracker.store.topic_binding import bind_markers_topic


def create_tracker(
    settings: TrackerSettings,
    *,
    clock: Clock | None = None,
    metrics: Metrics | None = None,
    on_event: EventHook | None = None,
) -> Tracker:
    """One tracker replica; with ``api_enabled``, the API is served from the same process."""
    services = [ApiService(settings)] if settings.api_enabled else []
    return Tracker(
        settings,
        engine_connections(settings),
        clock=clock,
        metrics=metrics,
        on_event=on_event,
        services=services,
    )


def engine_connections(settings: TrackerSettings) -> EngineConnections:
    """The store and Kafka clients of one replica, not yet started (the tracker starts them)."""
    config = kafka_client_options(settings)
    bootstrap = settings.kafka_bootstrap_servers
    fetch = markers_fetch_options(settings, config)
    return EngineConnections(
        store=Store.from_url(settings.database_url),
        markers_consumer=AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=settings.tracker_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            client_id=f"kmq-tracker-{settings.replica_id}",
            **fetch,
        ),
        producer=_producer(settings, config),
        originals=OriginalsReader(bootstrap, client_config=config),
        scanner=PartitionScanner(bootstrap, client_config=config),
        client_config=config,
        markers_poll_wait=markers_poll_wait(fetch),
    )


def _producer(settings: TrackerSettings, config: dict[str, Any]) -> AIOKafkaProducer:
    """The producer of copies, dead letters and markers: ``acks=all``, as the KMQ invariant
    needs, with a short linger and large batches so that a round's copies (or a poll's
    refused markers) go out in few requests."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        acks="all",
        linger_ms=2,
        **{"max_batch_size": settings.kafka_producer_batch_bytes, **config},
    )


class ApiService:
    """The API as a service of the tracker's process (a ``TrackerService``)."""

    name = "api"

    def __init__(self, settings: TrackerSettings) -> None:
        self._settings = settings
        self._socket: socket.socket | None = None
        self._context: ApiContext | None = None

    def bind(self) -> None:
        self._socket = bind_http(self._settings.http_host, self._settings.http_port)

    def serve(self, engine: Tracker, stopping: asyncio.Event) -> Coroutine[Any, Any, None]:
        self._context = engine_api_context(engine)
        return serve(
            create_app(self._context),
            self._settings.http_host,
            self._settings.http_port,
            stopping,
            sockets=[self._socket] if self._socket is not None else None,
        )

    async def close(self) -> None:
        if self._socket is not None:
            self._socket.close()  # uvicorn closes it once it served; not if never served
            self._socket = None
        if self._context is not None:
            await self._context.close()
            self._context = None


def engine_api_context(tracker: Tracker) -> ApiContext:
    """The API's context in the tracker's process: it shares the engine's clients (call
    after ``tracker.start()``; close it before the tracker)."""
    settings = tracker.settings
    producer: Any = tracker.producer
    reads = kafka_reads(settings)
    context = ApiContext(
        settings=settings,
        store=tracker.store,
        metrics=tracker.metrics,
        markers=KafkaMarkerSink(producer, settings.markers_topic),
        producer=producer,
        originals=tracker.originals,
        # The API's own metadata reads (a redrive job's target topic) share the views'
        # scanner: the tracker's is the engine's, and one more client would do nothing more.
        scanner=reads.scanner,
        clock=tracker.clock,
        reads=reads,
        engine=tracker,
        redrive=tracker.redrive,
    )
    context.close_with(reads.close)
    return context


async def standalone_api_context(
    settings: TrackerSettings,
    *,
    clock: Clock | None = None,
    metrics: Metrics | None = None,
    run_redrive: bool = True,
) -> ApiContext:
    """The API's context when it runs alone: a store and Kafka clients of its own, and a
    redrive runner (run by the app when ``run_redrive``). Close it with ``close()``.

    Refuses an outdated schema (``migrate_on_start`` migrates first), like the tracker.
    """
    closers: list[Closer] = []
    try:
        store = Store.from_url(settings.database_url)
        closers.append(store.close)
        clock = clock or SystemClock()
        async with database_errors(store.engine):
            if settings.migrate_on_start:
                await upgrade(store.engine)
            await check_schema(store.engine)
            await bind_markers_topic(
                store,
                settings.markers_topic,
                by=f"{settings.replica_id}/api",
                now_ms=to_millis(clock.now()),
            )
        config = kafka_client_options(settings)
        producer = _producer(settings, config)
        await producer.start()
        closers.append(producer.stop)
        originals = OriginalsReader(settings.kafka_bootstrap_servers, client_config=config)
        await originals.start()
        closers.append(originals.stop)
        scanner = PartitionScanner(settings.kafka_bootstrap_servers, client_config=config)
        closers.append(scanner.stop)
        reads = kafka_reads(settings)
        closers.append(reads.close)
    except BaseException:
        await close_all(closers)
        raise
    metrics = metrics or Metrics()
    redrive = RedriveRunner(
        jobs=RedriveLeaseStore(store, settings.markers_topic),
        producer=producer,
        originals=originals,
        scanner=scanner,
        owner=f"{settings.replica_id}/api",
        metrics=metrics,
        lease_seconds=settings.redrive_lease.total_seconds(),
        clock=clock,
    )
    context = ApiContext(
        settings=settings,
        store=store,
        metrics=metrics,
        markers=KafkaMarkerSink(producer, settings.markers_topic),
        producer=producer,
        originals=originals,
        scanner=scanner,
        clock=clock,
        reads=reads,
        redrive=redrive,
        run_redrive=run_redrive,
    )
    for closer in closers:
        context.close_with(closer)
    return context


def create_standalone_app(settings: TrackerSettings | None = None) -> FastAPI:
    """The API alone: its context (store, Kafka clients, redrive runner) lives with the app."""
    resolved = settings or load_settings()

    async def factory() -> ApiContext:
        return await standalone_api_context(resolved)

    return create_app_from_factory(resolved, factory)


async def serve_standalone(settings: TrackerSettings, stopping: asyncio.Event) -> None:
    """Serve the API alone (its own store and Kafka clients) on the configured address.

    The context is built before the server starts, not in the app's startup: a database that
    cannot be used, or that serves another markers topic, then fails ``kmq-tracker api`` in one
    line, as it fails ``kmq-tracker run``, instead of in a traceback of the server's startup.
    """
    context = await standalone_api_context(settings)

    async def factory() -> ApiContext:
        return context

    try:
        app = create_app_from_factory(settings, factory)
        await serve(app, settings.http_host, settings.http_port, stopping)
    finally:
        await context.close()  # the app closes it at shutdown; not if it never started
