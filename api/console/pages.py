"""The console's pages (GET): overview, topic, message, dead letters, redrive job, parked markers.

Pages are built from the API's own handlers and models (``api.routes``) and the store's
bounded summary queries (:mod:`tracker.store.overview`): the console has no backend of its
own, so a page shows exactly what the REST API answers. Sections that change refresh on their
own (htmx polling of the same URL, swapping only the live section).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Literal

from aiokafka import TopicPartition
from fastapi import APIRouter, Path, Query, Request, Response

from tracker.clock import from_millis
from tracker.domain.entries import State
from tracker.kafka.original_records import OriginalsUnavailable
from tracker.store import StoreUnavailable
from tracker.store.admin_reads import DeadLetterFilter
from tracker.store.inspection import EntryFilter, EntryOrder
from tracker.store.overview import MarkersPartitionState, OverviewQueries

from .. import models
from ..context import ApiContext
from ..http_errors import ApiError
from ..message_ids import parse_message_id
from ..models import TEXT_PATTERN, TOPIC_PATTERN, MessageState
from ..routes import dlq, messages, redrive, topics
from ..security import Principal
from ..views import dead_letter_view
from .guard import ConsoleError, ConsoleRoute, Context, Session
from .parked import parked_record, recent_parked
from .render import render
from .session import ConsoleSession

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)


#: Rows per page of the message and dead-letter listings.
PAGE_SIZE = 50
#: Minutes of history in the overview's charts.
CHART_MINUTES = 60
#: How old the tracker health's Kafka figures (markers topic ends, parked records) may be:
#: the overview refreshes every 5 s, and every viewer within this window shares one read.
HEALTH_MAX_AGE_SECONDS = 3.0
ACTIONS = ("redeliver", "extend", "ack", "dead_letter")
#: The filter fields a dry run's "for real" form carries over (see job.html).
REAL_RUN_FIELDS = frozenset({"topic", "group", "reason", "key", "redriven"})


def reader(session: ConsoleSession) -> Principal:
    return Principal(session.role.value, session.role)


# -- overview -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionHealth:
    partition: int
    owner: str | None
    epoch: int
    applied: int
    end: int | None
    updated_ms: int

    @property
    def lag(self) -> int | None:
        return None if self.end is None else max(0, self.end - self.applied)


@dataclass(frozen=True, slots=True)
class TrackerHealth:
    partitions: list[PartitionHealth]
    markers_partitions: int | None  #: on Kafka (None: Kafka did not answer)
    parked: int | None  #: parked records the invalid topic keeps
    kafka_error: str | None
    engine: str | None  #: this process's engine, if it runs one


async def _health(context: ApiContext, rows: list[MarkersPartitionState]) -> TrackerHealth:
    settings = context.settings
    markers, invalid = settings.markers_topic, settings.invalid_topic
    reads = context.reads
    scanner = reads.scanner

    async def read() -> tuple[dict[str, int | None], dict[TopicPartition, tuple[int, int]]]:
        counts = await scanner.partition_counts([markers, invalid])
        tps = [
            TopicPartition(topic, p)
            for topic in (markers, invalid)
            for p in range(counts[topic] or 0)
        ]
        return counts, await scanner.bounds(tps)

    kafka_error = None
    counts: dict[str, int | None] = {}
    bounds: dict[TopicPartition, tuple[int, int]] = {}
    try:
        counts, bounds = await reads.history.run(
            ("console", "health"), read, reads.deadline(), max_age=HEALTH_MAX_AGE_SECONDS
        )
    except OriginalsUnavailable as exc:
        kafka_error = str(exc)
    partitions = [
        PartitionHealth(
            row.partition,
            row.owner,
            row.epoch,
            row.next_offset,
            bounds[TopicPartition(markers, row.partition)][1]
            if TopicPartition(markers, row.partition) in bounds
            else None,
            row.updated_ms,
        )
        for row in rows
    ]
    parked = (
        sum(end - begin for tp, (begin, end) in bounds.items() if tp.topic == invalid)
        if kafka_error is None
        else None
    )
    engine = None
    if context.engine is not None:
        # Not tracker.health(): its store ping waits behind ingest's writes on SQLite.
        running, last_error = context.engine.engine_state()
        engine = "running" if running else "not running"
        if last_error:
            engine += f" (last error: {last_error})"
    return TrackerHealth(partitions, counts.get(markers), parked, kafka_error, engine)


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
    health = await _health(context, figures.partitions)
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


# -- a topic's messages ---------------------------------------------------------------------------


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


# -- one message ----------------------------------------------------------------------------------


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
        token=_form_token(),
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


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One line of a message's history: a marker, an operator action, a dead letter."""

    at: datetime | None
    kind: str
    what: str
    attempt: int | None
    where: str
    detail: str


_MARKER_WHAT = {
    "start": "delivered (START)",
    "ack": "acknowledged",
    "delay": "delayed by the consumer",
    "extend": "lease extended",
    "reject": "rejected",
}


def _at(p: models.Position) -> str:
    return f"{p.topic}/{p.partition}/{p.offset}"


def timeline(detail: models.MessageDetail) -> list[TimelineEvent]:
    """Markers, operator actions and dead letters of a message, in time order."""
    events: list[TimelineEvent] = []
    for m in detail.markers.events if detail.markers else ():
        notes = []
        if m.kind == "start" and m.timeout_ms:
            notes.append(f"lease {m.timeout_ms / 1000:g} s")
        if m.kind == "delay":
            notes.append("policy backoff" if m.policy_delay else f"{m.delay_ms / 1000:g} s")
        if m.range_offsets is not None:
            notes.append(f"range {m.range_offsets[0]}..{m.range_offsets[1]}")
        if m.consumer:
            notes.append(f"by {m.consumer}")
        if m.reason:
            notes.append(m.reason)
        what = _MARKER_WHAT.get(m.kind, m.kind)
        events.append(
            TimelineEvent(m.timestamp, m.kind, what, m.attempt, _at(m.record), "; ".join(notes))
        )
    for a in detail.actions:
        what = f"{a.action.value.replace('_', ' ')} by {a.actor} ({a.outcome.value})"
        note = "; ".join(part for part in (a.reason, a.detail) if part)
        events.append(TimelineEvent(a.at, "action", what, None, "", note))
    for d in detail.dead_letters:
        events.append(
            TimelineEvent(
                d.dead_lettered_at, "dead_letter", "dead-lettered", d.attempts, _at(d.dlq), d.reason
            )
        )
        if d.redriven_at is not None:
            events.append(TimelineEvent(d.redriven_at, "redrive", "redriven", None, "", ""))
    far = datetime.max.replace(tzinfo=UTC)
    events.sort(key=lambda e: e.at or far)
    return events


def _form_token() -> str:
    """An Idempotency-Key for one rendered form: submitting it twice acts once."""
    return "console-" + secrets.token_urlsafe(18)


# -- dead letters and redrive ---------------------------------------------------------------------


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
        token=_form_token(),
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
        token=_form_token(),
    )


# -- parked markers -------------------------------------------------------------------------------


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
