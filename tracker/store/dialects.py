"""Every difference between SQLite and PostgreSQL lives here.

* Engines: SQLite runs in WAL mode with ``synchronous=NORMAL`` and a busy timeout, and opens
  write transactions with ``BEGIN IMMEDIATE`` so that two writers queue instead of failing on a
  lock upgrade. PostgreSQL uses a pre-pinged pool.
* Upserts: ``INSERT ... ON CONFLICT DO UPDATE`` through each dialect's own construct.
* Reads that only read (:meth:`tracker.store.database.SqlDatabase.read`): on a SQLite file, a
  synchronous engine of their own (:func:`sqlite_read_engine`) whose whole unit of work runs on
  one worker thread; elsewhere the async engine's connection, driven synchronously.
* Hot-path reads and claims go to the driver itself (:func:`driver_rows`,
  :func:`claim_rows_sql`): SQLite marks claimed rows by ``rowid``, PostgreSQL by key arrays.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import sqlite3
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

import asyncpg
from sqlalchemy import (
    ColumnElement,
    String,
    Table,
    and_,
    bindparam,
    event,
    func,
    literal_column,
    or_,
    select,
    tuple_,
)
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Dialect, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql import Select
from sqlalchemy.sql.dml import Delete, Insert, Update
from sqlalchemy.types import TypeEngine

from .store_errors import StoreUnavailable

SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Keys per :func:`keys_in` on SQLite (an OR chain; SQLite's expression depth limit is 1,000).
SQLITE_MAX_KEYS = 500
# How long disposing an engine waits for aiosqlite's worker threads to wind down.
SQLITE_THREADS_SETTLE_S = 2.0


def is_sqlite(engine: AsyncEngine) -> bool:
    return engine.dialect.name == "sqlite"


def create_engine(url: str, *, echo: bool = False) -> AsyncEngine:
    """An async engine for ``url`` with the settings the tracker relies on."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_async_engine(
            url,
            echo=echo,
            hide_parameters=True,  # errors and logs never carry payloads or message data
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        )
        _configure_sqlite(engine)
        return engine
    return create_async_engine(
        url,
        echo=echo,
        hide_parameters=True,
        pool_pre_ping=True,
        pool_size=5,
        max_overflow=5,
        pool_timeout=30,
    )


#: Execution option of :func:`read_engine`'s transactions.
READ_ONLY_OPTION = "kmq_read_only"


def read_engine(engine: AsyncEngine) -> AsyncEngine:
    """The same engine (same pool) for transactions that only read.

    On SQLite, write transactions start with ``BEGIN IMMEDIATE`` so that two writers queue on
    the busy timeout instead of failing on a lock upgrade; a read started that way would wait
    for (and hold up) the ingest and redelivery writers. Reads through this engine start with
    a plain ``BEGIN`` instead: in WAL mode they see the last commit and never block. A write
    inside such a transaction would fail at once with "database is locked"; only pure reads
    use it. On PostgreSQL it is the engine itself.
    """
    if not is_sqlite(engine):
        return engine
    return engine.execution_options(**{READ_ONLY_OPTION: True})


#: Threads that run :func:`sqlite_read_engine`'s reads: a few requests read at once (SQLite
#: readers in WAL mode never block each other, and the driver lets go of the GIL while a
#: statement runs).
SQLITE_READ_THREADS = 4


