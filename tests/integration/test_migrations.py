"""The Alembic migrations against the models, on fresh SQLite and Postgres databases.

Each test starts from an empty database of its own (a temp SQLite file, or an empty Postgres
database created for the test, ``empty_postgres_url``, not the migrated copy other tests get).
"""

from __future__ import annotations

import pprint
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.schema import DefaultClause
from sqlalchemy.sql.elements import TextClause
from support.counts import counters_and_recount
from support.databases import sqlite_url as make_sqlite_url

from tracker.store.dialects import create_engine
from tracker.store.migrate import (
    alembic_config,
    check_schema,
    current_revision,
    head_revision,
    upgrade,
)
from tracker.store.models import Base
from tracker.store.store_errors import SchemaOutdated
from tracker.store.tables import (
    dead_letters,
    markers_topic_binding,
    partitions_table,
    ranges_table,
    tracked,
)

pytestmark = [pytest.mark.integration]

TABLES = {"tracked_messages", "markers_partitions", "dead_letters"}

#: An entry row as every revision since 0002 stores it, but for its key, state and partition.
ENTRY = {
    "origin_partition": 0,
    "attempt": 1,
    "copy_topic": "orders",
    "copy_partition": 0,
    "copy_offset": 0,
    "due_at_ms": 1,
    "first_seen_ms": 1,
    "updated_ms": 1,
}

#: A dead-letter row as every revision since 0002 stores it, but for its group and offset.
DEAD_LETTER = {
    "origin_topic": "orders",
    "origin_partition": 0,
    "source_topic": "orders",
    "source_partition": 0,
    "source_offset": 0,
    "dlq_topic": "orders.dlq",
    "dlq_partition": 0,
    "dlq_offset": 0,
    "reason": "r",
    "attempts": 3,
    "first_seen_ms": 1,
    "dead_lettered_ms": 2,
}


