"""The console's dead-letter pages: the dead letters, the redrive jobs, one job.

One area of the console's pages (see :mod:`api.console.pages`), built on the API's
``/v1/dlq`` and ``/v1/redrive-jobs`` handlers; the forms that start and cancel a job are in
:mod:`api.console.forms`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, Response

from tracker.store.admin_reads import DeadLetterFilter
from tracker.store.overview import OverviewQueries

from .. import models
from ..models import TEXT_PATTERN
from ..routes import dlq, redrive
from ..views import dead_letter_view
from .guard import ConsoleRoute, Context, Session
from .page_support import PAGE_SIZE, form_token, reader
from .render import render

#: Included by ``api.console.pages.router``, which gives the ``/console`` prefix.
router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)

#: The filter fields a dry run's "for real" form carries over (see job.html).
REAL_RUN_FIELDS = frozenset({"topic", "group", "reason", "key", "redriven"})


@router.get("/dlq")
async def dead_letters_page(
    *,
    request: Request,
    context: Context,
    session: Session,
    topic: Annotated[str | None, Query(pattern=r"^([a-zA-Z0-9._-]{1,249})?$")] = None,
    group: Annotated[str | None, Query(max_length=255, pattern=TEXT_PATTERN)] = None,
    reason: Annotated[str | None, Query(max_length=1000, pattern=TEXT_PATTERN)] = None,
    key: Annotated[str | None, Query(max_length=4096, pattern=TEXT_PATTERN)] = None,
    redriven: Annotated[Literal["", "yes", "no"], Query()] = "",
    cursor: Annotated[str | None, Query(max_length=4000, pattern=r"^[A-Za-z0-9_-]+$")] = None,
) -> Response:
    principal = reader(session)
    page = await dlq.list_dead_letters(
        context=context,
        _=principal,
        topic=topic or None,
        group=group or None,
        reason=reason or None,
        key=key or None,
        since=None,
        until=None,
        redriven={"yes": True, "no": False}.get(redriven),
        limit=PAGE_SIZE,
        cursor=cursor,
    )
    queries = OverviewQueries(context.store, context.settings.markers_topic)
    groups = await queries.reason_groups()
    jobs = await redrive.list_jobs(context=context, _=principal, state=None, limit=20, cursor=None)
    # The drop-downs name the topics that have dead letters: counter rows, not statistics.
    known = await queries.dead_letter_topics()
    if topic and topic not in known:
        known = sorted([*known, topic])
    params = {"topic": topic, "group": group, "reason": reason, "key": key, "redriven": redriven}
    return render(
        request,
        "dlq.html",
        session,
        nav="dlq",
        page=page,
        groups=groups,
        jobs=jobs.items,
        params=params,
        topics=known,
        cursor=cursor,
        token=form_token(),
        now=datetime.now(UTC),
    )


@router.get("/redrive")
async def jobs_page(request: Request, context: Context, session: Session) -> Response:
    """The recent redrive jobs (also what the dead-letter page refreshes its list from)."""
    jobs = await redrive.list_jobs(
        context=context, _=reader(session), state=None, limit=20, cursor=None
    )
    return render(request, "jobs.html", session, nav="dlq", jobs=jobs.items)


@router.get("/redrive/{job_id}")
async def job_page(
    *,
    request: Request,
    context: Context,
    session: Session,
    job_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
) -> Response:
    principal = reader(session)
    job = await redrive.get_job(job_id=job_id, context=context, _=principal)
    items = await redrive.list_items(
        job_id=job_id, context=context, _=principal, state=None, limit=PAGE_SIZE, cursor=None
    )
    would_move: list[models.DeadLetterView] = []
    selected = job.selection.get("filter")
    if job.dry_run and isinstance(selected, dict):
        known = {k: v for k, v in selected.items() if k in DeadLetterFilter.__slots__}
        flt = DeadLetterFilter(**known)
        rows = await context.queries.list_dead_letters(flt, limit=20)
        would_move = [dead_letter_view(row) for row in rows]
    return render(
        request,
        "job.html",
        session,
        nav="dlq",
        job=job,
        items=items.items,
        would_move=would_move,
        # The "for real" form carries topic, group, reason and key: offered only when that is
        # all the dry run selected (one made through the API with a time window is not).
        selected=selected
        if isinstance(selected, dict) and set(selected) <= REAL_RUN_FIELDS
        else None,
        token=form_token(),
    )
