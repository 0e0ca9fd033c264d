"""Operations: liveness, readiness, Prometheus metrics. No token needed (for probes/scrapers).

``/metrics`` adds store-wide gauges computed at scrape time from cheap aggregate queries
(tracked messages by topic and state, oldest in-flight age, next delayed due, dead letters
waiting) to the process's own counters and histograms.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tracker.domain.entries import State
from tracker.store import StoreUnavailable

from ..context import ApiContext
from ..deps import Context
from ..models import Health, Readiness
from . import errors

log = logging.getLogger("api")

router = APIRouter(tags=["ops"])

#: Seconds the store-wide gauges may take at scrape time before they are skipped.
STORE_GAUGES_TIMEOUT = 5.0


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness: database and broker reachable, partitions assigned",
    responses={503: {"model": Readiness, "description": "Not ready (see the checks)."}},
)
async def readyz(context: Context) -> JSONResponse:
    readiness = await context.readiness()
    return JSONResponse(
        readiness.model_dump(mode="json"), status_code=200 if readiness.ready else 503
    )


async def refresh_store_gauges(context: ApiContext) -> None:
    """Set the store-wide gauges (clearing topics that disappeared)."""
    now_ms = context.now_ms()
    counts = await context.queries.topic_counts(since_ms=now_ms)
    m = context.metrics
    # No await from here on: a concurrent scrape never sees half-set gauges.
    for gauge in (m.tracked_messages, m.oldest_in_flight_age, m.next_delayed_due):
        gauge.clear()
    m.dead_letters_waiting.clear()
    for topic, c in counts.items():
        for state, value in (
            (State.IN_FLIGHT, c.in_flight),
            (State.DELAYED, c.delayed),
            (State.REJECTED, c.rejected),
            (State.LOST, c.lost),
        ):
            m.tracked_messages.labels(topic, state.value).set(value)
        if c.oldest_in_flight_first_seen_ms is not None:
            m.oldest_in_flight_age.labels(topic).set(
                max(0.0, (now_ms - c.oldest_in_flight_first_seen_ms) / 1000)
            )
        if c.next_delayed_due_ms is not None:
            m.next_delayed_due.labels(topic).set((c.next_delayed_due_ms - now_ms) / 1000)
        m.dead_letters_waiting.labels(topic).set(c.dead_letters_waiting)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "OK"},
        **errors(),
    },
)
async def metrics(context: Context) -> Response:
    try:
        async with asyncio.timeout(STORE_GAUGES_TIMEOUT):
            await refresh_store_gauges(context)
    except (StoreUnavailable, TimeoutError) as exc:
        # The process's own metrics are still worth a scrape.
        log.warning("metrics: store gauges not refreshed, database unavailable: %r", exc)
    context.rates.sample()
    return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)
