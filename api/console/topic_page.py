"""The console's page of one topic: its statistics and its messages, filtered, in pages.

One area of the console's pages (see :mod:`api.console.pages`): the listing is the API's
(:func:`api.routes.messages.find_messages`), its filters come from a form, as text.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, Response

from tracker.clock import from_millis
from tracker.domain.entries import State
from tracker.store.inspection import EntryFilter, EntryOrder

from ..models import TEXT_PATTERN, TOPIC_PATTERN, MessageState
from ..routes import messages, topics
from .guard import ConsoleError, ConsoleRoute, Context, Session
from .page_support import PAGE_SIZE, reader
from .render import render

#: Included by ``api.console.pages.router``, which gives the ``/console`` prefix.
router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)


@router.get("/topics/{topic}")
async def topic_page(
    *,
    request: Request,
    context: Context,
    session: Session,
    topic: Annotated[str, Path(pattern=TOPIC_PATTERN)],
    state: Annotated[list[MessageState] | None, Query()] = None,
    group: Annotated[str | None, Query(max_length=255, pattern=TEXT_PATTERN)] = None,
    min_attempt: Annotated[str | None, Query(max_length=10)] = None,
    min_age_minutes: Annotated[str | None, Query(max_length=10)] = None,
    seen_before_ms: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None,
    order: Annotated[Literal["key", "due"], Query()] = "key",
    cursor: Annotated[str | None, Query(max_length=4000, pattern=r"^[A-Za-z0-9_-]+$")] = None,
) -> Response:
    now_ms = context.now_ms()
    stats = await topics.get_topic(
        topic=topic, context=context, _=reader(session), window_minutes=60
    )
    attempt = _whole(min_attempt, "attempt", 1, 0xFFFF)
    age = _whole(min_age_minutes, "age in minutes", 0, 10_000_000)
    # "Older than n minutes" is turned into a time once, when the filter is submitted: the
    # next pages and the refreshes carry that time, so that the listing (and its cursor)
    # stays the same one.
    if seen_before_ms is None and age:
        seen_before_ms = now_ms - age * 60_000
    flt = EntryFilter(
        topic=topic,
        states=tuple(State(s.value) for s in state or ()),
        group=group or None,
        min_attempt=attempt,
        seen_before_ms=seen_before_ms,
    )
    page = await messages.find_messages(
        context, flt, EntryOrder(order), limit=PAGE_SIZE, cursor=cursor
    )
    params = {
        "state": [s.value for s in state or ()],
        "group": group,
        "min_attempt": attempt,
        "min_age_minutes": age,
        "seen_before_ms": seen_before_ms,
        "order": order,
    }
    return render(
        request,
        "topic.html",
        session,
        nav="overview",
        topic=topic,
        stats=stats,
        page=page,
        params=params,
        states=[s.value for s in MessageState],
        now=from_millis(now_ms),
        cursor=cursor,
    )


def _whole(text: str | None, what: str, low: int, high: int) -> int | None:
    """A whole number from a form field; an empty field is no filter."""
    if text is None or not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConsoleError(422, f"the {what} must be a whole number, not {text!r}") from None
    if not low <= value <= high:
        raise ConsoleError(422, f"the {what} must be between {low} and {high}")
    return value
