"""Database access of the admin API and of redrive jobs.

Kept apart from :mod:`tracker.store.manager` (the engine's hot path) because its concerns are
different: filtered listings with keyset pagination, aggregate statistics, operator actions
with an audit trail, and redrive jobs with leases. The same rules hold: every public method is
one transaction, and driver errors come out as :class:`StoreUnavailable`.

Operator actions and the engine: ingest applies markers in transactions that first update the
entry's ``markers_partitions`` row (epoch fencing; on PostgreSQL a row lock). An action does the
same before it reads the entry again and changes it, so an action and a marker flush for the
same partition serialize instead of overwriting each other. An entry that a redelivery round
has claimed (it is being republished right now) is not touched: the action is refused with a
conflict and can be repeated a moment later.

Redrive jobs never republish a dead letter twice:

* A dead letter is *reserved* for a job (``dead_letters.redriven_ms`` set where it was NULL)
  before it is produced, so two jobs can never both send it.
* An item is marked done in the same moment its produce is acknowledged (one transaction per
  batch), fenced by the job's lease token: a replica that lost its lease writes nothing.
* A replica that takes a job over scans the target partitions from the offsets recorded when
  the previous lease began (``scan_offsets``) for records carrying the job's header, and marks
  what it finds done before sending anything (see :mod:`tracker.engine.redrive`).
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import (
    BigInteger,
    Select,
    String,
    Table,
    and_,
    bindparam,
    delete,
    func,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.entries import OPERATOR_PREFIX, Entry, EntryKey, State
from tracker.domain.ranges import RANGE_COLUMN_NAMES, TrackedRange
from tracker.errors import KmqError
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .counts import CountChanges
from .manager import (
    ENTRY_COLUMN_NAMES,
    KEY_COLUMNS,
    Store,
    StoredPayload,
    chunks,
    dead_letter_counts,
    dead_letters,
    decode_headers,
    entry_from_values,
    partitions_table,
    ranges_table,
    tracked,
    tracked_counts,
)
from .models import EntryAction, RedriveItem, RedriveJob

actions_table: Table = EntryAction.__table__  # type: ignore[assignment]
jobs_table: Table = RedriveJob.__table__  # type: ignore[assignment]
items_table: Table = RedriveItem.__table__  # type: ignore[assignment]

#: An entry's columns (in the order ``entry_from_values`` reads them), then ``payload_stored``.
_ENTRY_COLUMNS = (*(tracked.c[name] for name in ENTRY_COLUMN_NAMES), tracked.c.payload_stored)
_CHUNK = 500
#: Where each item of a batch was produced (executemany; bind names differ from columns).
_SET_PRODUCED = (
    update(items_table)
    .where(
        items_table.c.job_id == bindparam("b_job"),
        items_table.c.dead_letter_id == bindparam("b_item"),
    )
    .values(
        target_topic=bindparam("b_topic"),
        produced_partition=bindparam("b_partition"),
        produced_offset=bindparam("b_offset"),
    )
)


class IdempotencyConflict(KmqError):
    """The Idempotency-Key was already used for a different request."""


class LeaseLost(KmqError):
    """This replica no longer holds the redrive job's lease (another replica took it over)."""


class JobNotCancellable(KmqError):
    """The redrive job already finished; it cannot be cancelled."""