@pytest.fixture(params=["sqlite", "postgres"], ids=["sqlite", "postgres"])
def fresh_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An async URL of an empty database (no schema) that only this test uses."""
    if request.param == "sqlite":
        return make_sqlite_url(tmp_path / "fresh.sqlite3")
    url = request.getfixturevalue("empty_postgres_url")
    assert isinstance(url, str)
    return url


@pytest.fixture
async def engine(fresh_database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(fresh_database_url)
    try:
        yield engine
    finally:
        await engine.dispose()


def _readable(value: Any) -> Any:
    """Diff items with server defaults shown as the SQL they stand for."""
    if isinstance(value, DefaultClause):
        arg = value.arg
        return f"DefaultClause({arg.text if isinstance(arg, TextClause) else arg!r})"
    if isinstance(value, (list, tuple)):
        return type(value)(_readable(item) for item in value)
    return value


def format_diff(diff: list[Any]) -> str:
    return pprint.pformat(_readable(diff), width=100)


def _diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(
        connection, opts={"compare_type": True, "compare_server_default": True}
    )
    return list(compare_metadata(context, Base.metadata))


async def schema_diff(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        return await conn.run_sync(_diff)


def _snapshot(connection: Connection) -> dict[str, Any]:
    inspector = inspect(connection)
    return {
        table: {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], c["default"])
                for c in inspector.get_columns(table)
            ],
            "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
            "indexes": sorted(
                (i["name"] or "", tuple(i["column_names"]), bool(i["unique"]))
                for i in inspector.get_indexes(table)
            ),
        }
        for table in sorted(inspector.get_table_names())
    }


async def schema_snapshot(engine: AsyncEngine) -> dict[str, Any]:
    """The reflected schema: tables, columns (type, nullability, default), keys, indexes."""
    async with engine.connect() as conn:
        return await conn.run_sync(_snapshot)


async def table_names(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


def _downgrade(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.downgrade(config, revision)


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(_downgrade, revision)


async def test_upgrade_head_matches_the_models(engine: AsyncEngine) -> None:
    assert await table_names(engine) == set()
    await upgrade(engine)
    assert await table_names(engine) >= TABLES
    diff = await schema_diff(engine)
    assert diff == [], "migrations differ from the models:\n" + format_diff(diff)


async def test_check_schema_fails_on_an_empty_database_and_passes_after_upgrade(
    engine: AsyncEngine,
) -> None:
    assert await current_revision(engine) is None
    with pytest.raises(SchemaOutdated, match="kmq-tracker migrate"):
        await check_schema(engine)
    await upgrade(engine)
    await check_schema(engine)
    assert await current_revision(engine) == head_revision()


async def test_upgrade_is_idempotent(engine: AsyncEngine) -> None:
    await upgrade(engine)
    await upgrade(engine)
    assert await current_revision(engine) == head_revision()
    await check_schema(engine)


async def test_downgrade_to_base_then_upgrade_again(engine: AsyncEngine) -> None:
    await upgrade(engine)
    first = await schema_snapshot(engine)
    assert set(first) >= TABLES

    await downgrade(engine, "base")
    assert await current_revision(engine) is None
    assert not (TABLES & await table_names(engine))
    with pytest.raises(SchemaOutdated):
        await check_schema(engine)

    await upgrade(engine)
    assert await current_revision(engine) == head_revision()
    await check_schema(engine)
    assert await schema_snapshot(engine) == first


async def test_upgrade_to_0003_counts_the_rows_already_there(engine: AsyncEngine) -> None:
    """A store upgraded with entries and dead letters in it starts with correct counters,
    and the dead letters' triggers keep theirs from then on."""
    await upgrade(engine, "0002")
    entries = [
        {
            **ENTRY,
            "group_id": "g",
            "origin_topic": topic,
            "origin_offset": i,
            "markers_partition": p,
            "state": s,
        }
        for i, (topic, p, s) in enumerate(
            [
                ("orders", 0, "in_flight"),
                ("orders", 0, "in_flight"),
                ("orders", 1, "delayed"),
                ("audit", 2, "lost"),
            ]
        )
    ]
    letter = {**DEAD_LETTER, "group_id": "g", "origin_offset": 0}
    letters = [{**letter, "redriven_ms": None}, {**letter, "redriven_ms": 5}]
    async with engine.begin() as conn:
        await conn.execute(tracked.insert(), entries)
        await conn.execute(dead_letters.insert(), letters)
    await upgrade(engine)

    kept, recount = await counters_and_recount(engine)
    assert kept == recount
    assert kept == (
        {
            (0, "orders", "g", "in_flight"): 2,
            (1, "orders", "g", "delayed"): 1,
            (2, "audit", "g", "lost"): 1,
        },
        {("orders", "g"): (2, 1)},
    )
    # Dead letters are counted by triggers from then on, whoever writes them.
    async with engine.begin() as conn:
        await conn.execute(dead_letters.update().values(redriven_ms=9))
        await conn.execute(dead_letters.insert(), letters[:1])
    kept, recount = await counters_and_recount(engine)
    assert kept == recount
    assert kept[1] == {("orders", "g"): (3, 1)}
    async with engine.begin() as conn:
        await conn.execute(dead_letters.delete().where(dead_letters.c.redriven_ms.is_(None)))
    kept, recount = await counters_and_recount(engine)
    assert kept == recount
    assert kept[1] == {("orders", "g"): (2, 0)}


