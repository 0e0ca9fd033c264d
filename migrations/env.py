"""Alembic environment: async engines, URL from the caller or from the tracker's settings."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from tracker.store.dialects import create_engine
from tracker.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        compare_server_default=True,
    )


def _run_sync(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


def _database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from tracker.settings_loading import load_settings  # noqa: PLC0415 - only when no URL was given

    return load_settings().database_url


async def _run_online() -> None:
    engine = create_engine(_database_url())
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run_sync)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    # Called from the tracker (tracker.store.migrate) with a connection it opened.
    _run_sync(config.attributes["connection"])
else:
    # Called from the alembic command line.
    asyncio.run(_run_online())
