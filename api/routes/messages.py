"""Tracked messages: listing with filters and cursor pagination, one message, actions."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Path, Query, Response
from pydantic import AwareDatetime

from tracker.clock import to_millis
from tracker.domain.actions import ActionKind as StoreAction
from tracker.domain.actions import ActionOutcome, ActionRequest
from tracker.domain.entries import EntryKey, State
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.partitioning import markers_partition
from tracker.store.admin_reads import EntryView
from tracker.store.inspection import EntryFilter, EntryOrder
from tracker.store.store_errors import IdempotencyConflict

from ..context import ApiContext, not_served
from ..deps import Admin, Context, Cursor, IdempotencyKey, Limit, Reader
from ..http_errors import ApiError
from ..marker_tail import MarkerTail
from ..message_ids import (
    decode_cursor,
    encode_cursor,
    fingerprint,
    format_message_id,
    parse_message_id,
)
from ..models import (
    TEXT_PATTERN,
    TOPIC_PATTERN,
    ActionBody,
    ActionResponse,
    ExtendBody,
    MarkerHistory,
    MessageDetail,
    MessagePage,
    MessageState,
    MessageStatus,
    PayloadPreview,
)
from ..previews import marker_history, payload_preview
from ..security import Principal
from ..views import (
    action_view,
    dead_letter_view,
    json_response,
    message_summary,
    message_summary_data,
    position,
)
from . import READ_ERRORS, WRITE_ERRORS, errors

router = APIRouter(prefix="/v1/messages", tags=["messages"])

MessageIdPath = Annotated[
    str,
    Path(
        description="`<group>/<topic>/<partition>/<offset>` of the origin, as is or "
        "percent-encoded.",
        examples=["billing/orders/3/42"],
    ),
]


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
    page = await find_messages(context, flt, EntryOrder(order), limit=limit, cursor=cursor)
    return json_response(page)


async def find_messages(
    context: ApiContext, flt: EntryFilter, sort: EntryOrder, *, limit: int, cursor: str | None
) -> MessagePage:
    """One page of the listing (the API's and the console's): ``cursor`` is the previous
    page's ``next_cursor``, valid only for the same filter and order."""
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
    now_ms = context.now_ms()
    page = {
        "items": [message_summary_data(v, now_ms) for v in views],
        "next_cursor": next_cursor,
        "limit": limit,
    }
    return MessagePage.model_validate(page)


async def _preview(
    context: ApiContext,
    view: EntryView | None,
    dead: list[dict[str, Any]],
    cap: int,
    deadline: float,
) -> tuple[PayloadPreview | None, str | None]:
    """The current copy's payload (or the store's copy), else the latest DLQ record's.

    Kafka is read within ``deadline`` (see :class:`~api.context.KafkaReads`); past it, the
    preview is missing and the error says so.
    """
    if view is not None:
        e = view.entry
        if view.payload_stored:
            stored = await context.queries.stored_payload(e.key)
            if stored is not None:
                record = OriginalRecord(
                    stored.key, stored.value, stored.headers, stored.timestamp_ms
                )
                where = position(e.copy_topic, e.copy_partition, e.copy_offset)
                return payload_preview(where, record, cap, source="store"), None
        target = MessageId(e.copy_topic, e.copy_partition, e.copy_offset)
    elif dead:
        row = dead[-1]
        target = MessageId(row["dlq_topic"], row["dlq_partition"], row["dlq_offset"])
    else:
        return None, "no record to show"
    try:
        result = await context.reads.fetch(target, deadline)
    except OriginalsUnavailable as exc:
        return None, not_served(exc)
    if isinstance(result, OriginalRecord):
        return payload_preview(position(*target), result, cap), None
    if isinstance(result, Missing):
        return None, f"record {target} is gone: {result.reason}"
    return None, f"record {target} could not be read"


async def _not_asked() -> tuple[None, None]:
    """A Kafka read the request did not ask for: nothing, and no error."""
    return None, None