def sqlite_read_engine(engine: AsyncEngine) -> Engine | None:
    """A synchronous engine on ``engine``'s SQLite file, for reads only; ``None`` where there
    is none to have (PostgreSQL, an in-memory database that only ``engine`` can see).

    Why: the async driver (aiosqlite) runs each connection on a thread of its own and hands
    every call over to it and back through the event loop: ``BEGIN``, each statement's cursor,
    execute, fetch and close, the end of the transaction. A listing of the admin API made a
    dozen such hand-offs, and under load they, not SQLite, were most of a request's CPU. A
    read through this engine runs its whole unit of work on one worker thread: one hand-off.
    Its connections are ``query_only`` (a write through them fails at once) and read in a
    plain deferred ``BEGIN``, which in WAL mode sees the last commit and never waits for the
    writer.
    """
    if not is_sqlite(engine):
        return None
    url = engine.url
    if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        return None
    reads = create_sync_engine(
        url.set(drivername="sqlite"),
        hide_parameters=True,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
        pool_size=SQLITE_READ_THREADS,
        max_overflow=0,
    )

    @event.listens_for(reads, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA query_only=ON")
        cursor.close()

    @event.listens_for(reads, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN")

    return reads


async def settle_failed_sqlite(engine: AsyncEngine) -> None:
    """After a failed SQLite connect: close the engine and let the driver's threads finish.

    aiosqlite runs each connection on a thread that reports back through the event loop. When a
    connection fails to open (a missing directory, an unreadable file), aiosqlite stops that
    thread without waiting for it; if the process then closes its loop at once, the thread dies
    with "Event loop is closed" and prints a traceback after our one-line error. Waiting here,
    while the loop still runs, keeps a refused start to exactly that one line. Only for failure
    paths: healthy connections of other engines in the process would make it wait the full
    bound.
    """
    await engine.dispose()
    if not is_sqlite(engine):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SQLITE_THREADS_SETTLE_S
    for thread in threading.enumerate():
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        if thread.name.endswith("(_connection_worker_thread)") and thread.is_alive():
            await asyncio.to_thread(thread.join, remaining)


def _configure_sqlite(engine: AsyncEngine) -> None:
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take over transaction control from the driver (so BEGIN IMMEDIATE below is ours).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(connection: Any) -> None:
        if connection.get_execution_options().get(READ_ONLY_OPTION):
            # A read in WAL mode sees the last commit and never waits for the writer.
            connection.exec_driver_sql("BEGIN")
        else:
            connection.exec_driver_sql("BEGIN IMMEDIATE")


async def lock_rows_in_order(conn: AsyncConnection, query: Select[Any], order: Any) -> None:
    """Lock the rows ``query`` selects, in ``order``, until the transaction ends.

    PostgreSQL: ``SELECT ... ORDER BY ... FOR UPDATE``. SQLite needs nothing: its write
    transactions (``BEGIN IMMEDIATE``) already run one at a time.
    """
    if conn.dialect.name == "sqlite":
        return
    await conn.execute(query.order_by(order).with_for_update())


@functools.lru_cache(maxsize=16)
def _upsert_sql(
    dialect: Dialect, table: Table, columns: tuple[str, ...], update: tuple[str, ...]
) -> str:
    """``INSERT (columns) VALUES (...) ON CONFLICT (primary key) DO UPDATE SET <update>``, as
    SQLite's SQL, with one positional parameter per column in ``columns`` order.

    Ingest writes thousands of rows per flush: through SQLAlchemy every row was a dict and
    every batch a freshly rendered statement (a third of a flush's CPU in the unacked
    profile), so the driver gets this text (with as many rows after ``VALUES`` as it
    carries, :func:`_sqlite_values_upsert_sql`) and plain tuples.
    """
    keys = [c.name for c in table.primary_key.columns]
    values: dict[str, Any] = {c: bindparam(c) for c in columns}
    sqlite_stmt = sqlite_insert(table).values(values)
    stmt: Insert = sqlite_stmt.on_conflict_do_update(
        index_elements=keys, set_={c: sqlite_stmt.excluded[c] for c in update}
    )
    compiled = stmt.compile(dialect=dialect)
    if tuple(compiled.positiontup or ()) != columns:
        raise AssertionError(f"unexpected parameter order {compiled.positiontup}")
    return compiled.string


async def upsert_rows(
    conn: AsyncConnection,
    table: Table,
    columns: Sequence[str],
    update: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
) -> None:
    """Insert or update ``rows`` (tuples of ``columns``' values, distinct keys) at once.

    Values go to the driver as they are (no SQLAlchemy type processing): plain ``str``,
    ``int``, ``bool`` and ``None`` only.
    """
    in_flight = await start_upsert(conn, table, columns, update, rows)
    if in_flight is not None:
        await in_flight


async def start_upsert(
    conn: AsyncConnection,
    table: Table,
    columns: Sequence[str],
    update: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
) -> asyncio.Task[Any] | None:
    """:func:`upsert_rows`, returning while the database still applies the rows, if it can.

    The returned task completes with the statement; nothing may use ``conn`` until it is
    awaited. The database works on the rows while the caller goes on, e.g. folding the next
    markers of a flush. ``None``: the rows are applied when this returns.

    * PostgreSQL, from :data:`COPY_UPSERT_ROWS` rows: the rows are staged by COPY and the
      statement that applies them (the costly part: a heap row and every index's entry per
      row) is in flight in the server's process.
    * SQLite: rows go in multi-row statements (:func:`_sqlite_upsert`); an upsert that fits
      one statement, from :data:`SQLITE_IN_FLIGHT_ROWS` rows, is in flight on aiosqlite's
      thread, which runs SQLite's b-tree work without the interpreter lock.
    """
    if not rows:
        return None
    if conn.dialect.name == "sqlite":
        return await _sqlite_upsert(conn, table, tuple(columns), tuple(update), rows)
    if len(rows) >= COPY_UPSERT_ROWS:
        await _copy_stage(conn, table, tuple(columns), rows)
        statement = conn.exec_driver_sql(
            _copy_insert_sql(conn.dialect, table, tuple(columns), tuple(update))
        )
        return await _sent(statement)
    # PostgreSQL: one statement for all rows, the values as one array per column (one
    # round trip and one plan per flush instead of a pipelined bind per row).
    sql = _unnest_upsert_sql(conn.dialect, table, tuple(columns), tuple(update))
    await conn.exec_driver_sql(sql, tuple(list(values) for values in zip(*rows, strict=True)))
    return None


async def _sent(statement: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """``statement`` as a task, once it is on its way to the database."""
    in_flight = asyncio.get_running_loop().create_task(statement, name="kmq-upsert")
    try:
        # One turn of the loop: the task runs up to its first wait, the reply, so the
        # statement is on its way when the caller's next Python runs.
        await asyncio.sleep(0)
    except BaseException:
        # Cancelled before the caller holds the task: the statement must end before the
        # transaction's rollback may use the connection.
        await outlive_statement(in_flight)
        raise
    return in_flight


#: SQLite's limit on a statement's parameters (``SQLITE_MAX_VARIABLE_NUMBER``, 32,766 since
#: SQLite 3.32).
SQLITE_MAX_PARAMETERS = 32_766
#: From this many rows on, a SQLite upsert that fits one statement is left in flight.
SQLITE_IN_FLIGHT_ROWS = 256


def sqlite_statement_rows(columns: int) -> int:
    """The most rows of ``columns`` values one SQLite upsert statement takes: the largest
    power of two within :data:`SQLITE_MAX_PARAMETERS` (1,024 rows of an entry's 18 columns)."""
    fits = max(1, SQLITE_MAX_PARAMETERS // max(1, columns))
    return 1 << (fits.bit_length() - 1)


def sqlite_row_groups(rows: int, most: int) -> list[int]:
    """Statement sizes for ``rows`` rows: ``most`` while that many are left, then powers of
    two, largest first (so a table has a dozen statement texts at most, each prepared once
    by the driver's statement cache)."""
    groups = [most] * (rows // most)
    rest = rows % most
    while rest:
        size = 1 << (rest.bit_length() - 1)
        groups.append(size)
        rest -= size
    return groups


async def _sqlite_upsert(
    conn: AsyncConnection,
    table: Table,
    columns: tuple[str, ...],
    update: tuple[str, ...],
    rows: Sequence[tuple[Any, ...]],
) -> asyncio.Task[Any] | None:
    """SQLite's side of :func:`start_upsert`: ``INSERT .. VALUES (..), (..), ..`` with up to
    :func:`sqlite_statement_rows` rows per statement, not ``executemany``.

    ``executemany`` binds each row's values while holding the interpreter lock, then lets it
    go while SQLite steps, then takes it again: once per row. Run while the event loop's
    thread folds markers, every row waited for that thread to let the lock go (up to the
    5 ms switch interval), so SQLite's writes had to run inline, the loop waiting. A
    multi-row statement binds its values in one pass and steps once, lock released, for all
    its rows: 25-28 against 31-32 us per row of an entry alone, and it keeps that pace next
    to a busy loop (31-32 us), which keeps 65-78 % of its own pace (2026-12-02).

    The statement in flight runs on the driver's connection itself (one hop to aiosqlite's
    thread; SQLAlchemy's adapter makes a cursor first, a hop of its own), so its errors
    are translated here, as :func:`driver_rows` does.
    """
    dialect = conn.dialect
    groups = sqlite_row_groups(len(rows), sqlite_statement_rows(len(columns)))
    if len(groups) == 1 and len(rows) >= SQLITE_IN_FLIGHT_ROWS:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        sql = _sqlite_values_upsert_sql(dialect, table, columns, update, len(rows))
        return await _sent(_driver_execute(driver, sql, _flat(rows)))
    start = 0
    for size in groups:
        sql = _sqlite_values_upsert_sql(dialect, table, columns, update, size)
        await conn.exec_driver_sql(sql, _flat(rows[start : start + size]))
        start += size
    return None


def _flat(rows: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    return tuple(itertools.chain.from_iterable(rows))


async def _driver_execute(driver: Any, sql: str, params: tuple[Any, ...]) -> None:
    try:
        await driver.execute(sql, params)
    except sqlite3.Error as exc:
        raise _driver_error(exc) from exc


@functools.lru_cache(maxsize=64)
def _sqlite_values_upsert_sql(
    dialect: Dialect, table: Table, columns: tuple[str, ...], update: tuple[str, ...], rows: int
) -> str:
    """:func:`_upsert_sql` with ``rows`` tuples of parameters after ``VALUES``."""
    single = _upsert_sql(dialect, table, columns, update)
    one = "(" + ", ".join(["?"] * len(columns)) + ")"
    if single.count(one) != 1:
        raise AssertionError(f"unexpected upsert statement {single!r}")
    return single.replace(one, ", ".join([one] * rows))


def _driver_error(exc: Exception) -> StoreUnavailable:
    """A driver error raised past SQLAlchemy (whose errors the store's transactions
    translate), as the store's callers expect it: a failover or a deadlock mid-claim must
    pause redelivery, not end it."""
    return StoreUnavailable(f"database error: {type(exc).__name__}: {exc}")


async def outlive_statement(in_flight: asyncio.Task[Any]) -> None:
    """Wait for a statement :func:`start_upsert` left in flight, after the caller failed:
    its outcome no longer matters (the transaction rolls back), only that the connection is
    free for the rollback. Its error, if any, is retrieved and dropped; the caller's is the
    one to raise."""
    await asyncio.wait([in_flight])
    if not in_flight.cancelled():
        in_flight.exception()


#: From this many rows on, PostgreSQL upserts go through COPY (see :func:`_copy_stage`).
COPY_UPSERT_ROWS = 200


async def _copy_stage(
    conn: AsyncConnection,
    table: Table,
    columns: tuple[str, ...],
    rows: Sequence[tuple[Any, ...]],
) -> None:
    """Stage rows for an upsert on PostgreSQL: binary COPY into a temporary table, which
    ``_copy_insert_sql`` then applies with one ``INSERT .. SELECT .. ON CONFLICT``.

    The array form (:func:`_unnest_upsert_sql`) has asyncpg encode every value through its
    generic array encoder, which checks each element's type against abstract base classes:
    half of a 5,000-row flush of per-message entries went there. COPY's binary encoder goes
    straight to each column's codec. The temporary table lives as long as the pooled
    connection; it is emptied here, not only at commit: a transaction that upserts twice
    (in chunks) must not apply the first chunk's rows again with the second.
    """
    quote = conn.dialect.identifier_preparer.quote
    temp = quote(f"kmq_upsert_{table.name}")
    await conn.exec_driver_sql(
        f"CREATE TEMP TABLE IF NOT EXISTS {temp} (LIKE {quote(table.name)} INCLUDING DEFAULTS) "
        "ON COMMIT DELETE ROWS"
    )
    await conn.exec_driver_sql(f"TRUNCATE {temp}")
    raw = await conn.get_raw_connection()
    try:
        await raw.driver_connection.copy_records_to_table(  # type: ignore[union-attr]
            f"kmq_upsert_{table.name}", records=rows, columns=list(columns)
        )
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise _driver_error(exc) from exc


@functools.lru_cache(maxsize=16)
def _copy_insert_sql(
    dialect: Dialect, table: Table, columns: tuple[str, ...], update: tuple[str, ...]
) -> str:
    quote = dialect.identifier_preparer.quote
    names = ", ".join(quote(c) for c in columns)
    keys = ", ".join(quote(c.name) for c in table.primary_key.columns)
    updates = ", ".join(f"{quote(c)} = EXCLUDED.{quote(c)}" for c in update)
    return (
        f"INSERT INTO {quote(table.name)} ({names})"  # noqa: S608 - names from the schema
        f" SELECT {names} FROM {quote('kmq_upsert_' + table.name)}"
        f" ON CONFLICT ({keys}) DO UPDATE SET {updates}"
    )


def _array_element_type(column_type: TypeEngine[Any], dialect: Dialect) -> str:
    """The column's type for an array cast, without its collation (``VARCHAR COLLATE "C"[]``
    is no type; stored values take the column's collation anyway)."""
    impl = column_type.dialect_impl(dialect)
    if isinstance(impl, String) and impl.collation is not None:
        impl = String(impl.length)
    return impl.compile(dialect=dialect)


@functools.lru_cache(maxsize=16)
def _unnest_upsert_sql(
    dialect: Dialect, table: Table, columns: tuple[str, ...], update: tuple[str, ...]
) -> str:
    """``INSERT (columns) SELECT * FROM unnest($1::type[], ...) ON CONFLICT ...`` (PostgreSQL).

    The rows must have distinct keys (a statement may not update one row twice).
    """
    # Every name comes from the schema (the models), quoted; values are parameters.
    quote = dialect.identifier_preparer.quote
    keys = ", ".join(quote(c.name) for c in table.primary_key.columns)
    updates = ", ".join(f"{quote(c)} = EXCLUDED.{quote(c)}" for c in update)
    return (
        f"INSERT INTO {quote(table.name)} ({', '.join(quote(c) for c in columns)})"  # noqa: S608
        f" SELECT * FROM {_unnest(dialect, table, columns)}"
        f" ON CONFLICT ({keys}) DO UPDATE SET {updates}"
    )


def _unnest(dialect: Dialect, table: Table, columns: Sequence[str]) -> str:
    """``unnest($1::type[], ...)``: rows of ``columns`` passed as one array per column
    (PostgreSQL)."""
    arrays = ", ".join(
        f"${i}::{_array_element_type(table.c[c].type, dialect)}[]" for i, c in enumerate(columns, 1)
    )
    return f"unnest({arrays})"


async def add_to_counters(
    conn: AsyncConnection,
    table: Table,
    columns: Sequence[str],
    counters: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
) -> None:
    """Add rows of deltas (tuples of ``columns``' values, distinct keys, in the order their
    rows should be locked) to the ``counters`` columns of ``table``; a missing row is created
    at the delta: ``INSERT ... ON CONFLICT (primary key) DO UPDATE SET c = c + excluded.c``.

    Every ingest flush and every redelivery round writes its counter deltas: one statement
    built once (:func:`_counters_sql`) and handed to the driver with plain tuples, as
    :func:`upsert_rows` does (a multi-row statement built per call was a sixth of a round's
    record).
    """
    if not rows:
        return
    sql = _counters_sql(conn.dialect, table, tuple(columns), tuple(counters))
    if conn.dialect.name == "sqlite":
        await conn.exec_driver_sql(sql, list(rows))
        return
    await conn.exec_driver_sql(sql, tuple(list(values) for values in zip(*rows, strict=True)))


@functools.lru_cache(maxsize=16)
def _counters_sql(
    dialect: Dialect, table: Table, columns: tuple[str, ...], counters: tuple[str, ...]
) -> str:
    """:func:`add_to_counters`'s statement: one row of ``?`` parameters (SQLite, run per row
    by ``executemany``), or every row at once as one array per column (PostgreSQL)."""
    # Every name comes from the schema (the models), quoted; values are parameters.
    quote = dialect.identifier_preparer.quote
    name = quote(table.name)
    keys = ", ".join(quote(c.name) for c in table.primary_key.columns)
    added = ", ".join(f"{quote(c)} = {name}.{quote(c)} + excluded.{quote(c)}" for c in counters)
    if dialect.name == "sqlite":
        rows = f"VALUES ({', '.join('?' for _ in columns)})"
    else:
        rows = f"SELECT * FROM {_unnest(dialect, table, columns)}"  # noqa: S608
    return (
        f"INSERT INTO {name} ({', '.join(quote(c) for c in columns)}) {rows}"
        f" ON CONFLICT ({keys}) DO UPDATE SET {added}"
    )


def insert_ignore(engine: AsyncEngine, table: Table, rows: Sequence[dict[str, Any]]) -> Insert:
    """``INSERT rows ... ON CONFLICT DO NOTHING``."""
    if is_sqlite(engine):
        return sqlite_insert(table).values(list(rows)).on_conflict_do_nothing()
    return pg_insert(table).values(list(rows)).on_conflict_do_nothing()


def keys_in(
    engine: AsyncEngine, columns: Sequence[ColumnElement[Any]], keys: Sequence[Sequence[Any]]
) -> ColumnElement[bool]:
    """``(columns) IN keys`` for many composite keys.

    PostgreSQL gets the keys as one array per column, unnested into a set the planner can
    hash-join (a literal list of row values becomes a long OR chain there). SQLite is the
    other way round: it scans the whole table for ``(a, b, c, d) IN (VALUES ...)`` (420 ms for
    1,000 keys at 1M rows). There the keys are grouped by all but their last column, and each
    group becomes ``a = ? AND b = ? AND c = ? AND d IN (...)``, one primary-key search per key
    (4 ms), with few terms to compile (a flush names few topic-partitions; an OR of one term
    per key cost 50 ms of SQLAlchemy compilation per 500 keys). Its parser refuses expressions
    deeper than 1,000, so at most ``SQLITE_MAX_KEYS`` groups go into one query (callers chunk
    long key lists anyway).
    """
    if not keys:
        return tuple_(*columns).in_([])
    if is_sqlite(engine):
        *prefix_columns, last = columns
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for key in keys:
            groups.setdefault(tuple(key[:-1]), []).append(key[-1])
        if len(groups) > SQLITE_MAX_KEYS:
            raise ValueError(
                f"{len(groups)} key groups in one SQLite query; chunk to {SQLITE_MAX_KEYS}"
            )
        return or_(
            *(
                and_(
                    *(c == v for c, v in zip(prefix_columns, prefix, strict=True)), last.in_(values)
                )
                for prefix, values in groups.items()
            )
        )
    return _pg_keys_in(columns, keys)


def _pg_keys_in(
    columns: Sequence[ColumnElement[Any]], keys: Sequence[Sequence[Any]]
) -> ColumnElement[bool]:
    arrays = []
    for i, column in enumerate(columns):
        values = [key[i] for key in keys]
        arrays.append(bindparam(f"keys_{i}", values, type_=ARRAY(column.type)))
    names = [f"k{i}" for i in range(len(columns))]
    rows = func.unnest(*arrays).table_valued(*names).render_derived()
    return tuple_(*columns).in_(select(*rows.c))


async def driver_rows(
    conn: AsyncConnection, stmt: Select[Any] | Update | Delete, params: dict[str, Any]
) -> list[Sequence[Any]]:
    """Run ``stmt`` on the driver itself; the rows as the driver returns them.

    For the hot paths that read thousands of rows by position (a redelivery claim): through
    SQLAlchemy every row went through its result machinery (a fifth of a burst round's claim);
    sqlite3 and asyncpg build their rows in C. No type processing: the columns must be plain
    ``str``, ``int``, ``bytes`` or ``None`` on both drivers (booleans come back as ``int`` on
    SQLite).
    """
    sql, names, defaults = _driver_sql(conn.dialect, stmt)
    args = [params[name] if name in params else defaults[name] for name in names]
    raw = await conn.get_raw_connection()
    driver: Any = raw.driver_connection
    if conn.dialect.name != "sqlite" and not driver.is_in_transaction():
        # SQLAlchemy's asyncpg adapter sends BEGIN with the first statement it runs itself:
        # one sent past it first would run on its own (autocommit), and a row lock it takes
        # would end with it. The transaction's first statement goes through SQLAlchemy.
        return list((await conn.exec_driver_sql(sql, tuple(args))).all())
    try:
        if conn.dialect.name == "sqlite":
            return list(await driver.execute_fetchall(sql, args))
        return list(await driver.fetch(sql, *args))
    except (sqlite3.Error, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise _driver_error(exc) from exc


@functools.lru_cache(maxsize=256)
def _driver_sql(
    dialect: Dialect, stmt: Select[Any] | Update | Delete
) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """The driver's SQL for ``stmt``, its parameters' names in positional order and the
    values of those the statement sets itself (literals SQLAlchemy turned into parameters)."""
    compiled = stmt.compile(dialect=dialect)
    names = compiled.positiontup
    if names is None:
        raise AssertionError(f"{dialect.name}: expected a positional parameter style")
    if dialect.name != "sqlite":
        # $n placeholders name each parameter once, however often the statement uses it.
        names = list(dict.fromkeys(names))
    return compiled.string, tuple(names), dict(compiled.params)


async def mark_claimed(
    conn: AsyncConnection,
    table: Table,
    rows: Sequence[Sequence[Any]],
    *,
    token: str,
    due_at_ms: int,
) -> None:
    """SQLite: set ``claim_token`` and ``due_at_ms`` on the claimed ``rows`` in one statement.

    The rows end with their ``rowid`` (see :func:`rowid_column`), passed as one JSON array
    (``json_each``): the cheapest way to name a thousand rows there. (PostgreSQL claims in
    one ``UPDATE .. FROM .. RETURNING`` instead, which SQLite cannot: its ``RETURNING`` may
    not name the ``FROM`` rows, i.e. the values before the update.)
    """
    if not rows:
        return
    ids = json.dumps([row[-1] for row in rows])
    await conn.exec_driver_sql(
        f"UPDATE {table.name} SET claim_token = ?, due_at_ms = ?"  # noqa: S608 - schema names
        " WHERE rowid IN (SELECT value FROM json_each(?))",
        (token, due_at_ms, ids),
    )


def rowid_column(dialect_name: str) -> list[ColumnElement[Any]]:
    """``[rowid]`` on SQLite (the claim marks rows by it), nothing on PostgreSQL."""
    return [literal_column("rowid")] if dialect_name == "sqlite" else []


def max_bind_rows(engine: AsyncEngine, columns: int) -> int:
    """How many rows one multi-row statement may carry within the driver's parameter limit."""
    limit = SQLITE_MAX_PARAMETERS if is_sqlite(engine) else 32_767
    return max(1, limit // max(1, columns))
