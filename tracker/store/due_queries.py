"""The claim of due entries as SQL: per markers partition, the earliest entries due by its
horizon, from that partition's own range of the ``(markers_partition, due_at_ms)`` index, merged
by the database; on PostgreSQL claimed in the same statement. Built once per partition count."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Select,
    String,
    Subquery,
    and_,
    bindparam,
    delete,
    or_,
    select,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.sql.dml import ReturningDelete, Update

from tracker.domain.tracked_range import RANGE_COLUMN_NAMES

from .dialects import rowid_column
from .tables import ENTRY_COLUMN_NAMES, KEY_COLUMNS, ranges_table, tracked

ENTRY_WIDTH = len(ENTRY_COLUMN_NAMES)
DUE_AT = ENTRY_COLUMN_NAMES.index("due_at_ms")
TOKEN_AT = ENTRY_COLUMN_NAMES.index("claim_token")


def due_order(row: Sequence[Any]) -> tuple[Any, ...]:
    """A due row's place in claim order: due time, then key."""
    return (row[DUE_AT], *row[:4])


#: Markers partitions per claim query (a UNION ALL of one index range each).
DUE_QUERY_PARTITIONS = 100


@functools.cache
def claim_query(partitions: int) -> Update:
    """PostgreSQL: claim :func:`due_query`'s rows in one statement, returning them as they
    were before (parameters ``token`` and ``claimed_due`` besides the due query's).

    Reading the rows and then updating them by key arrays (``unnest``) cost 45 ms per 1,000
    on top of the read; joined on the primary key in one ``UPDATE .. FROM`` it is one index
    probe per row and no second round trip.
    """
    due = due_query(partitions, "postgresql").subquery("due")
    return (
        update(tracked)
        .values(
            claim_token=bindparam("token", type_=String),
            due_at_ms=bindparam("claimed_due", type_=BigInteger),
        )
        .where(tuple_(*KEY_COLUMNS) == tuple_(*(due.c[c.name] for c in KEY_COLUMNS)))
        .returning(*due.c)
    )


@functools.cache
def due_query(partitions: int, dialect_name: str) -> Select[Any]:
    """The earliest ``:limit`` entries due in ``partitions`` markers partitions.

    Parameters ``p0, t0, p1, t1, ...`` (partition, due by) and ``limit``. Each partition's
    earliest entries come from its own range of the (markers_partition, due_at_ms) index (one
    query over an OR of partitions sorted every due row first: 17x slower at 1M entries than
    at 10k), and the database merges them, so only the claimed rows come back (building an
    Entry for every partition's candidates in Python was most of a burst round's claim). Built
    once per partition count: constructing the statement cost as much as running it. On
    SQLite each row ends with its ``rowid``, by which the claim marks it.
    """
    columns = [tracked.c[name] for name in ENTRY_COLUMN_NAMES]
    rowid = [c.label("kmq_rowid") for c in rowid_column(dialect_name)]
    merged = _earliest_per_partition(partitions, [*columns, *rowid])
    return (
        select(*merged.c)
        .order_by(merged.c.due_at_ms, *(merged.c[c.name] for c in KEY_COLUMNS))
        .limit(bindparam("limit", type_=Integer))
    )


@functools.cache
def due_times_query(partitions: int) -> Select[Any]:
    """The due times of :func:`due_query`'s rows and nothing else (same parameters).

    Where due ranges compete with due entries for a claim's batch, the claim takes both in
    due order; on PostgreSQL, whose claim marks entries in the statement that finds them, this
    says first how many of the batch go to entries (an index-only read of the same ranges).
    """
    merged = _earliest_per_partition(partitions, [tracked.c.due_at_ms])
    return (
        select(merged.c.due_at_ms)
        .order_by(merged.c.due_at_ms)
        .limit(bindparam("limit", type_=Integer))
    )


@functools.cache
def due_ranges_query(partitions: int) -> Select[Any]:
    """The earliest ``:limit`` tracked ranges due in ``partitions`` markers partitions
    (:data:`RANGE_COLUMN_NAMES`, in due order; the parameters of :func:`due_query`). Ranges
    are few (one row per fetched batch), so one index scan over an OR of partitions serves."""
    r = ranges_table.c
    due = [
        and_(
            r.markers_partition == bindparam(f"p{i}", type_=Integer),
            r.due_at_ms <= bindparam(f"t{i}", type_=BigInteger),
        )
        for i in range(partitions)
    ]
    return (
        select(*(r[name] for name in RANGE_COLUMN_NAMES))
        .where(or_(*due))
        .order_by(r.due_at_ms)
        .limit(bindparam("limit", type_=Integer))
    )


#: Deletes the ranges claimed with ``:token``, returning them (:data:`RANGE_COLUMN_NAMES`):
#: a redelivery round's record, once its copies are out.
CLAIMED_RANGES_DELETE: ReturningDelete[Any] = (
    delete(ranges_table)
    .where(ranges_table.c.claim_token == bindparam("token", type_=String))
    .returning(*(ranges_table.c[name] for name in RANGE_COLUMN_NAMES))
)


def _earliest_per_partition(partitions: int, columns: Sequence[Any]) -> Subquery:
    """``columns`` of each partition's earliest ``:limit`` due entries (parameters ``p<i>``,
    ``t<i>``), each from its own range of the (markers_partition, due_at_ms) index, as one
    UNION ALL for the database to merge."""
    limit = bindparam("limit", type_=Integer)
    per_partition = [
        select(*columns)
        .where(
            tracked.c.markers_partition == bindparam(f"p{i}", type_=Integer),
            tracked.c.due_at_ms <= bindparam(f"t{i}", type_=BigInteger),
        )
        .order_by(tracked.c.due_at_ms)
        .limit(limit)
        .subquery()
        for i in range(partitions)
    ]
    return union_all(*(select(*sub.c) for sub in per_partition)).subquery("due")
