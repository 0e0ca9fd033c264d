"""What the admin queries, operator actions and redrive jobs share: the entry as an operator
sees it, the dead-letter filter, and the transaction every admin method runs in.

The admin side of the store (kept apart from :mod:`tracker.store.manager`, the engine's hot
path) is split by concern: :mod:`~tracker.store.inspection` (listings and statistics),
:mod:`~tracker.store.operator_actions` (actions with an audit trail) and
:mod:`~tracker.store.redrive_jobs` (jobs with leases). The same rules hold as in the manager:
every public method is one transaction, and driver errors come out as ``StoreUnavailable``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import (
    Select,
    Table,
    func,
    literal,
    select,
    tuple_,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from tracker.domain.entries import Entry, EntryKey
from tracker.domain.value_records import value_record

from .database import ReadWork
from .manager import Store
from .models import EntryAction, RedriveItem, RedriveJob
from .tables import ENTRY_COLUMN_NAMES, KEY_COLUMNS, dead_letters, entry_from_values, tracked

T = TypeVar("T")

actions_table: Table = EntryAction.__table__  # type: ignore[assignment]
jobs_table: Table = RedriveJob.__table__  # type: ignore[assignment]
items_table: Table = RedriveItem.__table__  # type: ignore[assignment]

#: An entry's columns (in the order ``entry_from_values`` reads them), then ``payload_stored``.
ENTRY_VIEW_COLUMNS = (*(tracked.c[name] for name in ENTRY_COLUMN_NAMES), tracked.c.payload_stored)
#: Ids or topics per ``IN (...)`` list.
CHUNK = 500


@value_record
class EntryView:
    """A tracked entry and whether the store holds a copy of its payload."""

    entry: Entry
    payload_stored: bool


def entry_view(row: Any) -> EntryView:
    return EntryView(entry_from_values(row[:-1]), bool(row[-1]))


def typed_row(columns: Sequence[Any], values: Sequence[Any]) -> Any:
    """A row value of bound parameters typed like ``columns`` (64-bit offsets on PostgreSQL)."""
    return tuple_(*(literal(v, c.type) for c, v in zip(columns, values, strict=True)))


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


def dead_letter_where(query: Select[Any], flt: DeadLetterFilter) -> Select[Any]:
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


class AdminQueries:
    """Base of the admin side's classes: the store, and its transaction."""

    def __init__(self, store: Store, markers_topic: str) -> None:
        self.store = store
        self.engine = store.engine
        self.markers_topic = markers_topic

    def _transaction(
        self, *, read_only: bool = False
    ) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """The store's transaction; unique-key races (idempotency keys) reach the callers."""
        return self.store.transaction(read_only=read_only, passthrough=(IntegrityError,))

    async def _read(self, work: ReadWork[T]) -> T:
        """``work`` in one transaction that only reads (:meth:`SqlDatabase.read
        <tracker.store.database.SqlDatabase.read>`: on SQLite, on a read thread at once)."""
        return await self.store.read(work)

    async def _once(
        self,
        idempotency_key: str | None,
        write: Callable[[], Awaitable[T]],
        replay: Callable[[AsyncConnection], Awaitable[T | None]],
    ) -> T:
        """``write()``; when a request with the same idempotency key raced it and won (the
        unique index refused this one), the winner's recorded answer, read by ``replay``."""
        try:
            return await write()
        except IntegrityError:
            if idempotency_key is None:
                raise
            async with self._transaction() as conn:
                found = await replay(conn)
            if found is None:  # pragma: no cover - the unique index says it exists
                raise
            return found

    async def _entry_view_at(self, conn: AsyncConnection, key: EntryKey) -> EntryView | None:
        """The entry of ``key``: its own row, or what the tracked range holding it stands for."""
        row = (
            await conn.execute(select(*ENTRY_VIEW_COLUMNS).where(tuple_(*KEY_COLUMNS) == key))
        ).first()
        if row is not None:
            return entry_view(row)
        holder = await self.store.range_holding(conn, key)
        return None if holder is None else EntryView(holder.entry_at(key[3]), False)