async def _history(
    context: ApiContext, tail: MarkerTail, key: EntryKey, view: EntryView | None, deadline: float
) -> tuple[MarkerHistory | None, str | None]:
    """The message's marker history, read within ``deadline``; else why not."""
    settings = context.settings
    scanner = context.reads.scanner
    # Known from the entry, or computed (from the partition count) like a writer does.
    known = view.entry.markers_partition if view is not None else None

    async def read() -> MarkerHistory:
        partition = known
        if partition is None:
            topic = settings.markers_topic
            total = (await scanner.partition_counts([topic])).get(topic)
            if not total:
                raise OriginalsUnavailable(f"the markers topic {topic!r} does not exist")
            partition = markers_partition(key[1], key[2], total)
        return await marker_history(tail, partition, key)

    try:
        return await context.reads.history.run(key, read, deadline), None
    except OriginalsUnavailable as exc:
        return None, f"marker history unavailable: {exc}"


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
    previewing = _preview(context, view, dead, cap, deadline) if payload else _not_asked()
    tail = context.reads.marker_tail  # None: api_marker_history_scan is 0
    searching = (
        _history(context, tail, key, view, deadline)
        if markers and tail is not None
        else _not_asked()
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


async def _act(
    *,
    context: ApiContext,
    principal: Principal,
    message_id: str,
    action: StoreAction,
    body: ActionBody | None,
    idempotency_key: str | None,
    extend_ms: int | None = None,
) -> ActionResponse:
    key = parse_message_id(message_id)
    request = ActionRequest(
        key=key,
        action=action,
        actor=principal.name,
        reason=body.reason if body is not None else "",
        extend_ms=extend_ms,
        idempotency_key=idempotency_key,
    )
    try:
        record = await context.actions.apply_action(request, context.now_ms())
    except IdempotencyConflict as exc:
        raise ApiError(409, str(exc), error="idempotency_conflict") from None
    if not record.replayed:
        context.metrics.api_actions.labels(action.value, record.outcome.value).inc()
    if record.outcome is ActionOutcome.NOT_FOUND:
        raise ApiError(404, f"message {format_message_id(key)}: {record.detail}")
    if record.outcome is ActionOutcome.CONFLICT:
        raise ApiError(
            409,
            f"cannot {action.value.replace('_', '-')} {format_message_id(key)}: {record.detail}",
        )
    if (
        record.outcome is ActionOutcome.APPLIED
        and record.due_at_ms is not None
        and not record.replayed
    ):
        context.wake_redelivery(record.due_at_ms)
    view = await context.queries.get_entry(key)
    return ActionResponse(
        action=action_view(record),
        message=message_summary(view, context.now_ms()) if view is not None else None,
        replayed=record.replayed,
    )


ACTION_ERRORS = errors(*WRITE_ERRORS, 404, 409)
OptionalBody = Annotated[ActionBody | None, Body()]


@router.post(
    "/{message_id:path}/redeliver",
    response_model=ActionResponse,
    summary="Redeliver now",
    responses=ACTION_ERRORS,
)
async def redeliver(
    message_id: MessageIdPath,
    context: Context,
    principal: Admin,
    idempotency_key: IdempotencyKey = None,
    body: OptionalBody = None,
) -> ActionResponse:
    """Make an in-flight or delayed message due now: the tracker republishes it at once (as
    the next attempt, or to the DLQ if that was its last). 409 for a rejected or lost one.
    Repeating it on a message that is already due changes nothing (``unchanged``)."""
    return await _act(
        context=context,
        principal=principal,
        message_id=message_id,
        action=StoreAction.REDELIVER,
        body=body,
        idempotency_key=idempotency_key,
    )


@router.post(
    "/{message_id:path}/ack",
    response_model=ActionResponse,
    summary="Acknowledge (cancel)",
    responses=ACTION_ERRORS,
)
async def ack(
    message_id: MessageIdPath,
    context: Context,
    principal: Admin,
    idempotency_key: IdempotencyKey = None,
    body: OptionalBody = None,
) -> ActionResponse:
    """Stop tracking the message, as if its consumer had acknowledged it: it will not be
    redelivered or dead-lettered. Acking it again answers 200 with ``unchanged``."""
    return await _act(
        context=context,
        principal=principal,
        message_id=message_id,
        action=StoreAction.ACK,
        body=body,
        idempotency_key=idempotency_key,
    )


@router.post(
    "/{message_id:path}/extend",
    response_model=ActionResponse,
    summary="Extend the processing lease",
    responses=ACTION_ERRORS,
)
async def extend(
    message_id: MessageIdPath,
    context: Context,
    principal: Admin,
    body: Annotated[ExtendBody, Body()],
    idempotency_key: IdempotencyKey = None,
) -> ActionResponse:
    """Set an in-flight message's deadline to now + ``by_ms``. 409 for other states."""
    return await _act(
        context=context,
        principal=principal,
        message_id=message_id,
        action=StoreAction.EXTEND,
        body=body,
        idempotency_key=idempotency_key,
        extend_ms=body.by_ms,
    )


@router.post(
    "/{message_id:path}/dead-letter",
    response_model=ActionResponse,
    summary="Dead-letter now",
    responses=ACTION_ERRORS,
)
async def dead_letter(
    message_id: MessageIdPath,
    context: Context,
    principal: Admin,
    idempotency_key: IdempotencyKey = None,
    body: OptionalBody = None,
) -> ActionResponse:
    """Send the message to its DLQ now, with the reason ``dead-lettered by <who>: <why>``.
    409 for a lost message; ``unchanged`` if it is already being dead-lettered."""
    return await _act(
        context=context,
        principal=principal,
        message_id=message_id,
        action=StoreAction.DEAD_LETTER,
        body=body,
        idempotency_key=idempotency_key,
    )
