"""Tracked messages: listing with filters and cursor pagination, and one message (GET).

This is the ``/v1/messages`` resource's one router: it also carries the operator actions
(:mod:`api.routes.message_actions`, included after the reads). What Kafka serves of a message
(its payload and marker history) is read by :mod:`api.message_kafka_reads`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import AwareDatetime

from tracker.clock import to_millis
from tracker.domain.actions import ActionKind as StoreAction
from tracker.domain.actions import ActionOutcome
from tracker.domain.entries import State
from tracker.store.admin_reads import EntryView
from tracker.store.inspection import EntryFilter, EntryOrder

from ..context import ApiContext
from ..deps import Context, Cursor, Limit, Reader
from ..http_errors import ApiError
from ..message_id_param import MessageIdPath
from ..message_ids import (
    decode_cursor,
    encode_cursor,
    fingerprint,
    format_message_id,
    parse_message_id,
)
from ..message_kafka_reads import fetch_history, fetch_preview, not_asked
from ..message_page_json import message_page_json
from ..models import (
    TEXT_PATTERN,
    TOPIC_PATTERN,
    MessageDetail,
    MessagePage,
    MessageState,
    MessageStatus,
)
from ..views import (
    action_view,
    dead_letter_view,
    message_summary,
    message_summary_data,
    position,
)
from . import READ_ERRORS, errors, message_actions

router = APIRouter(prefix="/v1/messages", tags=["messages"])


def _cursor_shape(order: EntryOrder) -> tuple[type[int] | type[str], ...]:
    """What a listing's cursor holds: the sort key of its last row."""
    key: tuple[type[int] | type[str], ...] = (str, str, int, int)
    return (int, *key) if order is EntryOrder.DUE else key


