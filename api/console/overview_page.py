"""The console's overview page: the topics, due messages, the last hour's charts, health.

One area of the console's pages (see :mod:`api.console.pages`); the tracker health it shows
is read by :mod:`api.console.tracker_health`.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response

from tracker.clock import from_millis
from tracker.store.overview import OverviewQueries

from ..routes import topics
from .guard import ConsoleRoute, Context, Session
from .page_support import reader
from .render import render
from .tracker_health import read_health

#: Included by ``api.console.pages.router``, which gives the ``/console`` prefix.
router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)

#: Minutes of history in the overview's charts.
CHART_MINUTES = 60


@router.get("/")
async def overview(request: Request, context: Context, session: Session) -> Response:
    now_ms = context.now_ms()
    queries = OverviewQueries(context.store, context.settings.markers_topic)
    listing = await topics.list_topics(context=context, _=reader(session), window_minutes=60)
    figures = await queries.overview(now_ms, CHART_MINUTES)
    due, dead_per_minute = figures.due, figures.dead_letters_per_minute
    redeliveries_per_minute = context.rates.per_minute(CHART_MINUTES)
    start_s = now_ms // 1000 - CHART_MINUTES * 60
    series = {
        "t": [start_s + 60 * (i + 1) for i in range(CHART_MINUTES)],
        "redeliveries": redeliveries_per_minute,
        "dead_letters": dead_per_minute,
    }
    health = await read_health(context, figures.partitions)
    return render(
        request,
        "overview.html",
        session,
        nav="overview",
        topics=listing.items,
        due=due,
        series=json.dumps(series, separators=(",", ":")),
        dead_last_hour=sum(dead_per_minute),
        redeliveries_last_hour=sum(v for v in redeliveries_per_minute if v is not None),
        health=health,
        now=from_millis(now_ms),
    )
