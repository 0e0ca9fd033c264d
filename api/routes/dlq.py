"""Dead letters: browse with filters (newest first), one with its DLQ record's payload."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from pydantic import AwareDatetime

from tracker.clock import to_millis
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.store.admin_reads import DeadLetterFilter

from ..context import not_served
from ..deps import Context, Cursor, Limit, Reader
from ..http_errors import ApiError
from ..message_ids import decode_cursor, encode_cursor, fingerprint
from ..models import TEXT_PATTERN, TOPIC_PATTERN, DeadLetterDetail, DeadLetterPage
from ..previews import payload_preview
from ..views import dead_letter_view, position
from . import READ_ERRORS, errors

router = APIRouter(prefix="/v1/dlq", tags=["dead letters"])

MAX_ID = 2**63 - 1


@router.get(
    "",
    response_model=DeadLetterPage,
    summary="Browse dead letters",
    responses=errors(*READ_ERRORS),
)
async def list_dead_letters(
    *,
    context: Context,
    _: Reader,
    topic: Annotated[str | None, Query(pattern=TOPIC_PATTERN, description="Origin topic.")] = None,
    group: Annotated[str | None, Query(min_length=1, max_length=255, pattern=TEXT_PATTERN)] = None,
    reason: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=1000,
            pattern=TEXT_PATTERN,
            description="Substring of the reason, case-insensitive.",
        ),
    ] = None,
    key: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=4096,
            pattern=TEXT_PATTERN,
            description="The record key, exactly (as UTF-8 text).",
        ),
    ] = None,
    since: Annotated[AwareDatetime | None, Query(description="Dead-lettered at or after.")] = None,
    until: Annotated[AwareDatetime | None, Query(description="Dead-lettered before.")] = None,
    redriven: Annotated[
        bool | None, Query(description="Only redriven (true) or not yet redriven (false).")
    ] = None,
    limit: Limit = 100,
    cursor: Cursor = None,
) -> DeadLetterPage:
    """Dead letters matching every filter given, newest first, in pages (keyset on the id:
    rows that exist when the listing starts are returned exactly once)."""
    flt = DeadLetterFilter(
        topic=topic,
        group=group,
        reason=reason,
        key=key,
        since_ms=to_millis(since) if since is not None else None,
        until_ms=to_millis(until) if until is not None else None,
        redriven=redriven,
    )
    query = fingerprint(flt.to_json())
    before = decode_cursor(cursor, query, (int,))[0] if cursor else None
    rows = await context.queries.list_dead_letters(flt, before_id=before, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return DeadLetterPage(
        items=[dead_letter_view(row) for row in rows],
        next_cursor=encode_cursor([rows[-1]["id"]], query) if more and rows else None,
        limit=limit,
    )


@router.get(
    "/{dead_letter_id}",
    response_model=DeadLetterDetail,
    summary="One dead letter with a preview of its DLQ record",
    responses=errors(*READ_ERRORS, 404),
)
async def get_dead_letter(
    dead_letter_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    context: Context,
    _: Reader,
    preview_bytes: Annotated[
        int | None,
        Query(ge=0, le=1_048_576, description="Payload preview cap (default: the setting)."),
    ] = None,
) -> DeadLetterDetail:
    """The dead letter, and the record on the DLQ topic (with its ``kmq-dlq-*`` headers).

    The record is read from Kafka within ``api_kafka_read_timeout``: past it, the answer has
    the dead letter as the database has it, and ``payload_error`` says why there is no preview.
    """
    row = await context.queries.get_dead_letter(dead_letter_id)
    if row is None:
        raise ApiError(404, f"no dead letter {dead_letter_id}")
    target = MessageId(row["dlq_topic"], row["dlq_partition"], row["dlq_offset"])
    cap = context.settings.api_payload_preview_bytes if preview_bytes is None else preview_bytes
    payload = None
    payload_error = None
    try:
        found = await context.reads.fetch(target, context.reads.deadline())
    except OriginalsUnavailable as exc:
        payload_error = not_served(exc)
    else:
        if isinstance(found, OriginalRecord):
            payload = payload_preview(position(*target), found, cap)
        elif isinstance(found, Missing):
            payload_error = f"DLQ record {target} is gone: {found.reason}"
    return DeadLetterDetail(
        dead_letter=dead_letter_view(row), payload=payload, payload_error=payload_error
    )
