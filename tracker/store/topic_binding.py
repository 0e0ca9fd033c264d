"""Which markers topic a database serves: one, recorded by the first process that opens it.

The tracked entries and ranges are keyed by their markers *partition*, not by the markers
topic (a partition number is all a claim or a listing needs when one topic feeds the
database). Two trackers of different markers topics on one database would therefore each claim
and redeliver the other's due entries, mark them lost when the originals are not where they
look, and count them in their metrics, while each fences only its own partitions. Nothing
fails loudly; the numbers are just wrong. So a database records the markers topic it serves
(table ``markers_topic_binding``, one row) and a tracker or API process configured for another
topic refuses to start with :class:`ServesAnotherMarkersTopic`, naming both topics and the way
out. Moving a database to a new markers topic on purpose (the old one retired) is an
operator's act: ``kmq-tracker rebind-markers-topic --from OLD``.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from .database import SqlDatabase
from .dialects import insert_ignore
from .store_errors import NotBoundToMarkersTopic, ServesAnotherMarkersTopic
from .tables import markers_topic_binding

_SLOT = 1


async def bind_markers_topic(
    database: SqlDatabase, markers_topic: str, *, by: str, now_ms: int
) -> None:
    """Bind the database to ``markers_topic`` if it serves none yet; refuse if it serves
    another (:class:`ServesAnotherMarkersTopic`). Safe against a concurrent first bind: the
    row has one slot, so exactly one topic wins and the other process is refused."""
    async with database.transaction() as conn:
        bound = await _bound(conn)
        if bound is None:
            await _insert(conn, database, markers_topic, by, now_ms)
            bound = await _bound(conn)
    if bound is not None and bound[0] != markers_topic:
        raise ServesAnotherMarkersTopic(_name(database), bound[0], bound[1], markers_topic)


async def bound_markers_topic(database: SqlDatabase) -> str | None:
    """The markers topic the database serves, or None before any process bound it."""
    async with database.transaction(read_only=True) as conn:
        bound = await _bound(conn)
    return None if bound is None else bound[0]


async def rebind_markers_topic(
    database: SqlDatabase, old: str, new: str, *, by: str, now_ms: int
) -> None:
    """Move the database from markers topic ``old`` to ``new``: only if it serves ``old``
    (:class:`NotBoundToMarkersTopic` otherwise), so that a rebind cannot take over a database
    by mistake. A database bound to nothing yet is bound to ``new``."""
    b = markers_topic_binding.c
    async with database.transaction() as conn:
        moved = await conn.execute(
            update(markers_topic_binding)
            .where(b.slot == _SLOT, b.markers_topic == old)
            .values(markers_topic=new, bound_ms=now_ms, bound_by=by)
        )
        if moved.rowcount == 1:
            return
        bound = await _bound(conn)  # after a concurrent rebind: the topic it moved it to
        if bound is None:
            await _insert(conn, database, new, by, now_ms)
            bound = await _bound(conn)
    if bound is not None and bound[0] != new:
        raise NotBoundToMarkersTopic(
            f"the database {_name(database)} serves markers topic {bound[0]!r}, not {old!r}: "
            f"nothing changed"
        )


async def _bound(conn: AsyncConnection) -> tuple[str, str] | None:
    b = markers_topic_binding.c
    row = (await conn.execute(select(b.markers_topic, b.bound_by).where(b.slot == _SLOT))).first()
    return None if row is None else (row[0], row[1])


async def _insert(
    conn: AsyncConnection, database: SqlDatabase, markers_topic: str, by: str, now_ms: int
) -> None:
    """The binding row, unless a concurrent first bind wrote it first."""
    row = {"slot": _SLOT, "markers_topic": markers_topic, "bound_ms": now_ms, "bound_by": by}
    await conn.execute(insert_ignore(database.engine, markers_topic_binding, [row]))


def _name(database: SqlDatabase) -> str:
    return database.engine.url.render_as_string(hide_password=True)