class UnknownDeadLetters(KmqError):
    """Some of the requested dead letters do not exist."""

    def __init__(self, missing: Sequence[int]) -> None:
        shown = ", ".join(str(i) for i in list(missing)[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        super().__init__(f"no dead letters with ids {shown}{more}")
        self.missing = list(missing)


# -- tracked messages ---------------------------------------------------------------------------


class EntryOrder(enum.StrEnum):
    KEY = "key"  #: by (group, topic, partition, offset): stable under any concurrent writes
    DUE = "due"  #: by due time, then key: stable under inserts; excludes lost entries


@dataclass(frozen=True, slots=True)
class EntryFilter:
    """Conditions of a listing of tracked messages; ``None`` means "any"."""

    topic: str | None = None
    partition: int | None = None
    states: tuple[State, ...] = ()
    group: str | None = None
    due_before_ms: int | None = None
    due_after_ms: int | None = None
    min_attempt: int | None = None
    #: first delivered strictly before (how old a message is, whatever its attempts)
    seen_before_ms: int | None = None


@dataclass(frozen=True, slots=True)
class EntryView:
    """A tracked entry and whether the store holds a copy of its payload."""

    entry: Entry
    payload_stored: bool


@dataclass(frozen=True, slots=True)
class MessageRecord:
    """What the store knows of one message (``AdminStore.message_record``)."""

    view: EntryView | None  #: its tracked entry, if it is tracked
    actions: list[ActionRecord]  #: operator actions on it, oldest first
    dead_letters: list[dict[str, Any]]  #: its dead letters, oldest first


def _entry_view(row: Any) -> EntryView:
    return EntryView(entry_from_values(row[:-1]), bool(row[-1]))


def _typed(columns: Sequence[Any], values: Sequence[Any]) -> Any:
    """A row value of bound parameters typed like ``columns`` (64-bit offsets on PostgreSQL)."""
    return tuple_(*(literal(v, c.type) for c, v in zip(columns, values, strict=True)))


def _entry_where(query: Select[Any], flt: EntryFilter) -> Select[Any]:
    if flt.topic is not None:
        query = query.where(tracked.c.origin_topic == flt.topic)
    if flt.partition is not None:
        query = query.where(tracked.c.origin_partition == flt.partition)
    if flt.states:
        query = query.where(tracked.c.state.in_([s.value for s in flt.states]))
    if flt.group is not None:
        query = query.where(tracked.c.group_id == flt.group)
    if flt.due_before_ms is not None:
        query = query.where(tracked.c.due_at_ms < flt.due_before_ms)
    if flt.due_after_ms is not None:
        query = query.where(tracked.c.due_at_ms >= flt.due_after_ms)
    if flt.min_attempt is not None:
        query = query.where(tracked.c.attempt >= flt.min_attempt)
    if flt.seen_before_ms is not None:
        query = query.where(tracked.c.first_seen_ms < flt.seen_before_ms)
    return query


def _after(sort: Sequence[Any], after: Sequence[Any], flt: EntryFilter) -> Any:
    """The keyset condition "after ``after`` in ``sort`` order", as an index range.

    A column the filter fixes (the topic, the group) is left out of the row comparison when
    the cursor has the same value there: the comparison is the same, and what is left is
    the rest of the listing's index (``ix_tracked_topic_key``: topic, group, partition,
    offset), which the planners can then seek instead of filtering the topic from its start.
    """
    fixed = {tracked.c.origin_topic.key: flt.topic, tracked.c.group_id.key: flt.group}
    kept = [
        (column, value)
        for column, value in zip(sort, after, strict=True)
        if fixed.get(column.key) is None or fixed[column.key] != value
    ]
    columns = [column for column, _ in kept]
    return tuple_(*columns) > _typed(columns, [value for _, value in kept])


def _sort_key(order: EntryOrder) -> Any:
    """The keyset sort key of a listing in ``order`` (as ``after`` gives it)."""
    if order is EntryOrder.KEY:
        return lambda view: view.entry.key
    return lambda view: (view.entry.due_at_ms, *view.entry.key)


def _first_range_views(
    ranges: Iterable[TrackedRange],
    sort_key: Callable[[EntryView], tuple[Any, ...]],
    after: Sequence[Any] | None,
    limit: int,
) -> list[EntryView]:
    """The first ``limit`` entries (by ``sort_key``, after ``after``) the ranges stand for.

    Ranges are expanded in the order of their first entries, and the walk stops once
    ``limit`` entries are certain: a page reads a few ranges' offsets, not ``limit`` ranges'
    worth (100 ranges of 500 offsets made every page build 10,000 entries). Within a range
    the order is its offsets' (one due time per range).
    """

    def first_view(tracked_range: TrackedRange) -> EntryView:
        return EntryView(tracked_range.entry_at(next(tracked_range.offsets())), False)

    views: list[EntryView] = []
    threshold: tuple[Any, ...] | None = None
    for tracked_range in sorted(ranges, key=lambda t: sort_key(first_view(t))):
        if threshold is not None and sort_key(first_view(tracked_range)) > threshold:
            break
        taken = 0
        for offset in tracked_range.offsets():
            view = EntryView(tracked_range.entry_at(offset), False)
            if after is not None and sort_key(view) <= tuple(after):
                continue
            if threshold is not None and sort_key(view) > threshold:
                break
            views.append(view)
            taken += 1
            if taken >= limit:
                break
        if len(views) >= limit:
            views.sort(key=sort_key)
            del views[limit:]
            threshold = sort_key(views[-1])
    return views


# -- operator actions ---------------------------------------------------------------------------


class ActionKind(enum.StrEnum):
    REDELIVER = "redeliver"
    ACK = "ack"
    EXTEND = "extend"
    DEAD_LETTER = "dead_letter"


class Outcome(enum.StrEnum):
    APPLIED = "applied"  #: the entry changed
    UNCHANGED = "unchanged"  #: nothing to do: already in the requested condition
    CONFLICT = "conflict"  #: refused: the entry's state does not allow it
    NOT_FOUND = "not_found"  #: no such entry


@dataclass(frozen=True, slots=True)
class ActionRequest:
    key: EntryKey
    action: ActionKind
    actor: str
    reason: str = ""
    extend_ms: int | None = None  #: EXTEND: the new lease, counted from now
    idempotency_key: str | None = None

    def params(self) -> str:
        return json.dumps({"extend_ms": self.extend_ms} if self.extend_ms is not None else {})


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One row of the audit trail, which is also the answer to the request it records."""

    id: int
    key: EntryKey
    action: ActionKind
    actor: str
    reason: str
    params: dict[str, Any]
    outcome: Outcome
    detail: str
    state_before: str | None
    state_after: str | None
    due_at_ms: int | None
    created_ms: int
    idempotency_key: str | None
    replayed: bool = False  #: answered from an earlier request with the same Idempotency-Key


def _action_record(row: Any, *, replayed: bool = False) -> ActionRecord:
    m = row._mapping
    try:
        params = json.loads(m["params"] or "{}")
    except ValueError:
        params = {}
    return ActionRecord(
        id=m["id"],
        key=(m["group_id"], m["origin_topic"], m["origin_partition"], m["origin_offset"]),
        action=ActionKind(m["action"]),
        actor=m["actor"],
        reason=m["reason"],
        params=params,
        outcome=Outcome(m["outcome"]),
        detail=m["detail"],
        state_before=m["state_before"],
        state_after=m["state_after"],
        due_at_ms=m["due_at_ms"],
        created_ms=m["created_ms"],
        idempotency_key=m["idempotency_key"],
        replayed=replayed,
    )


@dataclass(frozen=True, slots=True)
class Decision:
    """What an action does to an entry: the outcome, the new values (if any), why."""

    outcome: Outcome
    detail: str
    changes: dict[str, Any] | None = None  #: column values to set; None: no update
    delete: bool = False


def decide_action(entry: Entry, request: ActionRequest, now_ms: int) -> Decision:
    """The effect of ``request`` on ``entry`` (pure; the rules of docs/api.md, Actions)."""
    state = entry.state
    if entry.claim_token is not None and entry.due_at_ms is not None and entry.due_at_ms > now_ms:
        return Decision(
            Outcome.CONFLICT,
            "the tracker is republishing this message right now (a redelivery round claimed "
            "it); repeat the request in a moment",
        )
    action = request.action
    if action is ActionKind.ACK:
        return Decision(Outcome.APPLIED, f"acknowledged ({state.value} entry removed)", delete=True)
    if action is ActionKind.REDELIVER:
        if state is State.REJECTED:
            return Decision(
                Outcome.CONFLICT,
                "the message is being dead-lettered (rejected); it cannot be redelivered now: "
                "redrive it from the DLQ afterwards",
            )
        if state is State.LOST:
            return Decision(
                Outcome.CONFLICT,
                "the message is lost (its original record is unreadable); it cannot be "
                "redelivered: ack it to drop it",
            )
        if entry.due_at_ms is not None and entry.due_at_ms <= now_ms:
            return Decision(Outcome.UNCHANGED, "already due; the tracker republishes it shortly")
        return Decision(
            Outcome.APPLIED,
            f"{state.value} message due now (was due at {entry.due_at_ms})",
            {"due_at_ms": now_ms, "claim_token": None, "updated_ms": now_ms},
        )
    if action is ActionKind.EXTEND:
        if state is not State.IN_FLIGHT:
            return Decision(
                Outcome.CONFLICT,
                f"only an in-flight message's lease can be extended; this one is {state.value}",
            )
        extend_ms = request.extend_ms or 0
        due = now_ms + extend_ms
        return Decision(
            Outcome.APPLIED,
            f"lease extended by {extend_ms} ms",
            {"due_at_ms": due, "claim_token": None, "updated_ms": now_ms},
        )
    # DEAD_LETTER
    if state is State.REJECTED:
        return Decision(Outcome.UNCHANGED, "already being dead-lettered")
    if state is State.LOST:
        return Decision(
            Outcome.CONFLICT,
            "the message is lost (its original record is unreadable); there is nothing to "
            "dead-letter: ack it to drop it",
        )
    why = f"{OPERATOR_PREFIX}{request.actor}"
    if request.reason:
        why += f": {request.reason}"
    return Decision(
        Outcome.APPLIED,
        f"{state.value} message marked for the DLQ",
        {
            "state": State.REJECTED.value,
            "due_at_ms": now_ms,
            "reason": why,
            "claim_token": None,
            "updated_ms": now_ms,
        },
    )


# -- statistics ---------------------------------------------------------------------------------


@dataclass(slots=True)
class TopicCounts:
    """Per origin topic: what the store holds right now (all consumer groups together)."""

    topic: str
    in_flight: int = 0
    delayed: int = 0
    rejected: int = 0
    lost: int = 0
    oldest_in_flight_first_seen_ms: int | None = None
    next_delayed_due_ms: int | None = None
    dead_lettered: int = 0  #: dead letters recorded, redriven or not
    dead_letters_waiting: int = 0  #: dead letters not redriven
    dead_lettered_recently: int = 0  #: dead-lettered since the ``since_ms`` asked for


#: Scalar subqueries per statement in :meth:`AdminStore.topic_counts` (SQLite's default
#: limit on a SELECT's columns is 2,000).
_PROBES_PER_QUERY = 100


def _probes(counts: TopicCounts, since_ms: int) -> list[tuple[TopicCounts, str, Any]]:
    """The figures of a topic that counters cannot keep: (counts, attribute, scalar query)."""
    t, d = tracked.c, dead_letters.c
    probes: list[tuple[TopicCounts, str, Any]] = []
    if counts.in_flight:
        # One probe of ix_tracked_topic_state (origin_topic, state, first_seen_ms). Written
        # as ORDER BY .. LIMIT 1, not MIN(): PostgreSQL turns MIN into that probe only when
        # its statistics say the topic has many rows; before the table is analyzed (after a
        # bulk load) it read all 1M index entries instead (500 ms).
        oldest = (
            select(t.first_seen_ms)
            .where(t.origin_topic == counts.topic, t.state == State.IN_FLIGHT.value)
            .order_by(t.first_seen_ms)
            .limit(1)
        )
        probes.append((counts, "oldest_in_flight_first_seen_ms", oldest))
    if counts.delayed:
        # Walks ix_tracked_state_due_key (state, due_at_ms, ...) to the topic's first delayed entry:
        # cheap however many delayed entries the topic has. ``|| ''`` keeps the planners
        # from choosing the topic index instead, which would read all of them and sort.
        next_due = (
            select(t.due_at_ms)
            .where(
                t.state == State.DELAYED.value,
                t.due_at_ms.is_not(None),
                t.origin_topic.concat("") == counts.topic,
            )
            .order_by(t.due_at_ms)
            .limit(1)
        )
        probes.append((counts, "next_delayed_due_ms", next_due))
    if counts.dead_lettered:
        # A range of ix_dead_letters_topic_time: as long as the recent dead letters.
        recent = select(func.count()).where(
            d.origin_topic == counts.topic, d.dead_lettered_ms >= since_ms
        )
        probes.append((counts, "dead_lettered_recently", recent))
    return probes


# -- dead letters -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    topic: str | None = None
    group: str | None = None
    reason: str | None = None  #: substring of the reason, case-insensitive
    #: the record key, exactly (its UTF-8 text; a null key never matches). No index: the
    #: other conditions bound the scan, newest first, until a page is found.
    key: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    redriven: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}


def _dead_letter_where(query: Select[Any], flt: DeadLetterFilter) -> Select[Any]:
    d = dead_letters.c
    if flt.topic is not None:
        query = query.where(d.origin_topic == flt.topic)
    if flt.group is not None:
        query = query.where(d.group_id == flt.group)
    if flt.reason:
        query = query.where(func.lower(d.reason).contains(flt.reason.lower(), autoescape=True))
    if flt.key is not None:
        query = query.where(d.message_key == flt.key.encode())
    if flt.since_ms is not None:
        query = query.where(d.dead_lettered_ms >= flt.since_ms)
    if flt.until_ms is not None:
        query = query.where(d.dead_lettered_ms < flt.until_ms)
    if flt.redriven is True:
        query = query.where(d.redriven_ms.is_not(None))
    elif flt.redriven is False:
        query = query.where(d.redriven_ms.is_(None))
    return query


# -- redrive jobs -------------------------------------------------------------------------------


class JobState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


FINISHED_STATES = (JobState.DONE, JobState.CANCELLED, JobState.FAILED)


class ItemState(enum.StrEnum):
    PENDING = "pending"
    SENDING = "sending"
    DONE = "done"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class RedriveSpec:
    """What a new redrive job is asked to do."""

    selection: DeadLetterFilter | tuple[int, ...]
    target_topic: str | None
    rate: float
    dry_run: bool
    actor: str
    reason: str = ""
    idempotency_key: str | None = None

    def selection_json(self) -> str:
        if isinstance(self.selection, DeadLetterFilter):
            return json.dumps({"filter": self.selection.to_json()}, sort_keys=True)
        return json.dumps({"ids": list(self.selection)})

    def fingerprint(self) -> tuple[Any, ...]:
        return (self.selection_json(), self.target_topic, float(self.rate), self.dry_run)


@dataclass(frozen=True, slots=True)
class RedriveJobView:
    id: int
    state: JobState
    selection: dict[str, Any]
    target_topic: str | None
    rate: float
    dry_run: bool
    total: int
    done: int
    skipped: int
    created_by: str
    reason: str
    created_ms: int
    updated_ms: int
    started_ms: int | None
    finished_ms: int | None
    cancel_requested: bool
    owner: str | None
    lease_token: str | None
    lease_until_ms: int | None
    scan_offsets: dict[str, dict[int, int]] | None
    last_error: str
    idempotency_key: str | None
    replayed: bool = False

    @property
    def pending(self) -> int:
        return max(0, self.total - self.done - self.skipped)


def _job_view(row: Any, *, replayed: bool = False) -> RedriveJobView:
    m = row._mapping
    offsets: dict[str, dict[int, int]] | None = None
    if m["scan_offsets"]:
        raw = json.loads(m["scan_offsets"])
        offsets = {t: {int(p): int(o) for p, o in ps.items()} for t, ps in raw.items()}
    try:
        selection = json.loads(m["selection"])
    except ValueError:
        selection = {}
    return RedriveJobView(
        id=m["id"],
        state=JobState(m["state"]),
        selection=selection,
        target_topic=m["target_topic"],
        rate=float(m["rate"]),
        dry_run=bool(m["dry_run"]),
        total=int(m["total_count"]),
        done=int(m["done_count"]),
        skipped=int(m["skipped_count"]),
        created_by=m["created_by"],
        reason=m["reason"],
        created_ms=m["created_ms"],
        updated_ms=m["updated_ms"],
        started_ms=m["started_ms"],
        finished_ms=m["finished_ms"],
        cancel_requested=bool(m["cancel_requested"]),
        owner=m["owner"],
        lease_token=m["lease_token"],
        lease_until_ms=m["lease_until_ms"],
        scan_offsets=offsets,
        last_error=m["last_error"],
        idempotency_key=m["idempotency_key"],
        replayed=replayed,
    )


@dataclass(frozen=True, slots=True)
class RedriveWork:
    """An unfinished item with what is needed to republish its dead letter."""

    dead_letter_id: int
    state: ItemState
    origin_topic: str
    dlq_topic: str
    dlq_partition: int
    dlq_offset: int


@dataclass(frozen=True, slots=True)
class Produced:
    dead_letter_id: int
    topic: str
    partition: int
    offset: int


@dataclass(slots=True)
class ReserveResult:
    reserved: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


# -----------------------------------------------------------------------------------------------


class AdminStore:
    """Queries and updates of the admin API and the redrive runner, on the tracker's store."""

    def __init__(self, store: Store, markers_topic: str) -> None:
        self.store = store
        self.engine = store.engine
        self.markers_topic = markers_topic

    def _transaction(
        self, *, read_only: bool = False
    ) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """The store's transaction; unique-key races (idempotency keys) reach the callers."""
        return self.store.transaction(read_only=read_only, passthrough=(IntegrityError,))

    # -- tracked messages -------------------------------------------------------------------

    async def list_entries(
        self,
        flt: EntryFilter,
        *,
        order: EntryOrder = EntryOrder.KEY,
        after: Sequence[Any] | None = None,
        limit: int = 100,
    ) -> list[EntryView]:
        """One page of tracked entries, after the keyset position ``after``.

        ``after`` is the sort key of the last row of the previous page: the entry key for
        :attr:`EntryOrder.KEY`, ``(due_at_ms, *key)`` for :attr:`EntryOrder.DUE`. Keyset
        pagination never repeats or skips a row whose sort key does not change meanwhile.
        """
        query = _entry_where(select(*_ENTRY_COLUMNS), flt)
        sort = KEY_COLUMNS if order is EntryOrder.KEY else (tracked.c.due_at_ms, *KEY_COLUMNS)
        if order is EntryOrder.DUE:
            query = query.where(tracked.c.due_at_ms.is_not(None))
        if after is not None:
            query = query.where(_after(sort, after, flt))
        query = query.order_by(*sort)
        async with self._transaction(read_only=True) as conn:
            rows = await conn.execute(query.limit(limit))
            views = [_entry_view(row) for row in rows]
            in_ranges = await self._range_views(conn, flt, order, after, limit)
        if not in_ranges:
            return views
        sort_key = _sort_key(order)
        return sorted([*views, *in_ranges], key=sort_key)[:limit]

    async def _range_views(
        self,
        conn: AsyncConnection,
        flt: EntryFilter,
        order: EntryOrder,
        after: Sequence[Any] | None,
        limit: int,
    ) -> list[EntryView]:
        """The first ``limit`` entries (in ``order``, after ``after``) that tracked ranges
        stand for (``tracker/domain/ranges.py``): each open offset is an in-flight entry.

        Ranges are read in (lane, first offset) order, or (due, lane, first offset): the
        first ``limit`` of them hold the first ``limit`` entries, because every range holds
        its first offset. Only where ``after`` falls inside a lane are the ranges that
        straddle it (first offset before it, last after it) read as well.
        """
        if flt.states and State.IN_FLIGHT not in flt.states:
            return []
        if flt.min_attempt is not None and flt.min_attempt > 1:
            return []
        r = ranges_table.c
        base = select(*(r[name] for name in RANGE_COLUMN_NAMES))
        if flt.topic is not None:
            base = base.where(r.origin_topic == flt.topic)
        if flt.partition is not None:
            base = base.where(r.origin_partition == flt.partition)
        if flt.group is not None:
            base = base.where(r.group_id == flt.group)
        if flt.due_before_ms is not None:
            base = base.where(r.due_at_ms < flt.due_before_ms)
        if flt.due_after_ms is not None:
            base = base.where(r.due_at_ms >= flt.due_after_ms)
        if flt.seen_before_ms is not None:
            base = base.where(r.first_seen_ms < flt.seen_before_ms)
        lane = (r.group_id, r.origin_topic, r.origin_partition)
        queries: list[Select[Any]] = []
        by: tuple[Any, ...]
        if order is EntryOrder.KEY:
            by = (*lane, r.first_offset)
            if after is None:
                queries.append(base.order_by(*by).limit(limit))
            else:
                here = [c == v for c, v in zip(lane, after[:3], strict=True)]
                o = after[3]
                queries += [
                    base.where(
                        *here, r.first_offset.between(o - MAX_RANGE_WIDTH, o), r.last_offset > o
                    ),
                    base.where(*here, r.first_offset > o).order_by(r.first_offset).limit(limit),
                    base.where(tuple_(*lane) > _typed(lane, after[:3])).order_by(*by).limit(limit),
                ]
        else:
            by = (r.due_at_ms, *lane, r.first_offset)
            if after is None:
                queries.append(base.order_by(*by).limit(limit))
            else:
                due, o = after[0], after[4]
                here = [
                    r.due_at_ms == due,
                    *(c == v for c, v in zip(lane, after[1:4], strict=True)),
                ]
                later = (r.due_at_ms, *lane)
                queries += [
                    base.where(
                        *here, r.first_offset.between(o - MAX_RANGE_WIDTH, o), r.last_offset > o
                    ),
                    base.where(*here, r.first_offset > o).order_by(r.first_offset).limit(limit),
                    base.where(tuple_(*later) > _typed(later, after[:4]))
                    .order_by(*by)
                    .limit(limit),
                ]
        found: dict[tuple[Any, ...], TrackedRange] = {}
        for query in queries:
            for row in await conn.execute(query):
                tracked_range = TrackedRange.from_row(row)
                found[tracked_range.key] = tracked_range
        return _first_range_views(found.values(), _sort_key(order), after, limit)

    async def get_entry(self, key: EntryKey) -> EntryView | None:
        async with self._transaction(read_only=True) as conn:
            return await self._get(conn, key)

    async def _get(self, conn: AsyncConnection, key: EntryKey) -> EntryView | None:
        """The entry of ``key``: its own row, or what the tracked range holding it stands for."""
        row = (
            await conn.execute(select(*_ENTRY_COLUMNS).where(tuple_(*KEY_COLUMNS) == key))
        ).first()
        if row is not None:
            return _entry_view(row)
        holder = await self.store.range_holding(conn, key)
        return None if holder is None else EntryView(holder.entry_at(key[3]), False)

    async def stored_payload(self, key: EntryKey) -> StoredPayload | None:
        """The payload copy the store keeps for a long delay, if any."""
        async with self._transaction(read_only=True) as conn:
            row = (
                await conn.execute(
                    select(
                        tracked.c.payload_key,
                        tracked.c.payload_value,
                        tracked.c.payload_headers,
                        tracked.c.payload_timestamp_ms,
                    ).where(tuple_(*KEY_COLUMNS) == key, tracked.c.payload_stored.is_(True))
                )
            ).first()
        if row is None:
            return None
        m = row._mapping
        return StoredPayload(
            m["payload_key"],
            m["payload_value"],
            decode_headers(m["payload_headers"]),
            m["payload_timestamp_ms"] or 0,
        )

    async def message_record(self, key: EntryKey, limit: int = 100) -> MessageRecord:
        """Everything the store knows of one message, read in one transaction: its entry,
        the latest ``limit`` operator actions and dead letters, each oldest first."""
        a, d = actions_table.c, dead_letters.c
        actions = (
            select(actions_table)
            .where(tuple_(a.group_id, a.origin_topic, a.origin_partition, a.origin_offset) == key)
            .order_by(a.id.desc())
            .limit(limit)
        )
        dead = (
            select(dead_letters)
            .where(tuple_(d.group_id, d.origin_topic, d.origin_partition, d.origin_offset) == key)
            .order_by(d.id.desc())
            .limit(limit)
        )
        async with self._transaction(read_only=True) as conn:
            view = await self._get(conn, key)
            action_rows = list(await conn.execute(actions))
            dead_rows = list(await conn.execute(dead))
        return MessageRecord(
            view,
            [_action_record(row) for row in reversed(action_rows)],
            [dict(row._mapping) for row in reversed(dead_rows)],
        )

    # -- operator actions -------------------------------------------------------------------

    async def apply_action(self, request: ActionRequest, now_ms: int) -> ActionRecord:
        """Apply an operator action to one entry and record it, atomically.

        With an idempotency key seen before: the recorded answer when it was the same request,
        :class:`IdempotencyConflict` when it was another. Every answer is recorded (including
        refusals) so the audit trail shows who asked for what.
        """
        try:
            return await self._apply_action(request, now_ms)
        except IntegrityError:
            # The same idempotency key raced us and won: answer from its row.
            if request.idempotency_key is None:
                raise
            async with self._transaction() as conn:
                replay = await self._idempotent_action(conn, request)
            if replay is None:  # pragma: no cover - the unique index says it exists
                raise
            return replay

    async def _idempotent_action(
        self, conn: AsyncConnection, request: ActionRequest
    ) -> ActionRecord | None:
        if request.idempotency_key is None:
            return None
        row = (
            await conn.execute(
                select(actions_table).where(
                    actions_table.c.idempotency_key == request.idempotency_key
                )
            )
        ).first()
        if row is None:
            return None
        found = _action_record(row, replayed=True)
        if (
            found.key != request.key
            or found.action is not request.action
            or found.reason != request.reason
            or row._mapping["params"] != request.params()
        ):
            raise IdempotencyConflict(
                f"Idempotency-Key {request.idempotency_key!r} was already used for another "
                f"request ({found.action.value} of {'/'.join(map(str, found.key))})"
            )
        return found

    async def _apply_action(self, request: ActionRequest, now_ms: int) -> ActionRecord:
        async with self._transaction() as conn:
            if request.idempotency_key is not None:
                replay = await self._idempotent_action(conn, request)
                if replay is not None:
                    return replay
            view = await self._get(conn, request.key)
            if view is not None:
                # Serialize with marker ingest of this partition (see the module docstring),
                # then look again: a flush may have changed the entry meanwhile.
                await conn.execute(
                    update(partitions_table)
                    .where(
                        partitions_table.c.markers_topic == self.markers_topic,
                        partitions_table.c.partition == view.entry.markers_partition,
                    )
                    .values(updated_ms=partitions_table.c.updated_ms)
                )
                view = await self._get(conn, request.key)
                if view is not None and view.entry.claim_token is None:
                    # An action changes one message: if a tracked range holds it, it leaves
                    # the range for an entry row of its own first (the rest stay together).
                    await self.store.split_from_range(conn, request.key)
            state_before: str | None = None
            state_after: str | None = None
            due_after: int | None = None
            if view is None:
                decision = await self._absent(conn, request)
            else:
                entry = view.entry
                state_before = entry.state.value
                decision = decide_action(entry, request, now_ms)
                where = tuple_(*KEY_COLUMNS) == request.key
                counts = CountChanges()
                if decision.delete:
                    await conn.execute(delete(tracked).where(where))
                    counts.change(entry, None)
                elif decision.changes is not None:
                    await conn.execute(update(tracked).where(where).values(**decision.changes))
                    if "state" in decision.changes:
                        counts.change(entry, replace(entry, state=State(decision.changes["state"])))
                await counts.write(conn, self.store.engine, tracked_counts)
                if not decision.delete:
                    changes = decision.changes or {}
                    state_after = changes.get("state", entry.state.value)
                    due_after = changes.get("due_at_ms", entry.due_at_ms)
            values = {
                "group_id": request.key[0],
                "origin_topic": request.key[1],
                "origin_partition": request.key[2],
                "origin_offset": request.key[3],
                "action": request.action.value,
                "actor": request.actor,
                "reason": request.reason,
                "params": request.params(),
                "outcome": decision.outcome.value,
                "detail": decision.detail,
                "state_before": state_before,
                "state_after": state_after,
                "due_at_ms": due_after,
                "created_ms": now_ms,
                "idempotency_key": request.idempotency_key,
            }
            result = await conn.execute(actions_table.insert().values(**values))
            (row_id,) = result.inserted_primary_key or (0,)
        return ActionRecord(
            id=int(row_id),
            key=request.key,
            action=request.action,
            actor=request.actor,
            reason=request.reason,
            params=json.loads(request.params()),
            outcome=decision.outcome,
            detail=decision.detail,
            state_before=state_before,
            state_after=state_after,
            due_at_ms=due_after,
            created_ms=now_ms,
            idempotency_key=request.idempotency_key,
        )

    async def _absent(self, conn: AsyncConnection, request: ActionRequest) -> Decision:
        """The decision for an entry that does not exist: acked before, or unknown."""
        if request.action is ActionKind.ACK:
            a = actions_table.c
            row = (
                await conn.execute(
                    select(a.actor, a.created_ms)
                    .where(
                        tuple_(a.group_id, a.origin_topic, a.origin_partition, a.origin_offset)
                        == request.key,
                        a.action == ActionKind.ACK.value,
                        a.outcome == Outcome.APPLIED.value,
                    )
                    .order_by(a.id.desc())
                    .limit(1)
                )
            ).first()
            if row is not None:
                return Decision(
                    Outcome.UNCHANGED,
                    f"already acknowledged through the API by {row.actor} at {row.created_ms} "
                    "(ms since the epoch)",
                )
        return Decision(
            Outcome.NOT_FOUND,
            "no tracked message with this id (never seen, acknowledged by its consumer, "
            "redelivered as a new attempt that is not started yet, or dead-lettered)",
        )

    # -- statistics -------------------------------------------------------------------------

    async def topic_counts(
        self, *, since_ms: int, topic: str | None = None
    ) -> dict[str, TopicCounts]:
        """Per origin topic: entries by state, oldest ages, dead letters (recent and waiting).

        The counts come from the counter tables (migration 0003: entries kept by the store,
        dead letters by triggers), a few rows whatever the table's size; then, per topic, one
        index probe each for the oldest in-flight message, the next delayed one and the
        recent dead letters.
        """
        c = tracked_counts.c
        entries = select(c.origin_topic, c.state, func.sum(c.entries)).group_by(
            c.origin_topic, c.state
        )
        dc = dead_letter_counts.c
        dead = select(dc.origin_topic, dc.total, dc.waiting)
        if topic is not None:
            entries = entries.where(c.origin_topic == topic)
            dead = dead.where(dc.origin_topic == topic)
        out: dict[str, TopicCounts] = {}
        async with self._transaction(read_only=True) as conn:
            for name, state, count in await conn.execute(entries):
                if not count:
                    continue
                counts = out.setdefault(name, TopicCounts(name))
                if state == State.IN_FLIGHT.value:
                    counts.in_flight = int(count)
                elif state == State.DELAYED.value:
                    counts.delayed = int(count)
                elif state == State.REJECTED.value:
                    counts.rejected = int(count)
                elif state == State.LOST.value:
                    counts.lost = int(count)
            for name, total, waiting in await conn.execute(dead):
                if total:
                    counts = out.setdefault(name, TopicCounts(name))
                    counts.dead_lettered, counts.dead_letters_waiting = int(total), int(waiting)
            probes = [probe for counts in out.values() for probe in _probes(counts, since_ms)]
            for chunk in chunks(probes, _PROBES_PER_QUERY):
                queries = (query.scalar_subquery() for _, _, query in chunk)
                found = (await conn.execute(select(*queries))).one()
                for (counts, attribute, _), value in zip(chunk, found, strict=True):
                    setattr(counts, attribute, value)
            await self._oldest_in_ranges(conn, out)
        return out

    async def _oldest_in_ranges(
        self, conn: AsyncConnection, counts: dict[str, TopicCounts]
    ) -> None:
        """Let the tracked ranges' first-seen times count for the oldest in-flight message."""
        topics = sorted(name for name, c in counts.items() if c.in_flight)
        r = ranges_table.c
        for chunk in chunks(topics, _CHUNK):
            rows = await conn.execute(
                select(r.origin_topic, func.min(r.first_seen_ms))
                .where(r.origin_topic.in_(chunk))
                .group_by(r.origin_topic)
            )
            for name, seen in rows:
                if seen is None:
                    continue
                topic = counts[name]
                oldest = topic.oldest_in_flight_first_seen_ms
                topic.oldest_in_flight_first_seen_ms = seen if oldest is None else min(oldest, seen)

    # -- dead letters -----------------------------------------------------------------------

    async def list_dead_letters(
        self, flt: DeadLetterFilter, *, before_id: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """One page of dead letters, newest first, with ids below ``before_id``."""
        query = _dead_letter_where(select(dead_letters), flt)
        if before_id is not None:
            query = query.where(dead_letters.c.id < before_id)
        query = query.order_by(dead_letters.c.id.desc()).limit(limit)
        async with self._transaction(read_only=True) as conn:
            return [dict(row._mapping) for row in await conn.execute(query)]

    async def get_dead_letter(self, dead_letter_id: int) -> dict[str, Any] | None:
        async with self._transaction(read_only=True) as conn:
            row = (
                await conn.execute(select(dead_letters).where(dead_letters.c.id == dead_letter_id))
            ).first()
        return dict(row._mapping) if row is not None else None

    # -- redrive jobs: the API side ----------------------------------------------------------

    async def create_redrive_job(self, spec: RedriveSpec, now_ms: int) -> RedriveJobView:
        """Create a job and snapshot its items (the matching dead letters not yet redriven).

        A dry run only counts: the job is created finished, with ``total`` the number of dead
        letters it would republish and ``skipped`` those already redriven (explicit ids).
        Raises :class:`UnknownDeadLetters` for explicit ids that do not exist and
        :class:`IdempotencyConflict` for a reused idempotency key with another request.
        """
        try:
            return await self._create_redrive_job(spec, now_ms)
        except IntegrityError:
            if spec.idempotency_key is None:
                raise
            async with self._transaction() as conn:
                replay = await self._idempotent_job(conn, spec)
            if replay is None:  # pragma: no cover - the unique index says it exists
                raise
            return replay

    async def _idempotent_job(
        self, conn: AsyncConnection, spec: RedriveSpec
    ) -> RedriveJobView | None:
        row = (
            await conn.execute(
                select(jobs_table).where(jobs_table.c.idempotency_key == spec.idempotency_key)
            )
        ).first()
        if row is None:
            return None
        m = row._mapping
        if (m["selection"], m["target_topic"], float(m["rate"]), bool(m["dry_run"])) != (
            spec.fingerprint()
        ):
            raise IdempotencyConflict(
                f"Idempotency-Key {spec.idempotency_key!r} was already used for another "
                f"request (redrive job {m['id']})"
            )
        return _job_view(row, replayed=True)

    async def _create_redrive_job(self, spec: RedriveSpec, now_ms: int) -> RedriveJobView:
        d = dead_letters.c
        async with self._transaction() as conn:
            if spec.idempotency_key is not None:
                replay = await self._idempotent_job(conn, spec)
                if replay is not None:
                    return replay
            already: list[int] = []
            if isinstance(spec.selection, DeadLetterFilter):
                matching = _dead_letter_where(select(d.id), spec.selection).where(
                    d.redriven_ms.is_(None)
                )
            else:
                wanted = sorted(set(spec.selection))
                found: dict[int, bool] = {}
                for start in range(0, len(wanted), _CHUNK):
                    chunk = wanted[start : start + _CHUNK]
                    rows = await conn.execute(
                        select(d.id, d.redriven_ms.is_not(None)).where(d.id.in_(chunk))
                    )
                    found.update({int(i): bool(r) for i, r in rows})
                missing = [i for i in wanted if i not in found]
                if missing:
                    raise UnknownDeadLetters(missing)
                already = [i for i in wanted if found[i]]
                matching = select(d.id).where(
                    d.id.in_([i for i in wanted if not found[i]]), d.redriven_ms.is_(None)
                )
            count = int(
                await conn.scalar(select(func.count()).select_from(matching.subquery())) or 0
            )
            finished = spec.dry_run
            values: dict[str, Any] = {
                "state": (JobState.DONE if finished else JobState.PENDING).value,
                "selection": spec.selection_json(),
                "target_topic": spec.target_topic,
                "rate": float(spec.rate),
                "dry_run": spec.dry_run,
                "total_count": count + len(already),
                "done_count": 0,
                "skipped_count": len(already),
                "created_by": spec.actor,
                "reason": spec.reason,
                "created_ms": now_ms,
                "updated_ms": now_ms,
                "finished_ms": now_ms if finished else None,
                "idempotency_key": spec.idempotency_key,
            }
            result = await conn.execute(jobs_table.insert().values(**values))
            (job_id,) = result.inserted_primary_key or (0,)
            if not spec.dry_run:
                await conn.execute(
                    items_table.insert().from_select(
                        ["job_id", "dead_letter_id", "state", "updated_ms"],
                        select(
                            literal(job_id, BigInteger()),
                            matching.subquery().c.id,
                            literal(ItemState.PENDING.value, String()),
                            literal(now_ms, BigInteger()),
                        ),
                    )
                )
                if already:
                    await conn.execute(
                        items_table.insert(),
                        [
                            {
                                "job_id": job_id,
                                "dead_letter_id": i,
                                "state": ItemState.SKIPPED.value,
                                "detail": "already redriven",
                                "updated_ms": now_ms,
                            }
                            for i in already
                        ],
                    )
                if count == 0:
                    await conn.execute(
                        update(jobs_table)
                        .where(jobs_table.c.id == job_id)
                        .values(state=JobState.DONE.value, finished_ms=now_ms)
                    )
            row = (await conn.execute(select(jobs_table).where(jobs_table.c.id == job_id))).one()
            return _job_view(row)

    async def get_job(self, job_id: int) -> RedriveJobView | None:
        async with self._transaction(read_only=True) as conn:
            row = (await conn.execute(select(jobs_table).where(jobs_table.c.id == job_id))).first()
        return _job_view(row) if row is not None else None

    async def list_jobs(
        self,
        *,
        states: Iterable[JobState] = (),
        before_id: int | None = None,
        limit: int = 100,
    ) -> list[RedriveJobView]:
        """One page of jobs, newest first, with ids below ``before_id``."""
        query = select(jobs_table)
        wanted = [s.value for s in states]
        if wanted:
            query = query.where(jobs_table.c.state.in_(wanted))
        if before_id is not None:
            query = query.where(jobs_table.c.id < before_id)
        query = query.order_by(jobs_table.c.id.desc()).limit(limit)
        async with self._transaction(read_only=True) as conn:
            return [_job_view(row) for row in await conn.execute(query)]

    async def job_items(
        self,
        job_id: int,
        *,
        state: ItemState | None = None,
        after_id: int | None = None,
        limit: int,
    ) -> list[dict[str, Any]]:
        query = select(items_table).where(items_table.c.job_id == job_id)
        if state is not None:
            query = query.where(items_table.c.state == state.value)
        if after_id is not None:
            query = query.where(items_table.c.dead_letter_id > after_id)
        query = query.order_by(items_table.c.dead_letter_id).limit(limit)
        async with self._transaction(read_only=True) as conn:
            return [dict(row._mapping) for row in await conn.execute(query)]

    async def cancel_job(self, job_id: int, now_ms: int) -> RedriveJobView | None:
        """Cancel a job: at once if it has not started, else ask its runner to stop.

        Idempotent for a cancelled job; :class:`JobNotCancellable` for a done or failed one.
        None for an unknown job.
        """
        j = jobs_table.c
        async with self._transaction() as conn:
            row = (await conn.execute(select(jobs_table).where(j.id == job_id))).first()
            if row is None:
                return None
            state = JobState(row._mapping["state"])
            if state in (JobState.DONE, JobState.FAILED):
                raise JobNotCancellable(f"redrive job {job_id} already finished ({state.value})")
            if state is JobState.PENDING:
                changed = await conn.execute(
                    update(jobs_table)
                    .where(j.id == job_id, j.state == JobState.PENDING.value)
                    .values(
                        state=JobState.CANCELLED.value,
                        cancel_requested=True,
                        finished_ms=now_ms,
                        updated_ms=now_ms,
                    )
                )
                if changed.rowcount == 1:
                    await conn.execute(
                        update(items_table)
                        .where(
                            items_table.c.job_id == job_id,
                            items_table.c.state == ItemState.PENDING.value,
                        )
                        .values(state=ItemState.CANCELLED.value, updated_ms=now_ms)
                    )
                else:  # a runner took it just now: ask it to stop
                    state = JobState.RUNNING
            if state is JobState.RUNNING:
                await conn.execute(
                    update(jobs_table)
                    .where(j.id == job_id, j.state == JobState.RUNNING.value)
                    .values(cancel_requested=True, updated_ms=now_ms)
                )
            row = (await conn.execute(select(jobs_table).where(j.id == job_id))).one()
            return _job_view(row)

    # -- redrive jobs: the runner side --------------------------------------------------------

    async def claim_job(
        self, owner: str, token: str, now_ms: int, lease_ms: int
    ) -> RedriveJobView | None:
        """Take the oldest pending job, or a running one whose lease ran out (its runner died)."""
        j = jobs_table.c
        claimable = or_(
            j.state == JobState.PENDING.value,
            and_(j.state == JobState.RUNNING.value, j.lease_until_ms < now_ms),
        )
        async with self._transaction() as conn:
            candidates = list(
                await conn.execute(select(j.id).where(claimable).order_by(j.id).limit(5))
            )
            for (job_id,) in candidates:
                changed = await conn.execute(
                    update(jobs_table)
                    .where(j.id == job_id, claimable)
                    .values(
                        state=JobState.RUNNING.value,
                        owner=owner,
                        lease_token=token,
                        lease_until_ms=now_ms + lease_ms,
                        started_ms=func.coalesce(j.started_ms, now_ms),
                        updated_ms=now_ms,
                    )
                )
                if changed.rowcount == 1:
                    row = (await conn.execute(select(jobs_table).where(j.id == job_id))).one()
                    return _job_view(row)
        return None

    async def _fence(self, conn: AsyncConnection, job_id: int, token: str, now_ms: int) -> bool:
        """Touch the job where our lease token still holds; returns cancel_requested."""
        j = jobs_table.c
        result = await conn.execute(
            update(jobs_table)
            .where(j.id == job_id, j.lease_token == token, j.state == JobState.RUNNING.value)
            .values(updated_ms=now_ms)
            .returning(j.cancel_requested)
        )
        row = result.first()
        if row is None:
            raise LeaseLost(f"lost the lease of redrive job {job_id}")
        return bool(row[0])

    async def renew_lease(self, job_id: int, token: str, now_ms: int, lease_ms: int) -> bool:
        """Extend our lease; returns whether a cancel was requested. :class:`LeaseLost` if gone."""
        async with self._transaction() as conn:
            cancel = await self._fence(conn, job_id, token, now_ms)
            await conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id)
                .values(lease_until_ms=now_ms + lease_ms)
            )
            return cancel

    async def release_lease(self, job_id: int, token: str, now_ms: int) -> None:
        """Give a running job up (graceful stop): any replica may continue it right away."""
        async with self._transaction() as conn:
            await conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id, jobs_table.c.lease_token == token)
                .values(lease_until_ms=now_ms - 1, updated_ms=now_ms)
            )

    async def job_targets(self, job: RedriveJobView) -> set[str]:
        """The topics the job's unfinished items go to."""
        if job.target_topic is not None:
            return {job.target_topic}
        i, d = items_table.c, dead_letters.c
        query = (
            select(d.origin_topic)
            .distinct()
            .select_from(items_table.join(dead_letters, d.id == i.dead_letter_id))
            .where(
                i.job_id == job.id,
                i.state.in_([ItemState.PENDING.value, ItemState.SENDING.value]),
            )
        )
        async with self._transaction() as conn:
            return {row[0] for row in await conn.execute(query)}

    async def sending_items(self, job_id: int) -> set[int]:
        """Dead letter ids of the job's reserved items (produced or not: unknown)."""
        async with self._transaction() as conn:
            rows = await conn.execute(
                select(items_table.c.dead_letter_id).where(
                    items_table.c.job_id == job_id,
                    items_table.c.state == ItemState.SENDING.value,
                )
            )
            return {int(row[0]) for row in rows}

    async def set_scan_offsets(
        self, job_id: int, token: str, offsets: Mapping[str, Mapping[int, int]], now_ms: int
    ) -> None:
        raw = {t: {str(p): o for p, o in ps.items()} for t, ps in offsets.items()}
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            await conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id)
                .values(scan_offsets=json.dumps(raw, sort_keys=True))
            )

    async def next_work(self, job_id: int, limit: int) -> list[RedriveWork]:
        """The next unfinished items in order (``sending`` ones first in id order too)."""
        i, d = items_table.c, dead_letters.c
        query = (
            select(
                i.dead_letter_id,
                i.state,
                d.origin_topic,
                d.dlq_topic,
                d.dlq_partition,
                d.dlq_offset,
            )
            .select_from(items_table.outerjoin(dead_letters, d.id == i.dead_letter_id))
            .where(
                i.job_id == job_id,
                i.state.in_([ItemState.PENDING.value, ItemState.SENDING.value]),
            )
            .order_by(i.dead_letter_id)
            .limit(limit)
        )
        async with self._transaction() as conn:
            rows = list(await conn.execute(query))
        out: list[RedriveWork] = []
        for row in rows:
            m = row._mapping
            out.append(
                RedriveWork(
                    dead_letter_id=int(m["dead_letter_id"]),
                    state=ItemState(m["state"]),
                    origin_topic=m["origin_topic"] or "",
                    dlq_topic=m["dlq_topic"] or "",
                    dlq_partition=int(m["dlq_partition"] if m["dlq_partition"] is not None else -1),
                    dlq_offset=int(m["dlq_offset"] if m["dlq_offset"] is not None else -1),
                )
            )
        return out

    async def reserve(
        self, job_id: int, token: str, dead_letter_ids: Sequence[int], now_ms: int
    ) -> ReserveResult:
        """Reserve pending items' dead letters for this job (``redriven_ms`` where NULL).

        Items whose dead letter was redriven meanwhile (another job) or deleted are skipped.
        """
        result = ReserveResult()
        if not dead_letter_ids:
            return result
        d, i = dead_letters.c, items_table.c
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            for start in range(0, len(dead_letter_ids), _CHUNK):
                chunk = list(dead_letter_ids[start : start + _CHUNK])
                # Lock in id order first: two jobs reserving overlapping sets then queue on
                # PostgreSQL instead of deadlocking (SQLite has one writer anyway).
                await conn.execute(
                    select(d.id).where(d.id.in_(chunk)).order_by(d.id).with_for_update()
                )
                rows = await conn.execute(
                    update(dead_letters)
                    .where(d.id.in_(chunk), d.redriven_ms.is_(None))
                    .values(redriven_ms=now_ms)
                    .returning(d.id)
                )
                got = {int(r[0]) for r in rows}
                result.reserved += [x for x in chunk if x in got]
                result.skipped += [x for x in chunk if x not in got]
            if result.reserved:
                for start in range(0, len(result.reserved), _CHUNK):
                    chunk = result.reserved[start : start + _CHUNK]
                    await conn.execute(
                        update(items_table)
                        .where(i.job_id == job_id, i.dead_letter_id.in_(chunk))
                        .values(state=ItemState.SENDING.value, updated_ms=now_ms)
                    )
            if result.skipped:
                await self._skip(
                    conn,
                    job_id,
                    [(x, "already redriven by another job, or deleted") for x in result.skipped],
                    now_ms,
                )
        return result

    async def _skip(
        self, conn: AsyncConnection, job_id: int, items: Sequence[tuple[int, str]], now_ms: int
    ) -> None:
        i = items_table.c
        for dead_letter_id, detail in items:
            await conn.execute(
                update(items_table)
                .where(i.job_id == job_id, i.dead_letter_id == dead_letter_id)
                .values(state=ItemState.SKIPPED.value, detail=detail, updated_ms=now_ms)
            )
        await conn.execute(
            update(jobs_table)
            .where(jobs_table.c.id == job_id)
            .values(skipped_count=jobs_table.c.skipped_count + len(items))
        )

    async def skip_reserved(
        self, job_id: int, token: str, items: Sequence[tuple[int, str]], now_ms: int
    ) -> None:
        """Give up reserved items that cannot be sent (their DLQ record is gone): unreserve."""
        if not items:
            return
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            ids = [x for x, _ in items]
            await conn.execute(
                update(dead_letters).where(dead_letters.c.id.in_(ids)).values(redriven_ms=None)
            )
            await self._skip(conn, job_id, items, now_ms)

    async def mark_done(
        self, job_id: int, token: str, produced: Sequence[Produced], now_ms: int
    ) -> bool:
        """Record produced items (fenced by the lease); returns whether a cancel was requested.

        Two statements whatever the batch size (the runner's rate depends on this being
        quick): the state change with an exact count, then the positions (executemany).
        """
        i = items_table.c
        async with self._transaction() as conn:
            cancel = await self._fence(conn, job_id, token, now_ms)
            if not produced:
                return cancel
            count = 0
            ids = [p.dead_letter_id for p in produced]
            for start in range(0, len(ids), _CHUNK):
                changed = await conn.execute(
                    update(items_table)
                    .where(
                        i.job_id == job_id,
                        i.dead_letter_id.in_(ids[start : start + _CHUNK]),
                        i.state == ItemState.SENDING.value,
                    )
                    .values(state=ItemState.DONE.value, updated_ms=now_ms)
                )
                count += changed.rowcount
            await conn.execute(
                _SET_PRODUCED,
                [
                    {
                        "b_job": job_id,
                        "b_item": p.dead_letter_id,
                        "b_topic": p.topic,
                        "b_partition": p.partition,
                        "b_offset": p.offset,
                    }
                    for p in produced
                ],
            )
            if count:
                await conn.execute(
                    update(jobs_table)
                    .where(jobs_table.c.id == job_id)
                    .values(done_count=jobs_table.c.done_count + count)
                )
            return cancel

    async def set_error(self, job_id: int, token: str, error: str, now_ms: int) -> None:
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            await conn.execute(
                update(jobs_table).where(jobs_table.c.id == job_id).values(last_error=error)
            )

    async def finish_job(self, job_id: int, token: str, state: JobState, now_ms: int) -> None:
        """End the job. Cancelled or failed: unfinished items are cancelled, reservations undone.

        Only call with no produce in flight whose outcome is unknown (the runner resolves
        ``sending`` items by scanning first), so an unreserved dead letter was never sent.
        """
        i, j = items_table.c, jobs_table.c
        async with self._transaction() as conn:
            await self._fence(conn, job_id, token, now_ms)
            if state is not JobState.DONE:
                sending = select(i.dead_letter_id).where(
                    i.job_id == job_id, i.state == ItemState.SENDING.value
                )
                await conn.execute(
                    update(dead_letters)
                    .where(dead_letters.c.id.in_(sending))
                    .values(redriven_ms=None)
                )
                await conn.execute(
                    update(items_table)
                    .where(
                        i.job_id == job_id,
                        i.state.in_([ItemState.PENDING.value, ItemState.SENDING.value]),
                    )
                    .values(state=ItemState.CANCELLED.value, updated_ms=now_ms)
                )
            await conn.execute(
                update(jobs_table)
                .where(j.id == job_id)
                .values(
                    state=state.value,
                    finished_ms=now_ms,
                    updated_ms=now_ms,
                    lease_token=None,
                    lease_until_ms=None,
                )
            )
