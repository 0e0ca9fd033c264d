"""A database serves one markers topic (``tracker/store/topic_binding.py``), on SQLite and
PostgreSQL: the first process binds it, a process of another topic is refused and changes
nothing, two first binds at once leave exactly one topic, and an operator's rebind moves the
database only from the topic it serves.

The processes themselves (``kmq-tracker run``/``api`` refusing such a database in one line)
are in ``tests/reliability/test_bad_config.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from support.sql_stores import empty_sql_store

from tracker.store.database import SqlDatabase
from tracker.store.migrate import upgrade
from tracker.store.store_errors import NotBoundToMarkersTopic, ServesAnotherMarkersTopic
from tracker.store.topic_binding import (
    bind_markers_topic,
    bound_markers_topic,
    rebind_markers_topic,
)

pytestmark = [pytest.mark.integration]

ORDERS = "orders-markers"
PAYMENTS = "payments-markers"


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[SqlDatabase]:
    async with empty_sql_store(database_url) as store:
        yield store


async def test_the_first_bind_records_the_topic_and_binding_it_again_is_allowed(
    database: SqlDatabase,
) -> None:
    assert await bound_markers_topic(database) is None
    await bind_markers_topic(database, ORDERS, by="replica-a", now_ms=1)
    await bind_markers_topic(database, ORDERS, by="replica-b", now_ms=2)  # another replica
    assert await bound_markers_topic(database) == ORDERS


async def test_a_process_of_another_topic_is_refused_with_both_topics_and_the_way_out(
    database: SqlDatabase,
) -> None:
    await bind_markers_topic(database, ORDERS, by="replica-a", now_ms=1)
    with pytest.raises(ServesAnotherMarkersTopic) as refused:
        await bind_markers_topic(database, PAYMENTS, by="replica-x", now_ms=2)
    message = str(refused.value)
    for named in (ORDERS, PAYMENTS, "replica-a"):
        assert named in message
    assert f"kmq-tracker rebind-markers-topic --from {ORDERS}" in message
    assert "password" not in message
    assert await bound_markers_topic(database) == ORDERS


async def test_two_first_binds_at_once_leave_exactly_one_topic(database_url: str) -> None:
    databases = [SqlDatabase.from_url(database_url) for _ in range(2)]
    try:
        await upgrade(databases[0].engine)
        outcomes = await asyncio.gather(
            bind_markers_topic(databases[0], ORDERS, by="a", now_ms=1),
            bind_markers_topic(databases[1], PAYMENTS, by="b", now_ms=1),
            return_exceptions=True,
        )
        won = await bound_markers_topic(databases[0])
    finally:
        for database in databases:
            await database.close()
    assert won in (ORDERS, PAYMENTS)
    refused = [o for o in outcomes if isinstance(o, ServesAnotherMarkersTopic)]
    assert len(refused) == 1, outcomes
    assert outcomes.count(None) == 1, outcomes
    assert (refused[0].bound, refused[0].asked) == (won, ({ORDERS, PAYMENTS} - {won}).pop())


async def test_a_rebind_moves_the_database_only_from_the_topic_it_serves(
    database: SqlDatabase,
) -> None:
    await bind_markers_topic(database, ORDERS, by="replica-a", now_ms=1)
    with pytest.raises(NotBoundToMarkersTopic, match="nothing changed"):
        await rebind_markers_topic(database, "invoices-markers", PAYMENTS, by="op", now_ms=2)
    assert await bound_markers_topic(database) == ORDERS

    await rebind_markers_topic(database, ORDERS, PAYMENTS, by="op", now_ms=3)
    assert await bound_markers_topic(database) == PAYMENTS
    await bind_markers_topic(database, PAYMENTS, by="replica-b", now_ms=4)
    with pytest.raises(ServesAnotherMarkersTopic):
        await bind_markers_topic(database, ORDERS, by="replica-a", now_ms=5)


async def test_a_rebind_of_a_database_bound_to_nothing_binds_it(database: SqlDatabase) -> None:
    await rebind_markers_topic(database, ORDERS, PAYMENTS, by="op", now_ms=1)
    assert await bound_markers_topic(database) == PAYMENTS
