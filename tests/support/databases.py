"""Throwaway databases for the integration tests: a fresh Postgres database, SQLite files.

Postgres: by default the server on 127.0.0.1:5432 with trust auth is used (user ``postgres`` or
``root``, maintenance database ``postgres`` or ``test``, whichever answers first). Set
``KMQ_TEST_POSTGRES_URL`` to a server URL (``postgresql://user:password@host:port/maintenance_db``,
``postgresql+asyncpg://`` also accepted) to use another server. A missing Postgres is an error,
never a skip: the store must be tested on both backends. See docs/testing.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from sqlalchemy import text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import NullPool

T = TypeVar("T")

#: Environment variable naming the Postgres server to use instead of the local default.
POSTGRES_URL_ENV = "KMQ_TEST_POSTGRES_URL"

#: Servers tried, in order, when ``KMQ_TEST_POSTGRES_URL`` is not set.
DEFAULT_POSTGRES_CANDIDATES = (
    "postgresql://postgres@127.0.0.1:5432/postgres",
    "postgresql://postgres@127.0.0.1:5432/test",
    "postgresql://root@127.0.0.1:5432/postgres",
    "postgresql://root@127.0.0.1:5432/test",
)

DATABASE_PREFIX = "kmq_test"
_CONNECT_TIMEOUT = 5.0
_ASYNC_DRIVER = "postgresql+asyncpg"


class PostgresUnavailableError(RuntimeError):
    """No usable Postgres server: the message says what was tried and how to fix it."""


def _run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``factory()`` on a private event loop in a worker thread (safe inside a running loop)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def sqlite_url(path: Path) -> str:
    """Async SQLAlchemy URL for a SQLite file: ``sqlite+aiosqlite:///<absolute path>``."""
    return f"sqlite+aiosqlite:///{path.resolve()}"


@dataclass(frozen=True)
class PostgresServer:
    """A reachable Postgres server and the maintenance database used to create/drop databases."""

    url: URL  # points at the maintenance database

    @contextlib.asynccontextmanager
    async def admin_connection(self) -> AsyncIterator[AsyncConnection]:
        """An autocommit connection to the maintenance database (CREATE/DROP DATABASE)."""
        engine = create_async_engine(
            self.url.set(drivername=_ASYNC_DRIVER),
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={"timeout": _CONNECT_TIMEOUT},
        )
        try:
            async with engine.connect() as connection:
                yield connection
        finally:
            await engine.dispose()

    def database_url(self, database: str, *, driver: str = _ASYNC_DRIVER) -> str:
        """SQLAlchemy URL (async ``asyncpg`` driver by default) for ``database`` on this server."""
        return self.url.set(drivername=driver, database=database).render_as_string(
            hide_password=False
        )

    def describe(self) -> str:
        return self.url.render_as_string(hide_password=True)


def _parse_server_url(raw: str) -> URL:
    try:
        url = make_url(raw)
    except ArgumentError as exc:
        raise PostgresUnavailableError(f"{POSTGRES_URL_ENV}={raw!r} is not a URL: {exc}") from exc
    if url.get_backend_name() != "postgresql":
        raise PostgresUnavailableError(
            f"{POSTGRES_URL_ENV} must be a postgresql:// URL, got {url.drivername!r}"
        )
    return url.set(drivername="postgresql", database=url.database or "postgres")


async def find_postgres_server(url: str | None = None) -> PostgresServer:
    """The first candidate server that accepts a connection and may create databases.

    ``url`` (else ``$KMQ_TEST_POSTGRES_URL``) names one server; without either, the local
    defaults in ``DEFAULT_POSTGRES_CANDIDATES`` are tried in order.
    """
    raw = url if url is not None else os.environ.get(POSTGRES_URL_ENV, "").strip()
    if raw:
        candidates = [_parse_server_url(raw)]
        source = f"from {POSTGRES_URL_ENV}"
    else:
        candidates = [make_url(candidate) for candidate in DEFAULT_POSTGRES_CANDIDATES]
        source = f"the local defaults ({POSTGRES_URL_ENV} is not set)"
    failures: list[str] = []
    for candidate in candidates:
        server = PostgresServer(candidate)
        try:
            async with server.admin_connection() as connection:
                may_create = await connection.scalar(
                    text(
                        "SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user"
                    )
                )
        except (OSError, TimeoutError, DBAPIError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else ""
            failures.append(f"  {server.describe()}: {type(exc).__name__}: {reason}")
            continue
        if may_create:
            return server
        failures.append(f"  {server.describe()}: connected, but the role may not CREATE DATABASE")
    tried = "\n".join(failures)
    raise PostgresUnavailableError(
        "The integration tests need a Postgres server, and none was usable "
        f"(tried {source}):\n{tried}\n"
        "Start Postgres on 127.0.0.1:5432 with trust auth for user 'postgres' or 'root', or set "
        f"{POSTGRES_URL_ENV}=postgresql://USER:PASSWORD@HOST:PORT/MAINTENANCE_DB "
        "(a role allowed to create databases)."
    )


async def create_database(
    server: PostgresServer, prefix: str = DATABASE_PREFIX, options: str = ""
) -> str:
    """Create an empty database named ``<prefix>_<random hex>`` and return its name.

    ``options`` follow the name in ``CREATE DATABASE`` (e.g. another collation).
    """
    name = f"{prefix}_{secrets.token_hex(6)}"
    async with server.admin_connection() as connection:
        await connection.execute(text(f"CREATE DATABASE {_quote_ident(name)} {options}"))
    return name


async def drop_database(server: PostgresServer, name: str) -> None:
    """Drop ``name``, first terminating any connections still open on it (leaked pools...)."""
    async with server.admin_connection() as connection:
        await connection.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :name AND pid <> pg_backend_pid()"
            ),
            {"name": name},
        )
        version = connection.dialect.server_version_info or (0,)
        force = " WITH (FORCE)" if version >= (13,) else ""
        await connection.execute(text(f"DROP DATABASE IF EXISTS {_quote_ident(name)}{force}"))


class PostgresTestDatabase:
    """A fresh database on the test Postgres server, dropped again by ``drop()``/``__exit__``.

    Synchronous on purpose (the work runs on a private loop in a worker thread), so it can back
    a session-scoped fixture regardless of which event loop the tests use.
    """

    def __init__(
        self, server_url: str | None = None, *, prefix: str = DATABASE_PREFIX, options: str = ""
    ) -> None:
        self._server_url = server_url
        self._prefix = prefix
        self._options = options
        self.server: PostgresServer | None = None
        self.name: str | None = None

    @property
    def url(self) -> str:
        """``postgresql+asyncpg://...`` URL of the database (after ``create()``)."""
        if self.server is None or self.name is None:
            raise RuntimeError("create() the database first")
        return self.server.database_url(self.name)

    def create(self) -> str:
        """Find the server, create the database, return its async SQLAlchemy URL."""

        async def create() -> tuple[PostgresServer, str]:
            server = await find_postgres_server(self._server_url)
            return server, await create_database(server, self._prefix, self._options)

        self.server, self.name = _run_sync(create)
        return self.url

    def drop(self) -> None:
        """Drop the database (idempotent)."""
        server, name = self.server, self.name
        if server is None or name is None:
            return
        self.name = None
        _run_sync(lambda: drop_database(server, name))

    def __enter__(self) -> Self:
        self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.drop()