@router.get(
    "",
    response_model=MessagePage,
    summary="List tracked messages",
    responses=errors(*READ_ERRORS),
)
async def list_messages(
    *,
    context: Context,
    _: Reader,
    topic: Annotated[str | None, Query(pattern=TOPIC_PATTERN, description="Origin topic.")] = None,
    partition: Annotated[
        int | None, Query(ge=0, le=2**31 - 1, description="Origin partition.")
    ] = None,
    state: Annotated[
        list[MessageState] | None,
        Query(description="One or more states (repeat the parameter)."),
    ] = None,
    group: Annotated[
        str | None,
        Query(min_length=1, max_length=255, pattern=TEXT_PATTERN, description="Consumer group."),
    ] = None,
    due_before: Annotated[
        AwareDatetime | None, Query(description="Due (deadline) strictly before.")
    ] = None,
    due_after: Annotated[AwareDatetime | None, Query(description="Due at or after.")] = None,
    min_attempt: Annotated[
        int | None, Query(ge=1, le=0xFFFF, description="Attempt at least.")
    ] = None,
    seen_before: Annotated[
        AwareDatetime | None,
        Query(description="First delivered strictly before (at least this old)."),
    ] = None,
    order: Annotated[
        Literal["key", "due"],
        Query(
            description="`key`: by id, stable under any concurrent change; `due`: by due "
            "time (lost messages, which have none, are left out)."
        ),
    ] = "key",
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Response:
    """Tracked messages matching every filter given, in pages.

    Pagination is by keyset: rows that exist when the listing starts are returned exactly once
    whatever is inserted or removed meanwhile (with ``order=due``, as long as their due time
    does not change).
    """
    flt = EntryFilter(
        topic=topic,
        partition=partition,
        states=tuple(State(s.value) for s in state or ()),
        group=group,
        due_before_ms=to_millis(due_before) if due_before is not None else None,
        due_after_ms=to_millis(due_after) if due_after is not None else None,
        min_attempt=min_attempt,
        seen_before_ms=to_millis(seen_before) if seen_before is not None else None,
    )
    views, next_cursor = await _page(context, flt, EntryOrder(order), limit, cursor)
    body = message_page_json(views, context.now_ms(), next_cursor, limit)
    return Response(body, media_type="application/json")


async def find_messages(
    context: ApiContext, flt: EntryFilter, sort: EntryOrder, *, limit: int, cursor: str | None
) -> MessagePage:
    """One page of the listing as its model (the console's pages); ``cursor`` is the previous
    page's ``next_cursor``, valid only for the same filter and order."""
    views, next_cursor = await _page(context, flt, sort, limit, cursor)
    now_ms = context.now_ms()
    page = {
        "items": [message_summary_data(v, now_ms) for v in views],
        "next_cursor": next_cursor,
        "limit": limit,
    }
    return MessagePage.model_validate(page)


async def _page(
    context: ApiContext, flt: EntryFilter, sort: EntryOrder, limit: int, cursor: str | None
) -> tuple[list[EntryView], str | None]:
    """The entries of one page of the listing, and the cursor of the next (``None``: last)."""
    states = sorted(s.value for s in flt.states)
    shape: dict[str, Any] = {"f": [flt.topic, flt.partition, states, flt.group], "o": sort.value}
    shape["d"] = [flt.due_before_ms, flt.due_after_ms, flt.min_attempt]
    if flt.seen_before_ms is not None:
        shape["s"] = flt.seen_before_ms
    query = fingerprint(shape)
    after = decode_cursor(cursor, query, _cursor_shape(sort)) if cursor else None
    views = await context.queries.list_entries(flt, order=sort, after=after, limit=limit + 1)
    more = len(views) > limit
    views = views[:limit]
    next_cursor = None
    if more and views:
        last = views[-1].entry
        key: list[Any] = list(last.key)
        next_cursor = encode_cursor(
            [last.due_at_ms, *key] if sort is EntryOrder.DUE else key, query
        )
    return views, next_cursor


@router.get(
    "/{message_id:path}",
    response_model=MessageDetail,
    summary="One message: state, attempts, history, payload preview",
    responses=errors(*READ_ERRORS, 404),
)
async def get_message(
    message_id: MessageIdPath,
    context: Context,
    _: Reader,
    markers: Annotated[
        bool, Query(description="Search the markers topic for this message's markers.")
    ] = True,
    payload: Annotated[
        bool, Query(description="Read the payload preview (from Kafka, or the store's copy).")
    ] = True,
    preview_bytes: Annotated[
        int | None,
        Query(ge=0, le=1_048_576, description="Payload preview cap (default: the setting)."),
    ] = None,
) -> MessageDetail:
    """Everything known about one message, tracked or not anymore.

    ``status`` is the tracked state, or ``dead_lettered`` / ``acked`` (through this API) for a
    message the tracker no longer holds. The marker history is searched in the last
    ``api_marker_history_scan`` records of the message's markers partition. The payload and
    the marker history are read from Kafka concurrently, within ``api_kafka_read_timeout``:
    past it, the answer has what the database has, and ``payload_error`` / ``markers_error``
    say what Kafka did not serve. ``markers=false&payload=false`` reads the database only
    (one transaction): the cheap way to poll a message's status.
    """
    key = parse_message_id(message_id)
    record = await context.queries.message_record(key)
    view, actions, dead = record.view, record.actions, record.dead_letters
    acked_at = [
        a.created_ms
        for a in actions
        if a.action is StoreAction.ACK and a.outcome is ActionOutcome.APPLIED
    ]
    if view is None and not dead and not acked_at:
        raise ApiError(404, f"no message {format_message_id(key)} is tracked or dead-lettered")
    if view is not None:
        status = MessageStatus(view.entry.state.value)
    elif acked_at and (not dead or max(acked_at) >= dead[-1]["dead_lettered_ms"]):
        status = MessageStatus.ACKED
    else:
        status = MessageStatus.DEAD_LETTERED
    settings = context.settings
    cap = settings.api_payload_preview_bytes if preview_bytes is None else preview_bytes
    # One deadline for both reads, run side by side: the request waits for Kafka once.
    deadline = context.reads.deadline()
    previewing = fetch_preview(context, view, dead, cap, deadline) if payload else not_asked()
    tail = context.reads.marker_tail  # None: api_marker_history_scan is 0
    searching = (
        fetch_history(context, tail, key, view, deadline)
        if markers and tail is not None
        else not_asked()
    )
    (preview, preview_error), (history, history_error) = await asyncio.gather(previewing, searching)
    return MessageDetail(
        id=format_message_id(key),
        group=key[0],
        origin=position(key[1], key[2], key[3]),
        status=status,
        entry=message_summary(view, context.now_ms()) if view is not None else None,
        actions=[action_view(a) for a in actions],
        dead_letters=[dead_letter_view(row) for row in dead],
        markers=history,
        markers_error=history_error,
        payload=preview,
        payload_error=preview_error,
    )


# The operator actions (POST), after the reads: the same routes, in the same order, as when
# they were defined here.
router.include_router(message_actions.router)
