"""Operator actions on one tracked message: redeliver, ack, extend, dead-letter (POST).

Apart from the reads (:mod:`api.routes.messages`) because these are the resource's writes:
they need the admin token, take an ``Idempotency-Key``, leave an audit row, count in the
metrics and may wake redelivery. The routes have no prefix of their own: the
``/v1/messages`` router includes them, after its reads, so the resource keeps one router.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from tracker.domain.actions import ActionKind as StoreAction
from tracker.domain.actions import ActionOutcome, ActionRequest
from tracker.store.store_errors import IdempotencyConflict

from ..context import ApiContext
from ..deps import Admin, Context, IdempotencyKey
from ..http_errors import ApiError
from ..message_id_param import MessageIdPath
from ..message_ids import format_message_id, parse_message_id
from ..models import ActionBody, ActionResponse, ExtendBody
from ..security import Principal
from ..views import action_view, message_summary
from . import WRITE_ERRORS, errors

#: Included by ``api.routes.messages.router``, which gives the prefix and the tag.
router = APIRouter()


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
