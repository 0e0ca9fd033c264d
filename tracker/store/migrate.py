"""Running the Alembic migrations from the tracker (``kmq-tracker migrate``, startup)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

import migrations

from .dialects import settle_failed_sqlite
from .store_errors import MigrationRefused, SchemaOutdated, StoreUnavailable

MIGRATIONS_DIR = Path(migrations.__file__).parent


@contextlib.asynccontextmanager
async def database_errors(engine: AsyncEngine) -> AsyncIterator[None]:
    """Turn a database that cannot be used at startup into one line naming it (no traceback)."""
    try:
        yield
    except (SQLAlchemyError, OSError) as exc:
        url = engine.url.render_as_string(hide_password=True)
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        await settle_failed_sqlite(engine)
        raise StoreUnavailable(f"cannot use the database {url}: {detail}") from exc


def alembic_config(url: str | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        config.set_main_option("sqlalchemy.url", url)
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package ships its migrations
        raise SchemaOutdated("no migrations found")
    return head


def _upgrade(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` (default: the latest).

    Raises :class:`MigrationRefused` when Alembic refuses the request itself (an unknown
    revision): a mistake to report in one line, not a traceback.
    """
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade, revision)
    except CommandError as exc:
        raise MigrationRefused(f"cannot migrate to {revision!r}: {exc}") from None


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_current)


async def check_schema(engine: AsyncEngine) -> None:
    """Raise :class:`SchemaOutdated` unless the database is at the head revision."""
    current = await current_revision(engine)
    head = head_revision()
    if current != head:
        raise SchemaOutdated(
            f"database schema is at {current or 'nothing'}, this tracker needs {head}: "
            "run `kmq-tracker migrate` (or set KMQ_MIGRATE_ON_START=true)"
        )
