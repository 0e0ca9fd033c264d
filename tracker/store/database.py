"""The SQL store's connection to its database: the engine, one transaction per call, and
driver errors translated into the store's own.

:class:`SqlDatabase` is the base of every part of the SQL store (``tracker.store.manager``):
ownership, applying markers, claiming due entries; the admin side's queries borrow a store's.
They all go through :meth:`SqlDatabase.transaction` or, for a unit of work that only reads,
:meth:`SqlDatabase.read`, so a driver error never leaks: it becomes :class:`StoreUnavailable`
(retry later); our own errors (:class:`Fenced`, ...) pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Self, TypeVar

from sqlalchemy import Connection, Engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracker.errors import KmqError

from .dialects import (
    SQLITE_READ_THREADS,
    create_engine,
    is_sqlite,
    read_engine,
    sqlite_read_engine,
)
from .store_errors import StoreUnavailable
from .tables import KEY_CHUNK

T = TypeVar("T")

#: What :meth:`SqlDatabase.read` runs: synchronous SQLAlchemy Core on one connection.
ReadWork = Callable[[Connection], T]


class SqlDatabase:
    """An engine, its read-only twin, and (on SQLite) this process's writer queue."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        #: the same pool, for transactions that only read (they never wait for SQLite's writer)
        self.read_engine = read_engine(engine)
        #: SQLite has one writer at a time. Writers of this process queue here, in order, and
        #: are handed the database the moment the previous one commits; left to SQLite's busy
        #: handler, a waiting writer polls with sleeps of up to 100 ms (a redelivery round's
        #: record waited 150 ms for a 25 ms claim). Other processes still wait on the busy
        #: timeout.
        self._writer: asyncio.Lock | None = asyncio.Lock() if is_sqlite(engine) else None
        #: SQLite file: :meth:`read`'s engine and threads (both connect and start lazily)
        self._sync_reads: tuple[Engine, ThreadPoolExecutor] | None = None
        sync_read_engine = sqlite_read_engine(engine)
        if sync_read_engine is not None:
            threads = ThreadPoolExecutor(SQLITE_READ_THREADS, thread_name_prefix="kmq-sqlite-read")
            self._sync_reads = (sync_read_engine, threads)

    @classmethod
    def from_url(cls, url: str, *, echo: bool = False) -> Self:
        return cls(create_engine(url, echo=echo))

    @property
    def is_sqlite(self) -> bool:
        return is_sqlite(self.engine)

    @property
    def _key_chunk(self) -> int:
        """Keys per :func:`keys_in` statement (PostgreSQL takes them as arrays: more)."""
        return KEY_CHUNK if self.is_sqlite else 10 * KEY_CHUNK

    async def close(self) -> None:
        if self._sync_reads is not None:
            reads, threads = self._sync_reads
            self._sync_reads = None
            await asyncio.to_thread(threads.shutdown)
            reads.dispose()
        await self.engine.dispose()

    @contextlib.asynccontextmanager
    async def transaction(
        self,
        *,
        read_only: bool = False,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> AsyncIterator[AsyncConnection]:
        """One transaction, with driver errors translated to :class:`StoreUnavailable`.

        ``read_only`` transactions never wait for SQLite's write lock (see
        :func:`~tracker.store.dialects.read_engine`). Our own errors (``Fenced``,
        ``StoreUnavailable``, ...) and the driver errors named in ``passthrough`` (the admin
        store's unique-key races, which its callers resolve) pass through untranslated.
        """
        engine = self.read_engine if read_only else self.engine
        writer = None if read_only else self._writer
        with _driver_errors_translated(passthrough):
            async with writer or contextlib.nullcontext(), engine.begin() as connection:
                yield connection

    async def read(self, work: ReadWork[T]) -> T:
        """``work(connection)`` in one transaction that only reads; what it returns.

        ``work`` is synchronous SQLAlchemy Core, so that a whole unit of work (a listing's two
        queries and the rows it builds) runs at once: on a SQLite file, on a read thread with
        a connection of its own (:func:`~tracker.store.dialects.sqlite_read_engine`: one
        hand-off instead of one per driver call, and the event loop stays free while SQLite
        works); elsewhere, on the async engine's connection (PostgreSQL's driver is async
        itself). Driver errors become :class:`StoreUnavailable`, as in :meth:`transaction`.
        """
        if self._sync_reads is None:
            async with self.transaction(read_only=True) as conn:
                return await conn.run_sync(work)
        reads, threads = self._sync_reads

        def in_thread() -> T:
            with reads.connect() as connection:
                try:
                    with connection.begin():
                        return work(connection)
                except SQLAlchemyError:
                    # A read keeps nothing worth a connection the driver failed on (a file
                    # that was replaced, a disk error): the next read opens a new one.
                    connection.invalidate()
                    raise

        with _driver_errors_translated():
            return await asyncio.get_running_loop().run_in_executor(threads, in_thread)

    async def ping(self) -> None:
        """Raise :class:`StoreUnavailable` unless the database answers."""
        async with self.transaction() as conn:
            await conn.execute(select(1))


@contextlib.contextmanager
def _driver_errors_translated(
    passthrough: tuple[type[BaseException], ...] = (),
) -> Iterator[None]:
    """Driver errors raised inside become :class:`StoreUnavailable`; our own errors and
    those named in ``passthrough`` go through as they are."""
    try:
        yield
    except KmqError:
        raise
    except passthrough:
        raise
    except (SQLAlchemyError, OSError, ConnectionError) as exc:
        raise StoreUnavailable(f"database error: {type(exc).__name__}: {exc}") from exc
