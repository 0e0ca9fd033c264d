"""The FastAPI application factory.

``create_app(context)`` builds the app around an :class:`ApiContext` (the ``kmq-tracker run``
process passes the context ``tracker.runtime`` made for its engine);
``create_app_from_factory(settings, factory)`` builds one that creates its context at startup
and closes it at shutdown, which is how ``tracker.runtime.create_standalone_app`` serves the
API alone. Nothing lives at module level: every app has its own settings, clients and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import Scope

from tracker import __version__
from tracker.metrics import Metrics
from tracker.settings import TrackerSettings

from .console import install_console
from .context import ApiContext
from .http_errors import CatchAllMiddleware, install_error_handlers
from .middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from .routes import dlq, markers, messages, ops, redrive, topics

log = logging.getLogger("api")

RATE_SAMPLE_SECONDS = 10.0

DESCRIPTION = """\
Admin API of kmq-tracker: inspect tracked messages and act on them, browse dead letters and
redrive them, per-topic statistics, and the sidecar endpoint that writes markers for consumers
without a Kafka producer.

**Authentication**: `Authorization: Bearer <token>`. The admin token (`KMQ_API_TOKEN`) is
needed for every POST; the optional read token (`KMQ_API_READ_TOKEN`) for GETs only. Reads are
open only when no token at all is configured; mutations then answer 503.

**Errors** are JSON `{"error": "<code>", "detail": "<what went wrong>"}`.

**Message ids** are `<group>/<topic>/<partition>/<offset>` of the message's origin (its first
delivery), as is or percent-encoded in paths. Times are ISO 8601 UTC.
"""

TAGS = [
    {"name": "messages", "description": "Tracked messages and operator actions on them."},
    {"name": "topics", "description": "Per-topic statistics and effective policy."},
    {"name": "dead letters", "description": "Messages published to dead-letter topics."},
    {"name": "redrive", "description": "Republishing dead letters, rate-limited."},
    {"name": "sidecar", "description": "Markers over HTTP."},
    {"name": "ops", "description": "Health, readiness, Prometheus metrics (no token)."},
]

ContextFactory = Callable[[], Awaitable[ApiContext]]


def _metrics_of(scope: Scope) -> Metrics | None:
    app = scope.get("app")
    context = getattr(getattr(app, "state", None), "context", None)
    return context.metrics if isinstance(context, ApiContext) else None


def _build(
    settings: TrackerSettings,
    context: ApiContext | None,
    factory: ContextFactory | None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if factory is not None:
            app.state.context = await factory()
        current: ApiContext = app.state.context
        stopping = asyncio.Event()
        tasks = [asyncio.create_task(_sample_rates(current, stopping), name="kmq-api-rates")]
        if current.run_redrive and current.redrive is not None:
            tasks.append(asyncio.create_task(current.redrive.run(stopping), name="kmq-api-redrive"))
        try:
            yield
        finally:
            stopping.set()
            for task in tasks:
                try:
                    await asyncio.wait_for(task, 30)
                except TimeoutError:
                    log.warning("task %s did not stop in time", task.get_name())
                except Exception:
                    log.exception("task %s failed", task.get_name())
            if factory is not None:
                await current.close()

    app = FastAPI(
        title="kmq-tracker admin API",
        version=__version__,
        description=DESCRIPTION,
        openapi_tags=TAGS,
        lifespan=lifespan,
        redoc_url=None,
    )
    if context is not None:
        app.state.context = context
    install_error_handlers(app)
    for module in (messages, topics, dlq, redrive, markers, ops):
        app.include_router(module.router)
    if settings.console_enabled:
        install_console(app)
    # Added innermost first: CORS, then the body limit, request metrics, the catch-all.
    if settings.api_cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.api_cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
        )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=_metrics_of)
    app.add_middleware(CatchAllMiddleware)
    return app


async def _sample_rates(context: ApiContext, stopping: asyncio.Event) -> None:
    """Keep the redelivery-rate history going even when nobody asks for statistics."""
    while not stopping.is_set():
        context.rates.sample()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), RATE_SAMPLE_SECONDS)


def create_app(context: ApiContext) -> FastAPI:
    """The API around an existing context (the caller closes the context)."""
    return _build(context.settings, context, None)


def create_app_from_factory(settings: TrackerSettings, factory: ContextFactory) -> FastAPI:
    """The API with a context of its own: made by ``factory`` at startup, closed at shutdown."""
    return _build(settings, None, factory)
