"""The console's pages of parked markers: the recent ones, and one parked record.

One area of the console's pages (see :mod:`api.console.pages`); what is read from the
invalid-markers topic is in :mod:`api.console.parked`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from .guard import ConsoleError, ConsoleRoute, Context, Session
from .parked import parked_record, recent_parked
from .render import render

#: Included by ``api.console.pages.router``, which gives the ``/console`` prefix.
router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)


@router.get("/parked")
async def parked_page(request: Request, context: Context, session: Session) -> Response:
    listing = await recent_parked(context)
    return render(request, "parked.html", session, nav="parked", listing=listing)


@router.get("/parked/{partition}/{offset}")
async def parked_record_page(
    *,
    request: Request,
    context: Context,
    session: Session,
    partition: Annotated[int, Path(ge=0, le=2**31 - 1)],
    offset: Annotated[int, Path(ge=0, le=2**63 - 1)],
) -> Response:
    record = await parked_record(context, partition, offset)
    if record is None:
        raise ConsoleError(404, f"no parked record at {partition}/{offset}")
    return render(request, "parked_record.html", session, nav="parked", record=record)
