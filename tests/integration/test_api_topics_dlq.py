"""Topic statistics and dead-letter browsing through HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

import pytest

from tracker.domain.entries import State

from .api_support import T0, ApiEnv, api_env, entry, insert_dead_letters, insert_entries, produce

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def env(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> AsyncIterator[ApiEnv]:
    markers = await topic_factory(partitions=4, prefix="markers")
    async with api_env(
        kafka_bootstrap,
        database_url,
        markers,
        topics={"payments": {"max_attempts": 9, "dlq_topic": "payments-dead"}},
    ) as env:
        yield env


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


async def test_topic_statistics_and_policy(env: ApiEnv) -> None:
    now = int(time.time() * 1000)
    await insert_entries(
        env.context,
        [
            entry(1, due_at_ms=now + 1000),
            entry(2, due_at_ms=now + 2000),
            entry(3, state=State.DELAYED, due_at_ms=now + 90_000),
            entry(4, state=State.DELAYED, due_at_ms=now + 30_000),
            entry(5, state=State.LOST),
            entry(6, state=State.REJECTED, due_at_ms=now),
            # Another group on the same topic: counted in the topic's figures and on its own.
            entry(7, group="audit", due_at_ms=now + 1000),
            entry(8, group="audit", state=State.DELAYED, due_at_ms=now + 60_000),
        ],
    )
    await insert_dead_letters(
        env.context,
        [
            {"dead_lettered_ms": now - 30_000},
            {"dead_lettered_ms": now - 3_600_000},
            {"dead_lettered_ms": now - 10_000, "redriven_ms": now},
        ],
    )
    # Redeliveries are counted by the engine; this process's counter feeds the rate.
    env.context.metrics.redeliveries.labels("orders").inc(0)
    env.context.rates.sample()
    response = await env.client.get("/v1/topics/orders", params={"window_minutes": 5})
    assert response.status_code == 200, response.text
    stats = response.json()
    assert (stats["in_flight"], stats["delayed"], stats["rejected"], stats["lost"]) == (3, 3, 1, 1)
    counted = ("in_flight", "delayed", "rejected", "lost", "dead_lettered", "dead_letters_waiting")
    assert {g["group"]: tuple(g[name] for name in counted) for g in stats["groups"]} == {
        "audit": (1, 1, 0, 0, 0, 0),
        "billing": (2, 2, 1, 1, 3, 2),
    }
    assert [g["group"] for g in stats["groups"]] == ["audit", "billing"]
    assert (stats["dead_lettered"], stats["dead_letters_waiting"]) == (3, 2)
    assert stats["dead_lettered_in_window"] == 2
    assert stats["dead_lettered_per_minute"] == pytest.approx(0.4)
    # The oldest in flight of any group: entry(7), first seen 7 s before T0 (audit's).
    assert stats["oldest_in_flight_first_seen"] == iso(T0 - 7000).replace("+00:00", "Z")
    assert stats["next_delayed_due"] == iso(now + 30_000).replace("+00:00", "Z")
    assert stats["policy"]["max_attempts"] == 3
    assert stats["policy"]["dlq_topic"] == "orders.dlq"
    assert stats["policy"]["processing_timeout_seconds"] == 2.0

    listing = (await env.client.get("/v1/topics")).json()["items"]
    by_topic = {t["topic"]: t for t in listing}
    assert set(by_topic) == {"orders", "payments"}  # payments: it has a policy override
    assert by_topic["payments"]["policy"]["max_attempts"] == 9
    assert by_topic["payments"]["policy"]["dlq_topic"] == "payments-dead"
    assert by_topic["payments"]["in_flight"] == 0
    assert by_topic["payments"]["groups"] == []
    assert by_topic["orders"]["groups"] == stats["groups"]

    unknown = (await env.client.get("/v1/topics/never-seen")).json()
    assert (unknown["in_flight"], unknown["dead_lettered"]) == (0, 0)
    assert (await env.client.get("/v1/topics/bad%20name")).status_code == 422
    assert (await env.client.get("/v1/topics", params={"window_minutes": 0})).status_code == 422


async def test_redelivery_rate_from_the_counter_history(env: ApiEnv) -> None:
    clock = [1000.0]
    rates = env.context.rates
    rates._clock = lambda: clock[0]  # a controllable clock for the sampler
    counter = env.context.metrics.redeliveries.labels("orders")
    rates.sample()
    clock[0] += 60
    counter.inc(30)
    rates.sample()
    clock[0] += 60
    counter.inc(90)
    stats = (await env.client.get("/v1/topics/orders", params={"window_minutes": 1})).json()
    assert stats["redeliveries"] == 90
    assert stats["redeliveries_per_minute"] == pytest.approx(90)
    assert stats["redeliveries_window_seconds"] == pytest.approx(60)
    stats = (await env.client.get("/v1/topics/orders", params={"window_minutes": 5})).json()
    assert stats["redeliveries"] == 120
    assert stats["redeliveries_window_seconds"] == pytest.approx(120)
    assert stats["redeliveries_per_minute"] == pytest.approx(60)


async def test_dlq_browse_filters_pagination_and_detail(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    dlq = await topic_factory(partitions=1, prefix="orders-dlq")
    positions = await produce(
        env.bootstrap,
        dlq,
        [
            (b"k%d" % i, b"payload %d" % i, [("kmq-dlq-reason", b"timeout"), ("app", b"x")])
            for i in range(12)
        ],
    )
    rows = []
    for i, (partition, offset) in enumerate(positions):
        rows.append(
            {
                "origin_topic": "orders" if i < 8 else "payments",
                "origin_offset": i,
                "group_id": "billing" if i % 2 == 0 else "shipping",
                "reason": "max attempts reached (5 of 5; last: processing timeout)"
                if i % 3
                else "rejected by the consumer: Bad JSON",
                "dead_lettered_ms": T0 + i * 1000,
                "dlq_topic": dlq,
                "dlq_partition": partition,
                "dlq_offset": offset,
                "message_key": b"k%d" % i,
                "redriven_ms": T0 + 99_000 if i == 11 else None,
            }
        )
    ids = await insert_dead_letters(env.context, rows)
    client = env.client

    async def listed(**params: object) -> list[int]:
        response = await client.get("/v1/dlq", params=params)  # type: ignore[arg-type]
        assert response.status_code == 200, response.text
        return [item["id"] for item in response.json()["items"]]

    newest_first = list(reversed(ids))
    assert await listed() == newest_first
    assert await listed(topic="payments") == newest_first[:4]
    assert await listed(group="billing") == [i for n, i in enumerate(ids) if n % 2 == 0][::-1]
    assert await listed(reason="bad json") == [i for n, i in enumerate(ids) if n % 3 == 0][::-1]
    assert await listed(since=iso(T0 + 3000), until=iso(T0 + 6000)) == [ids[5], ids[4], ids[3]]
    assert await listed(redriven="true") == [ids[11]]
    assert await listed(key="k7") == [ids[7]]
    assert await listed(key="k7", topic="payments") == []
    assert await listed(key="k") == []  # the whole key, not a prefix
    assert len(await listed(redriven="false")) == 11
    # Pages of 5, newest first, each row once.
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, object] = {"limit": 5}
        if cursor:
            params["cursor"] = cursor
        body = (await client.get("/v1/dlq", params=params)).json()  # type: ignore[arg-type]
        seen += [item["id"] for item in body["items"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == newest_first
    item = (await client.get("/v1/dlq", params={"limit": 1})).json()["items"][0]
    assert item["key"] == {"encoding": "utf-8", "data": "k11", "size": 3, "truncated": False}
    assert item["message_id"] == "shipping/payments/0/11"

    detail = await client.get(f"/v1/dlq/{ids[2]}")
    assert detail.status_code == 200
    body = detail.json()
    assert body["dead_letter"]["dlq"] == {"topic": dlq, "partition": 0, "offset": positions[2][1]}
    assert body["payload"]["value"]["data"] == "payload 2"
    assert [h["name"] for h in body["payload"]["headers"]] == ["kmq-dlq-reason", "app"]
    assert (await client.get("/v1/dlq/999999")).status_code == 404
    assert (await client.get("/v1/dlq/0")).status_code == 422
    assert (await client.get("/v1/dlq", params={"since": "not a time"})).status_code == 422
