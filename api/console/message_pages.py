"""The console's page of one message, and the fragment of it that Kafka serves.

One area of the console's pages (see :mod:`api.console.pages`): the page answers from the
database alone (the API's ``get_message`` without Kafka reads); its markers and payload come
after, from ``/console/message-records/...``, so that a slow Kafka never holds the page.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response

from tracker.store import StoreUnavailable

from ..http_errors import ApiError
from ..message_ids import parse_message_id
from ..routes import messages
from .guard import ConsoleRoute, Context, Session
from .message_timeline import timeline
from .page_support import form_token, reader
from .render import render

#: Included by ``api.console.pages.router``, which gives the ``/console`` prefix.
router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)


@router.get("/messages/{message_id:path}")
async def message_page(
    *,
    request: Request,
    context: Context,
    session: Session,
    message_id: str,
    confirm: Annotated[
        Literal["redeliver", "extend", "ack", "dead_letter", "requeue"] | None, Query()
    ] = None,
    done: Annotated[Literal["redeliver", "extend", "ack", "dead_letter"] | None, Query()] = None,
) -> Response:
    key = parse_message_id(message_id)
    # From the database alone: what Kafka serves (the markers, the payload) is loaded after
    # the page, by message_records; the page's refreshes swap the status section only.
    detail = await messages.get_message(
        message_id=message_id,
        context=context,
        _=reader(session),
        markers=False,
        payload=False,
        preview_bytes=None,
    )
    waiting = [d for d in detail.dead_letters if d.redriven_at is None]
    return render(
        request,
        "message.html",
        session,
        nav="overview",
        key=key,
        detail=detail,
        timeline=timeline(detail),
        confirm=confirm,
        done=done,
        requeue=waiting[-1] if waiting else None,
        policy=context.settings.policy_for(key[1]),
        token=form_token(),
    )


@router.get("/message-records/{message_id:path}")
async def message_records(
    request: Request, context: Context, session: Session, message_id: str
) -> Response:
    """The part of a message's page that Kafka serves: its history with the markers found in
    the markers topic, and its payload (a fragment that replaces the page's ``#kafka``).

    Its errors are fragments too: htmx does not swap an error response, which would leave the
    page saying "Reading ... from Kafka" for ever (the message acked meanwhile: a 404).
    """
    try:
        detail = await messages.get_message(
            message_id=message_id, context=context, _=reader(session), preview_bytes=None
        )
    except ApiError as exc:
        return render(request, "message_records.html", session, error=exc.detail)
    except StoreUnavailable as exc:
        error = f"the database is unavailable: {exc}"
        return render(request, "message_records.html", session, error=error)
    return render(
        request,
        "message_records.html",
        session,
        detail=detail,
        timeline=timeline(detail),
        error=None,
    )
