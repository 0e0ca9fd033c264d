"""Helpers for the admin API tests: an app on a real store and broker, an HTTP client, data.

Tests talk to the app through HTTP (``httpx.AsyncClient`` with an ASGI transport): the app
runs in the test's event loop, with a standalone :class:`ApiContext` (its own store and Kafka
clients). Rows are written to the store directly (the engine is not needed to have tracked
messages or dead letters to look at); records on Kafka are produced for real.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiokafka import AIOKafkaProducer
from sqlalchemy import delete
from support.counts import assert_counters_match

from api.app import create_app
from api.context import ApiContext
from tracker.domain.entries import Entry, State
from tracker.runtime import standalone_api_context
from tracker.settings import TrackerSettings
from tracker.store.admin_reads import actions_table, items_table, jobs_table
from tracker.store.counts import CountChanges
from tracker.store.tables import (
    console_logouts,
    dead_letters,
    partitions_table,
    ranges_table,
    tracked,
    tracked_counts,
)

from .engine_support import tracker_settings

ADMIN_TOKEN = "admin-token-for-tests"  # noqa: S105 - a test fixture, not a secret
READ_TOKEN = "read-token-for-tests"  # noqa: S105
T0 = 1_800_000_000_000  # a reference time (ms), in 2027


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def api_settings(
    bootstrap: str, database_url: str, markers_topic: str, **overrides: Any
) -> TrackerSettings:
    values: dict[str, Any] = {"api_token": ADMIN_TOKEN, "api_read_token": READ_TOKEN}
    values.update(overrides)
    return tracker_settings(bootstrap, database_url, markers_topic, **values)


async def reset_tables(context: ApiContext) -> None:
    """Empty every table (the PostgreSQL database is shared by the whole session)."""
    async with context.store.engine.begin() as conn:
        for table in (
            items_table,
            jobs_table,
            actions_table,
            tracked,
            ranges_table,
            tracked_counts,
            partitions_table,
            dead_letters,
            console_logouts,
        ):
            await conn.execute(delete(table))


@dataclass
class ApiEnv:
    """A running app and what a test needs around it."""

    bootstrap: str
    markers: str
    settings: TrackerSettings
    context: ApiContext
    client: httpx.AsyncClient  #: sends the admin token
    anonymous: httpx.AsyncClient  #: sends no token
    extra: list[httpx.AsyncClient] = field(default_factory=list)

    @property
    def store(self) -> Any:
        return self.context.store

    def client_with(self, headers: dict[str, str]) -> httpx.AsyncClient:
        client = client_for(self.client._transport, headers)
        self.extra.append(client)
        return client


def client_for(transport: Any, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport, base_url="http://kmq.test", headers=headers)


@contextlib.asynccontextmanager
async def api_env(
    bootstrap: str, database_url: str, markers: str, **overrides: Any
) -> AsyncIterator[ApiEnv]:
    settings = api_settings(bootstrap, database_url, markers, **overrides)
    context = await standalone_api_context(settings, run_redrive=False)
    try:
        await reset_tables(context)
        transport = httpx.ASGITransport(app=create_app(context))
        env = ApiEnv(
            bootstrap=bootstrap,
            markers=markers,
            settings=settings,
            context=context,
            client=client_for(transport, bearer(ADMIN_TOKEN)),
            anonymous=client_for(transport),
        )
        try:
            yield env
        finally:
            for client in (env.client, env.anonymous, *env.extra):
                await client.aclose()
        await assert_counters_match(context.store.engine)
    finally:
        await context.close()


def entry(
    offset: int,
    *,
    topic: str = "orders",
    partition: int = 0,
    group: str = "billing",
    state: State = State.IN_FLIGHT,
    due_at_ms: int | None = T0 + 60_000,
    attempt: int = 1,
    markers_partition: int = 0,
    copy: tuple[str, int, int] | None = None,
    reason: str = "",
    claim_token: str | None = None,
) -> Entry:
    copy_topic, copy_partition, copy_offset = copy or (topic, partition, offset)
    return Entry(
        group_id=group,
        origin_topic=topic,
        origin_partition=partition,
        origin_offset=offset,
        markers_partition=markers_partition,
        state=state,
        attempt=attempt,
        copy_topic=copy_topic,
        copy_partition=copy_partition,
        copy_offset=copy_offset,
        due_at_ms=None if state is State.LOST else due_at_ms,
        first_seen_ms=T0 - 1000 * offset,
        updated_ms=T0,
        consumer="worker-1",
        reason=reason,
        claim_token=claim_token,
    )


async def insert_entries(context: ApiContext, entries: Sequence[Entry]) -> None:
    rows = []
    for e in entries:
        row = {
            name: getattr(e, name)
            for name in (
                "group_id",
                "origin_topic",
                "origin_partition",
                "origin_offset",
                "markers_partition",
                "attempt",
                "copy_topic",
                "copy_partition",
                "copy_offset",
                "due_at_ms",
                "first_seen_ms",
                "updated_ms",
                "deferred",
                "consumer",
                "reason",
                "keep_payload",
                "claim_token",
            )
        }
        row["state"] = e.state.value
        rows.append(row)
    counts = CountChanges()
    for e in entries:
        counts.change(None, e)
    async with context.store.engine.begin() as conn:
        await conn.execute(tracked.insert(), rows)
        await counts.write(conn, tracked_counts)


async def insert_dead_letters(context: ApiContext, rows: Sequence[dict[str, Any]]) -> list[int]:
    """Insert dead-letter rows (defaults filled in); returns their ids in order."""
    ids = []
    async with context.store.engine.begin() as conn:
        for given in rows:
            row: dict[str, Any] = {
                "group_id": "billing",
                "origin_topic": "orders",
                "origin_partition": 0,
                "origin_offset": 0,
                "source_topic": "orders",
                "source_partition": 0,
                "source_offset": 0,
                "dlq_topic": "orders.dlq",
                "dlq_partition": 0,
                "dlq_offset": 0,
                "reason": "max attempts reached",
                "last_error": "",
                "attempts": 5,
                "first_seen_ms": T0 - 60_000,
                "dead_lettered_ms": T0,
                "message_key": None,
                "redriven_ms": None,
            }
            row.update(given)
            result = await conn.execute(dead_letters.insert().values(**row))
            ids.append(int((result.inserted_primary_key or (0,))[0]))
    return ids


Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


async def produce(
    bootstrap: str, topic: str, records: Sequence[Record], *, partition: int | None = 0
) -> list[tuple[int, int]]:
    """Produce ``(key, value, headers)`` records; returns each one's (partition, offset)."""
    async with AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5) as producer:
        futures = [
            await producer.send(topic, value=value, key=key, headers=headers, partition=partition)
            for key, value, headers in records
        ]
        out = []
        for future in futures:
            metadata = await future
            out.append((metadata.partition, metadata.offset))
        return out
