"""Redrive jobs through HTTP with real runners: rate limit, crash recovery without duplicates,
dry runs, explicit ids, idempotency, cancellation, concurrent jobs. SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from support.broker import unique_topic

from tracker.engine.redrive_runner import RedriveRunner
from tracker.headers import REDRIVE_ITEM, REDRIVE_JOB
from tracker.store.redrive_leases import ProducedItem, RedriveLeaseStore
from tracker.store.tables import dead_letters

from .api_support import T0, ApiEnv, api_env, produce
from .engine_support import eventually

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def env(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> AsyncIterator[ApiEnv]:
    markers = await topic_factory(partitions=2, prefix="markers")
    async with api_env(kafka_bootstrap, database_url, markers) as env:
        yield env


def runner(env: ApiEnv, owner: str, **kw: Any) -> RedriveRunner:
    kw.setdefault("lease_seconds", 2.0)
    kw.setdefault("poll_interval", 0.05)
    return RedriveRunner(
        jobs=RedriveLeaseStore(env.context.store, env.context.settings.markers_topic),
        producer=env.context.producer,
        originals=env.context.originals,
        scanner=env.context.scanner,
        owner=owner,
        metrics=env.context.metrics,
        **kw,
    )


@contextlib.asynccontextmanager
async def running(r: RedriveRunner) -> AsyncIterator[asyncio.Task[None]]:
    stopping = asyncio.Event()
    task = asyncio.create_task(r.run(stopping))
    try:
        yield task
    finally:
        stopping.set()
        if not task.done():
            await asyncio.wait_for(task, 15)


async def seed(
    env: ApiEnv, dlq: str, origin: str, count: int, *, partitions: int = 1, first: int = 0
) -> list[int]:
    """``count`` records on the DLQ topic and their dead-letter rows; returns the ids."""
    records = [
        (
            b"key-%d" % (first + i),
            b"value-%d" % (first + i),
            [
                ("app", b"kept"),
                ("kmq-origin", f"{origin}/0/{first + i}".encode()),
                ("kmq-group", b"billing"),
                ("kmq-dlq-reason", b"max attempts reached"),
                ("kmq-dlq-attempts", b"5"),
            ],
        )
        for i in range(count)
    ]
    positions = await produce(env.bootstrap, dlq, records, partition=None if partitions > 1 else 0)
    rows = [
        {
            "group_id": "billing",
            "origin_topic": origin,
            "origin_partition": 0,
            "origin_offset": first + i,
            "source_topic": origin,
            "source_partition": 0,
            "source_offset": first + i,
            "dlq_topic": dlq,
            "dlq_partition": partition,
            "dlq_offset": offset,
            "reason": "max attempts reached (5 of 5; last: processing timeout)",
            "last_error": "",
            "attempts": 5,
            "first_seen_ms": T0,
            "dead_lettered_ms": T0 + i,
            "message_key": b"key-%d" % (first + i),
            "redriven_ms": None,
        }
        for i, (partition, offset) in enumerate(positions)
    ]
    async with env.store.engine.begin() as conn:
        await conn.execute(dead_letters.insert(), rows)
        result = await conn.execute(
            dead_letters.select()
            .with_only_columns(dead_letters.c.id)
            .where(dead_letters.c.dlq_topic == dlq, dead_letters.c.origin_offset >= first)
            .order_by(dead_letters.c.id)
        )
        return [int(r[0]) for r in result]


async def read_all(bootstrap: str, topic: str, partitions: int) -> list[Any]:
    async with AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False) as consumer:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[Any] = []
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=200)
            idle = 0 if batch else idle + 1
            for records in batch.values():
                out += records
        return out


def header(record: Any, name: str) -> bytes | None:
    for key, value in record.headers:
        if key == name:
            return bytes(value) if value is not None else None
    return None


def redriven_items(records: Sequence[Any], job_id: int) -> list[int]:
    return [
        int(header(r, REDRIVE_ITEM) or 0)
        for r in records
        if header(r, REDRIVE_JOB) == str(job_id).encode()
    ]


async def job_state(env: ApiEnv, job_id: int) -> dict[str, Any]:
    response = await env.client.get(f"/v1/redrive-jobs/{job_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def wait_for_state(env: ApiEnv, job_id: int, state: str, within: float = 30) -> None:
    async def reached() -> bool:
        return bool((await job_state(env, job_id))["state"] == state)

    await eventually(reached, within=within, what=f"job {job_id} {state}")


@pytest.mark.slow
async def test_redrive_of_two_thousand_at_the_rate_limit(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    dlq = await topic_factory(partitions=2, prefix="orders-dlq")
    origin = await topic_factory(partitions=2, prefix="orders")
    ids = await seed(env, dlq, origin, 2000, partitions=2)
    created = await env.client.post(
        "/v1/redrive-jobs",
        json={"filter": {"topic": origin}, "rate": 1000, "reason": "bug fixed"},
    )
    assert created.status_code == 201, created.text
    job = created.json()
    assert (job["state"], job["total"], job["pending"]) == ("pending", 2000, 2000)

    async with running(runner(env, "runner-a")):
        await wait_for_state(env, job["id"], "done")
    final = await job_state(env, job["id"])
    assert (final["done"], final["skipped"], final["pending"], final["progress"]) == (
        2000,
        0,
        0,
        1.0,
    )
    records = [r for r in await read_all(env.bootstrap, origin, 2) if header(r, REDRIVE_JOB)]
    assert sorted(redriven_items(records, job["id"])) == ids  # each exactly once
    # Observed rate, from the records' timestamps: never over the limit (20 % for the clock
    # and batching), and not throttled far below it (the lower bound leaves room for a CI
    # machine busy with other tests: it only catches a limiter that waits far too long).
    stamps = sorted(r.timestamp for r in records)
    rate = (len(stamps) - 1) / ((stamps[-1] - stamps[0]) / 1000)
    assert 500 <= rate <= 1200, f"observed {rate:.0f} messages/s for a limit of 1000"
    # The record is the DLQ record without the kmq-dlq-* headers, plus the redrive marks.
    sample = next(r for r in records if r.key == b"key-7")
    assert sample.value == b"value-7"
    names = [k for k, _ in sample.headers]
    assert names == ["app", "kmq-origin", "kmq-group", REDRIVE_JOB, REDRIVE_ITEM]
    assert header(sample, "kmq-origin") == f"{origin}/0/7".encode()
    waiting = await env.client.get("/v1/dlq", params={"topic": origin, "redriven": "false"})
    assert waiting.json()["items"] == []
    items = await env.client.get(f"/v1/redrive-jobs/{job['id']}/items", params={"limit": 3})
    first = items.json()["items"][0]
    assert first["state"] == "done"
    assert first["produced"]["topic"] == origin


@pytest.mark.slow
async def test_a_redrive_resumes_after_a_crash_without_duplicates(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    dlq = await topic_factory(partitions=1, prefix="orders-dlq")
    origin = await topic_factory(partitions=3, prefix="orders")
    ids = await seed(env, dlq, origin, 600)
    job = (
        await env.client.post("/v1/redrive-jobs", json={"filter": {"topic": origin}, "rate": 3000})
    ).json()

    batches = 0
    crashed_batch: list[ProducedItem] = []
    crashing: asyncio.Task[None] | None = None

    async def crash_after_third_batch(produced: Sequence[ProducedItem]) -> None:
        """The broker acknowledged the batch; the process dies before recording it."""
        nonlocal batches
        batches += 1
        if batches == 3:
            crashed_batch.extend(produced)
            assert crashing is not None
            crashing.cancel()
            await asyncio.sleep(0)  # the cancellation lands here

    first = runner(env, "runner-a", chunk=100, max_batch=50, on_produced=crash_after_third_batch)
    stopping = asyncio.Event()
    crashing = asyncio.create_task(first.run(stopping))
    with pytest.raises(asyncio.CancelledError):
        await crashing
    assert len(crashed_batch) > 0
    halfway = await job_state(env, job["id"])
    assert halfway["state"] == "running"
    assert halfway["owner"] == "runner-a"
    assert 0 < halfway["done"] < 600
    recorded_before = halfway["done"]

    # Another replica takes the job over once runner-a's lease has run out.
    async with running(runner(env, "runner-b", chunk=100, max_batch=50)):
        await wait_for_state(env, job["id"], "done")
    final = await job_state(env, job["id"])
    assert final["owner"] == "runner-b"
    assert (final["done"], final["skipped"]) == (600, 0)
    records = await read_all(env.bootstrap, origin, 3)
    items = redriven_items(records, job["id"])
    assert len(items) == len(set(items)), "a dead letter was republished twice"
    assert sorted(items) == ids
    # The batch produced just before the crash was recovered from the topic, not resent.
    crashed = {p.dead_letter_id: (p.partition, p.offset) for p in crashed_batch}
    pages: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 1000}
        if cursor:
            params["cursor"] = cursor
        body = (await env.client.get(f"/v1/redrive-jobs/{job['id']}/items", params=params)).json()
        pages += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    produced_at = {
        i["dead_letter_id"]: (i["produced"]["partition"], i["produced"]["offset"]) for i in pages
    }
    assert all(produced_at[k] == v for k, v in crashed.items())
    assert recorded_before + len(crashed) <= 600


async def test_dry_run_explicit_ids_validation_and_idempotency(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    dlq = await topic_factory(partitions=1, prefix="dlq")
    origin = await topic_factory(partitions=1, prefix="orders")
    other = await topic_factory(partitions=1, prefix="payments")
    replay = await topic_factory(partitions=1, prefix="replay")
    a = await seed(env, dlq, origin, 5)
    b = await seed(env, dlq, other, 3, first=100)
    async with env.store.engine.begin() as conn:
        await conn.execute(
            dead_letters.update().where(dead_letters.c.id == a[0]).values(redriven_ms=T0)
        )
    client = env.client

    dry = await client.post("/v1/redrive-jobs", json={"filter": {"topic": origin}, "dry_run": True})
    assert dry.status_code == 201
    assert (dry.json()["state"], dry.json()["total"], dry.json()["done"]) == ("done", 4, 0)
    by_key = await client.post(
        "/v1/redrive-jobs", json={"filter": {"key": "key-2"}, "dry_run": True}
    )
    assert (by_key.json()["total"], by_key.json()["selection"]) == (
        1,
        {"filter": {"key": "key-2", "redriven": False}},
    )
    dry_ids = await client.post("/v1/redrive-jobs", json={"ids": [a[0], a[1]], "dry_run": True})
    assert (dry_ids.json()["total"], dry_ids.json()["skipped"]) == (2, 1)
    assert await read_all(env.bootstrap, origin, 1) == []

    body = {"ids": [a[0], a[1], b[0]], "target_topic": replay, "rate": 500, "reason": "replay"}
    key = {"Idempotency-Key": "redrive-1"}
    created = await client.post("/v1/redrive-jobs", json=body, headers=key)
    assert created.status_code == 201, created.text
    job = created.json()
    assert (job["total"], job["skipped"], job["pending"]) == (3, 1, 2)
    assert job["selection"] == {"ids": [a[0], a[1], b[0]]}
    again = await client.post("/v1/redrive-jobs", json=body, headers=key)
    assert again.status_code == 200
    assert (again.json()["id"], again.json()["replayed"]) == (job["id"], True)
    conflict = await client.post("/v1/redrive-jobs", json={**body, "rate": 1}, headers=key)
    assert conflict.status_code == 409
    # A time without a zone is ambiguous: refused with a clear 422, never a 500.
    for field in ("since", "until"):
        for naive in ("2026-01-01T00:00:00", "2026-01-01"):
            selection = {"filter": {"topic": origin, field: naive}, "dry_run": True}
            refused = await client.post("/v1/redrive-jobs", json=selection)
            assert refused.status_code == 422, refused.text
            assert "timezone" in refused.text
    assert conflict.json()["error"] == "idempotency_conflict"

    async with running(runner(env, "runner-a")):
        await wait_for_state(env, job["id"], "done")
    records = await read_all(env.bootstrap, replay, 1)
    assert sorted(redriven_items(records, job["id"])) == sorted([a[1], b[0]])
    skipped = await client.get(f"/v1/redrive-jobs/{job['id']}/items", params={"state": "skipped"})
    assert [(i["dead_letter_id"], i["detail"]) for i in skipped.json()["items"]] == [
        (a[0], "already redriven")
    ]

    for bad, words in (
        ({"ids": [999_999]}, "no dead letters with ids 999999"),
        ({"ids": [a[2]], "filter": {}}, "exactly one"),
        ({"rate": 10}, "exactly one"),
        ({"ids": [a[2]], "target_topic": unique_topic("no-such-topic")}, "does not exist"),
        ({"ids": [a[2]], "rate": 0}, "body.rate"),
        ({"ids": []}, "body.ids"),
        ({"filter": {"since": "yesterday"}}, "body.filter.since"),
    ):
        response = await client.post("/v1/redrive-jobs", json=bad)
        assert response.status_code == 422, (bad, response.text)
        assert words in response.json()["detail"], (bad, response.json())
    assert (await client.get("/v1/redrive-jobs/999999")).status_code == 404
    listed = (await client.get("/v1/redrive-jobs", params={"state": "done", "limit": 2})).json()
    assert [j["id"] for j in listed["items"]] == [job["id"], dry_ids.json()["id"]]
    rest = await client.get(
        "/v1/redrive-jobs", params={"state": "done", "limit": 2, "cursor": listed["next_cursor"]}
    )
    assert [j["id"] for j in rest.json()["items"]] == [by_key.json()["id"], dry.json()["id"]]


async def test_cancel_pending_and_running_jobs(env: ApiEnv, topic_factory: TopicFactory) -> None:
    dlq = await topic_factory(partitions=1, prefix="dlq")
    origin = await topic_factory(partitions=1, prefix="orders")
    ids = await seed(env, dlq, origin, 200)
    client = env.client

    pending = (await client.post("/v1/redrive-jobs", json={"ids": ids[:10]})).json()
    cancelled = await client.post(f"/v1/redrive-jobs/{pending['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled"
    assert (await client.post(f"/v1/redrive-jobs/{pending['id']}/cancel")).status_code == 200
    assert (await client.post("/v1/redrive-jobs/999999/cancel")).status_code == 404

    job = (await client.post("/v1/redrive-jobs", json={"filter": {}, "rate": 40})).json()
    assert job["total"] == 200
    async with running(runner(env, "runner-a", max_batch=10)):

        async def started() -> bool:
            return bool((await job_state(env, job["id"]))["done"] >= 10)

        await eventually(started, within=20, what="some progress")
        asked = await client.post(f"/v1/redrive-jobs/{job['id']}/cancel")
        assert asked.status_code == 200
        assert asked.json()["cancel_requested"] is True
        await wait_for_state(env, job["id"], "cancelled", within=10)
    final = await job_state(env, job["id"])
    assert 10 <= final["done"] < 200
    records = redriven_items(await read_all(env.bootstrap, origin, 1), job["id"])
    assert len(records) == len(set(records)) == final["done"]
    # What was not republished is available again.
    waiting = await client.get("/v1/dlq", params={"redriven": "false", "limit": 1000})
    assert len(waiting.json()["items"]) == 200 - final["done"]
    finished = await client.post(f"/v1/redrive-jobs/{job['id']}/cancel")
    assert finished.status_code == 200  # cancelled again: fine
    done_job = await client.post("/v1/redrive-jobs", json={"ids": [ids[0]], "dry_run": True})
    refused = await client.post(f"/v1/redrive-jobs/{done_job.json()['id']}/cancel")
    assert refused.status_code == 409


async def test_overlapping_jobs_never_republish_a_dead_letter_twice(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    dlq = await topic_factory(partitions=1, prefix="dlq")
    origin = await topic_factory(partitions=1, prefix="orders")
    ids = await seed(env, dlq, origin, 120)
    first = (await env.client.post("/v1/redrive-jobs", json={"ids": ids[:80], "rate": 2000})).json()
    second = (
        await env.client.post("/v1/redrive-jobs", json={"ids": ids[40:], "rate": 2000})
    ).json()
    async with (
        running(runner(env, "runner-a", max_batch=20)),
        running(runner(env, "runner-b", max_batch=20)),
    ):
        await wait_for_state(env, first["id"], "done")
        await wait_for_state(env, second["id"], "done")
    one, two = await job_state(env, first["id"]), await job_state(env, second["id"])
    assert one["done"] + two["done"] == 120
    assert one["skipped"] + two["skipped"] == 40
    records = await read_all(env.bootstrap, origin, 1)
    items = redriven_items(records, first["id"]) + redriven_items(records, second["id"])
    assert sorted(items) == ids


async def test_a_slow_job_does_not_hold_up_a_shutdown(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    """At a slow rate the runner waits seconds for a token; a stop must not wait it out."""
    dlq = await topic_factory(partitions=1, prefix="dlq")
    origin = await topic_factory(partitions=1, prefix="orders")
    await seed(env, dlq, origin, 3)
    created = await env.client.post(
        "/v1/redrive-jobs", json={"filter": {"topic": origin}, "rate": 0.01}
    )
    assert created.status_code == 201, created.text
    job = created.json()
    r = runner(env, "runner-slow", lease_seconds=40.0)  # a token wait of up to 10 s
    stopping = asyncio.Event()
    task = asyncio.create_task(r.run(stopping))
    try:

        async def first_sent() -> bool:
            return bool((await job_state(env, job["id"]))["done"] >= 1)

        await eventually(first_sent, what="the first record (the bucket's first token)")
        loop = asyncio.get_running_loop()
        asked = loop.time()
        stopping.set()
        await asyncio.wait_for(task, 15)
        assert loop.time() - asked < 3, "the shutdown waited for the next token"
    finally:
        stopping.set()
        if not task.done():
            task.cancel()
    assert (await job_state(env, job["id"]))["done"] == 1
