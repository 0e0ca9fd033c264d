"""Redrive jobs: create (by filter or ids; dry run counts only), follow, list items, cancel.

The work is done by a :class:`tracker.engine.redrive_runner.RedriveRunner` (in the tracker process,
or in the standalone API app); see that module for how a job survives restarts without ever
republishing a dead letter twice.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Response

from tracker.clock import from_millis, to_millis
from tracker.domain.jobs import ItemState, JobState
from tracker.store.admin_reads import DeadLetterFilter
from tracker.store.redrive_jobs import RedriveSpec
from tracker.store.store_errors import IdempotencyConflict, JobNotCancellable, UnknownDeadLetters

from .. import models
from ..deps import Admin, Context, Cursor, IdempotencyKey, Limit, Reader
from ..http_errors import ApiError
from ..message_ids import decode_cursor, encode_cursor, fingerprint
from ..views import job_view, position
from . import READ_ERRORS, WRITE_ERRORS, errors

router = APIRouter(prefix="/v1/redrive-jobs", tags=["redrive"])

MAX_ID = 2**63 - 1
JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="Redrive job id.")]


@router.post(
    "",
    response_model=models.RedriveJobView,
    status_code=201,
    summary="Create a redrive job",
    responses={
        200: {
            "description": "Replayed: the job an earlier request with the same "
            "Idempotency-Key created."
        },
        **errors(*WRITE_ERRORS, 409),
    },
)
async def create_job(
    body: Annotated[models.RedriveCreate, Body()],
    context: Context,
    principal: Admin,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> models.RedriveJobView:
    """Republish the dead letters selected by ``filter`` or ``ids``, at most ``rate`` per
    second, to ``target_topic`` (default: each one's original topic). Dead letters already
    redriven are never republished again (with ``ids`` they count as skipped). With
    ``dry_run`` nothing is republished: the job is created finished, with the counts."""
    selection: DeadLetterFilter | tuple[int, ...]
    if body.filter is not None:
        f = body.filter
        selection = DeadLetterFilter(
            topic=f.topic,
            group=f.group,
            reason=f.reason or None,
            key=f.key,
            since_ms=to_millis(f.since) if f.since is not None else None,
            until_ms=to_millis(f.until) if f.until is not None else None,
            redriven=False,
        )
    else:
        selection = tuple(body.ids or ())
    if body.target_topic is not None:
        counts = await context.scanner.partition_counts([body.target_topic])
        if not counts.get(body.target_topic):
            raise ApiError(
                422, f"target topic {body.target_topic!r} does not exist; create it first"
            )
    spec = RedriveSpec(
        selection=selection,
        target_topic=body.target_topic,
        rate=body.rate,
        dry_run=body.dry_run,
        actor=principal.name,
        reason=body.reason,
        idempotency_key=idempotency_key,
    )
    try:
        job = await context.jobs.create_redrive_job(spec, context.now_ms())
    except UnknownDeadLetters as exc:
        raise ApiError(422, str(exc)) from None
    except IdempotencyConflict as exc:
        raise ApiError(409, str(exc), error="idempotency_conflict") from None
    if job.replayed:
        response.status_code = 200
    elif job.state is JobState.PENDING:
        context.wake_redrive()
    return job_view(job)


@router.get(
    "",
    response_model=models.RedriveJobPage,
    summary="List redrive jobs",
    responses=errors(*READ_ERRORS),
)
async def list_jobs(
    context: Context,
    _: Reader,
    state: Annotated[
        list[JobState] | None, Query(description="One or more states (repeat).")
    ] = None,
    limit: Limit = 100,
    cursor: Cursor = None,
) -> models.RedriveJobPage:
    """Jobs, newest first."""
    states = list(state or ())
    query = fingerprint({"state": sorted(s.value for s in states)})
    before = decode_cursor(cursor, query, (int,))[0] if cursor else None
    jobs = await context.jobs.list_jobs(states=states, before_id=before, limit=limit + 1)
    more = len(jobs) > limit
    jobs = jobs[:limit]
    return models.RedriveJobPage(
        items=[job_view(j) for j in jobs],
        next_cursor=encode_cursor([jobs[-1].id], query) if more and jobs else None,
        limit=limit,
    )


@router.get(
    "/{job_id}",
    response_model=models.RedriveJobView,
    summary="A redrive job and its progress",
    responses=errors(*READ_ERRORS, 404),
)
async def get_job(job_id: JobId, context: Context, _: Reader) -> models.RedriveJobView:
    job = await context.jobs.get_job(job_id)
    if job is None:
        raise ApiError(404, f"no redrive job {job_id}")
    return job_view(job)


@router.get(
    "/{job_id}/items",
    response_model=models.RedriveItemPage,
    summary="The dead letters of a redrive job and what became of each",
    responses=errors(*READ_ERRORS, 404),
)
async def list_items(
    job_id: JobId,
    context: Context,
    _: Reader,
    state: Annotated[ItemState | None, Query()] = None,
    limit: Limit = 100,
    cursor: Cursor = None,
) -> models.RedriveItemPage:
    if await context.jobs.get_job(job_id) is None:
        raise ApiError(404, f"no redrive job {job_id}")
    query = fingerprint({"job": job_id, "state": state.value if state else None})
    after = decode_cursor(cursor, query, (int,))[0] if cursor else None
    rows = await context.jobs.job_items(
        job_id,
        state=state,
        after_id=after,
        limit=limit + 1,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    items = [
        models.RedriveItemView(
            dead_letter_id=row["dead_letter_id"],
            state=ItemState(row["state"]),
            detail=row["detail"],
            produced=position(
                row["target_topic"], row["produced_partition"], row["produced_offset"]
            )
            if row["produced_offset"] is not None and row["target_topic"] is not None
            else None,
            updated_at=from_millis(row["updated_ms"]),
        )
        for row in rows
    ]
    return models.RedriveItemPage(
        items=items,
        next_cursor=encode_cursor([rows[-1]["dead_letter_id"]], query) if more and rows else None,
        limit=limit,
    )


@router.post(
    "/{job_id}/cancel",
    response_model=models.RedriveJobView,
    summary="Cancel a redrive job",
    responses=errors(*WRITE_ERRORS, 404, 409),
)
async def cancel_job(job_id: JobId, context: Context, _: Admin) -> models.RedriveJobView:
    """A pending job is cancelled at once; a running one stops after its current batch
    (``cancel_requested`` until then). Cancelling a cancelled job again is fine; a finished
    one gives 409. Dead letters not republished stay available for another job."""
    try:
        job = await context.jobs.cancel_job(job_id, context.now_ms())
    except JobNotCancellable as exc:
        raise ApiError(409, str(exc)) from None
    if job is None:
        raise ApiError(404, f"no redrive job {job_id}")
    context.wake_redrive()
    return job_view(job)