async def test_upgrade_to_0008_counts_each_group_and_downgrade_adds_them_up(
    engine: AsyncEngine,
) -> None:
    """A store upgraded with the entries, ranges and dead letters of two groups on one topic
    starts with per-group counters that match its rows, and its triggers keep the dead
    letters' per group; a downgrade gives back the per-topic counters and triggers."""
    await upgrade(engine, "0007")
    entries = [
        {
            **ENTRY,
            "group_id": group,
            "origin_topic": "orders",
            "origin_offset": i,
            "markers_partition": 0,
            "state": state,
        }
        for i, (group, state) in enumerate(
            [("billing", "in_flight"), ("billing", "delayed"), ("audit", "delayed")]
        )
    ]
    tracked_range = {
        "group_id": "audit",
        "origin_topic": "orders",
        "origin_partition": 0,
        "first_offset": 10,
        "last_offset": 14,
        "markers_partition": 0,
        "open_bits": bytes([0b10111]),
        "open_count": 4,
        "due_at_ms": 1,
        "first_seen_ms": 1,
        "updated_ms": 1,
    }
    letters = [
        {**DEAD_LETTER, "group_id": group, "origin_offset": 20 + i, "redriven_ms": redriven}
        for i, (group, redriven) in enumerate([("billing", None), ("audit", None), ("audit", 5)])
    ]
    async with engine.begin() as conn:
        await conn.execute(tracked.insert(), entries)
        await conn.execute(ranges_table.insert(), [tracked_range])
        await conn.execute(dead_letters.insert(), letters)
    await upgrade(engine)

    kept, recount = await counters_and_recount(engine)
    assert kept == recount
    assert kept == (
        {
            (0, "orders", "billing", "in_flight"): 1,
            (0, "orders", "billing", "delayed"): 1,
            (0, "orders", "audit", "delayed"): 1,
            (0, "orders", "audit", "in_flight"): 4,
        },
        {("orders", "billing"): (1, 1), ("orders", "audit"): (2, 1)},
    )
    # The triggers count each group from then on, on both engines.
    async with engine.begin() as conn:
        await conn.execute(dead_letters.update().values(redriven_ms=9))
        await conn.execute(dead_letters.insert(), letters[:1])
        await conn.execute(dead_letters.delete().where(dead_letters.c.group_id == "audit"))
    kept, recount = await counters_and_recount(engine)
    assert kept == recount
    assert kept[1] == {("orders", "billing"): (2, 1)}

    await downgrade(engine, "0007")
    async with engine.begin() as conn:
        await conn.execute(dead_letters.insert(), letters[1:2])  # the old triggers count it
        old = await conn.execute(
            text("SELECT markers_partition, origin_topic, state, entries FROM tracked_counts")
        )
        assert sorted(tuple(r) for r in old) == [
            (0, "orders", "delayed", 2),
            (0, "orders", "in_flight", 5),
        ]
        old = await conn.execute(
            text("SELECT origin_topic, total, waiting FROM dead_letter_counts")
        )
        assert [tuple(r) for r in old] == [("orders", 3, 2)]


def _partition_row(markers_topic: str, partition: int) -> dict[str, object]:
    return {
        "markers_topic": markers_topic,
        "partition": partition,
        "epoch": 1,
        "owner": None,
        "next_offset": 0,
        "updated_ms": 1,
    }


async def _binding(engine: AsyncEngine) -> list[tuple[str, str]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(markers_topic_binding.c.markers_topic, markers_topic_binding.c.bound_by)
        )
        return [(row[0], row[1]) for row in rows]


async def test_upgrade_to_0013_binds_a_database_to_the_one_markers_topic_it_served(
    engine: AsyncEngine,
) -> None:
    await upgrade(engine, "0012")
    async with engine.begin() as conn:
        rows = [_partition_row("orders-markers", p) for p in range(3)]
        await conn.execute(partitions_table.insert(), rows)
    await upgrade(engine)
    assert await _binding(engine) == [("orders-markers", "migration 0013")]


@pytest.mark.parametrize(
    "served", [[], ["orders-markers", "payments-markers"]], ids=["none", "two"]
)
async def test_upgrade_to_0013_leaves_a_database_that_served_none_or_several_unbound(
    engine: AsyncEngine, served: list[str]
) -> None:
    """Several: already misconfigured, and no topic to prefer; the first process to start
    binds it, and a process of the other topic is refused from then on."""
    await upgrade(engine, "0012")
    if served:
        async with engine.begin() as conn:
            await conn.execute(partitions_table.insert(), [_partition_row(t, 0) for t in served])
    await upgrade(engine)
    assert await _binding(engine) == []
    await downgrade(engine, "0012")
    assert "markers_topic_binding" not in await table_names(engine)
