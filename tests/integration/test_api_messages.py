"""The admin API's message endpoints through HTTP, on SQLite and PostgreSQL and the real broker.

Listing (filters, both orders, cursor pagination, stability under concurrent inserts), one
message (state, actions, dead letters, marker history, payload preview), and the four actions
with their conflicts, idempotency and audit trail.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from urllib.parse import quote

import pytest
from sqlalchemy import update

from tracker.client.marker_sink import KafkaMarkerSink
from tracker.domain.entries import State
from tracker.ids import MessageId
from tracker.partitioning import markers_partition
from tracker.protocol import Marker
from tracker.store.counts import CountChanges
from tracker.store.tables import partitions_table, tracked, tracked_counts

from .api_support import (
    READ_TOKEN,
    T0,
    ApiEnv,
    api_env,
    bearer,
    entry,
    insert_dead_letters,
    insert_entries,
    produce,
)

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]
CLAIMED = "round-1"  #: the claim token of a redelivery round in progress


@pytest.fixture
async def env(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> AsyncIterator[ApiEnv]:
    markers = await topic_factory(partitions=4, prefix="markers")
    async with api_env(
        kafka_bootstrap, database_url, markers, api_payload_preview_bytes=1024
    ) as env:
        yield env


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def ids(page: dict[str, object]) -> list[str]:
    items = page["items"]
    assert isinstance(items, list)
    return [item["id"] for item in items]


async def test_list_filters(env: ApiEnv) -> None:
    await insert_entries(
        env.context,
        [
            entry(1, due_at_ms=T0 + 10),
            entry(2, state=State.DELAYED, due_at_ms=T0 + 5, attempt=3),
            entry(3, partition=1, state=State.REJECTED, due_at_ms=T0),
            entry(4, state=State.LOST),
            entry(5, topic="payments", due_at_ms=T0 + 20, attempt=2),
            entry(6, group="shipping", due_at_ms=T0 + 1),
        ],
    )
    client = env.client

    async def listed(**params: object) -> list[str]:
        response = await client.get("/v1/messages", params=params)  # type: ignore[arg-type]
        assert response.status_code == 200, response.text
        return ids(response.json())

    assert await listed() == [
        "billing/orders/0/1",
        "billing/orders/0/2",
        "billing/orders/0/4",
        "billing/orders/1/3",
        "billing/payments/0/5",
        "shipping/orders/0/6",
    ]
    assert await listed(topic="payments") == ["billing/payments/0/5"]
    assert await listed(topic="orders", partition=1) == ["billing/orders/1/3"]
    assert await listed(state=["delayed", "lost"]) == ["billing/orders/0/2", "billing/orders/0/4"]
    assert await listed(group="shipping") == ["shipping/orders/0/6"]
    assert await listed(min_attempt=2) == ["billing/orders/0/2", "billing/payments/0/5"]
    assert await listed(due_before=iso(T0 + 5)) == ["billing/orders/1/3", "shipping/orders/0/6"]
    assert await listed(due_after=iso(T0 + 10)) == ["billing/orders/0/1", "billing/payments/0/5"]
    # By due time (lost messages have none and are left out), ties broken by id.
    assert await listed(order="due") == [
        "billing/orders/1/3",
        "shipping/orders/0/6",
        "billing/orders/0/2",
        "billing/orders/0/1",
        "billing/payments/0/5",
    ]
    page = (await client.get("/v1/messages", params={"order": "due", "limit": 2})).json()
    assert ids(page) == ["billing/orders/1/3", "shipping/orders/0/6"]
    rest = await client.get(
        "/v1/messages", params={"order": "due", "limit": 10, "cursor": page["next_cursor"]}
    )
    assert ids(rest.json()) == ["billing/orders/0/2", "billing/orders/0/1", "billing/payments/0/5"]
    assert rest.json()["next_cursor"] is None

    detail = (await client.get("/v1/messages", params={"topic": "payments"})).json()["items"][0]
    assert detail["state"] == "in_flight"
    assert detail["attempt"] == 2
    assert detail["due_at"] == iso(T0 + 20).replace("+00:00", "Z")
    assert detail["origin"] == {"topic": "payments", "partition": 0, "offset": 5}


async def test_list_rejects_bad_parameters_with_clear_messages(env: ApiEnv) -> None:
    client = env.client
    cases: list[tuple[dict[str, object], str]] = [
        ({"limit": 1001}, "query.limit"),
        ({"limit": 0}, "query.limit"),
        ({"state": "dead"}, "query.state"),
        ({"topic": "no spaces allowed"}, "query.topic"),
        ({"partition": -1}, "query.partition"),
        ({"due_before": "2026-01-01T00:00:00"}, "query.due_before"),  # no time zone
        ({"due_after": "yesterday"}, "query.due_after"),
        ({"order": "random"}, "query.order"),
        ({"cursor": "not a cursor!"}, "query.cursor"),
        ({"cursor": "bm90LWpzb24"}, "invalid cursor"),
    ]
    for params, expected in cases:
        response = await client.get("/v1/messages", params=params)  # type: ignore[arg-type]
        assert response.status_code == 422, (params, response.text)
        body = response.json()
        assert body["error"] == "validation_error"
        assert expected in body["detail"], (params, body)
        assert "Traceback" not in response.text

    await insert_entries(env.context, [entry(i) for i in range(3)])
    page = (await client.get("/v1/messages", params={"limit": 1})).json()
    other = await client.get(
        "/v1/messages", params={"limit": 1, "topic": "orders", "cursor": page["next_cursor"]}
    )
    assert other.status_code == 422
    assert "other filters" in other.json()["detail"]


async def test_a_forged_cursor_out_of_range_is_a_clear_422(env: ApiEnv) -> None:
    """A cursor edited to hold an offset or due time past 64 bits is refused before it
    reaches the database (where it would overflow: a 500)."""
    client = env.client
    await insert_entries(env.context, [entry(i) for i in range(3)])
    for order, edit in (("key", 3), ("due", 0)):
        page = (await client.get("/v1/messages", params={"limit": 1, "order": order})).json()
        raw = page["next_cursor"] + "=" * (-len(page["next_cursor"]) % 4)
        data = json.loads(base64.urlsafe_b64decode(raw))
        data["k"][edit] = 2**64
        forged = base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")
        response = await client.get(
            "/v1/messages", params={"limit": 1, "order": order, "cursor": forged}
        )
        assert response.status_code == 422, (order, response.text)
        assert "invalid cursor" in response.json()["detail"]


async def test_pagination_is_stable_under_concurrent_inserts(env: ApiEnv) -> None:
    """Every row that existed when the listing started comes back exactly once, while other
    rows are inserted before and after the cursor, and existing rows change, meanwhile."""
    existing = [entry(offset, partition=offset % 3) for offset in range(0, 600, 2)]
    await insert_entries(env.context, existing)
    expected = {f"billing/orders/{e.origin_partition}/{e.origin_offset}" for e in existing}
    rng = random.Random(7)
    stop = asyncio.Event()
    inserted: list[str] = []

    async def writer() -> None:
        free = list(range(1, 600, 2))
        rng.shuffle(free)
        while not stop.is_set() and free:
            batch = [entry(free.pop(), partition=rng.randrange(3)) for _ in range(5) if free]
            await insert_entries(env.context, batch)
            inserted.extend(f"billing/orders/{e.origin_partition}/{e.origin_offset}" for e in batch)
            # The engine keeps moving due times of existing rows too.
            async with env.store.engine.begin() as conn:
                await conn.execute(
                    update(tracked)
                    .where(tracked.c.origin_offset == rng.randrange(0, 600, 2))
                    .values(due_at_ms=T0 + rng.randrange(100_000))
                )
            await asyncio.sleep(0)

    task = asyncio.create_task(writer())
    seen: list[str] = []
    cursor = None
    pages = 0
    try:
        while True:
            params: dict[str, object] = {"limit": 25}
            if cursor:
                params["cursor"] = cursor
            response = await env.client.get("/v1/messages", params=params)  # type: ignore[arg-type]
            assert response.status_code == 200, response.text
            body = response.json()
            seen += ids(body)
            pages += 1
            cursor = body["next_cursor"]
            if cursor is None:
                break
            await asyncio.sleep(0.005)
    finally:
        stop.set()
        await task
    assert len(inserted) > 0, "the writer must have run during the listing"
    assert len(seen) == len(set(seen)), "a row came back twice"
    assert expected <= set(seen), f"skipped: {sorted(expected - set(seen))[:10]}"
    assert set(seen) <= expected | set(inserted)
    assert pages >= 12


async def test_message_detail_with_payload_previews_and_marker_history(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=1, prefix="orders")
    binary = bytes(range(256)) * 2
    large = ("é" * 3000).encode()  # 6000 bytes of two-byte characters
    positions = await produce(
        env.bootstrap,
        topic,
        [
            (b"k-1", b'{"id": 1}', [("trace", b"abc"), ("bin", b"\x00\xff")]),
            (None, binary, []),
            (b"k-3", large, []),
        ],
    )
    total = 4
    mp = markers_partition(topic, 0, total)
    await insert_entries(
        env.context,
        [entry(offset, topic=topic, markers_partition=mp) for _, offset in positions],
    )
    # Its markers, as a consumer wrote them (through the client's sink).
    sink = KafkaMarkerSink(env.context.markers._producer, env.markers)
    first = MessageId(topic, 0, positions[0][1])
    await sink.send_all(
        [
            Marker.start("billing", first, timeout_ms=30_000, consumer="worker-7"),
            Marker.extend("billing", first, timeout_ms=60_000),
            Marker.start("other-group", first, timeout_ms=1000),  # another group: not shown
        ]
    )

    client = env.client
    response = await client.get(f"/v1/messages/billing/{topic}/0/{positions[0][1]}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "in_flight"
    assert body["entry"]["id"] == f"billing/{topic}/0/{positions[0][1]}"
    payload = body["payload"]
    assert payload["source"] == "kafka"
    assert payload["key"] == {"encoding": "utf-8", "data": "k-1", "size": 3, "truncated": False}
    assert payload["value"]["data"] == '{"id": 1}'
    assert payload["headers"][0] == {
        "name": "trace",
        "value": {"encoding": "utf-8", "data": "abc", "size": 3, "truncated": False},
    }
    assert payload["headers"][1]["value"]["encoding"] == "base64"
    assert base64.b64decode(payload["headers"][1]["value"]["data"]) == b"\x00\xff"
    history = body["markers"]
    assert history["markers_partition"] == mp
    assert [(e["kind"], e["timeout_ms"]) for e in history["events"]] == [
        ("start", 30_000),
        ("extend", 60_000),
    ]
    assert history["events"][0]["consumer"] == "worker-7"
    assert history["complete"] is True
    # The next view reads only the markers written since this one (the tail is kept), and
    # answers the whole window: the new marker and the earlier ones.
    await sink.send_all([Marker.ack("billing", first)])
    response = await client.get(f"/v1/messages/billing/{topic}/0/{positions[0][1]}")
    again = response.json()["markers"]
    assert [e["kind"] for e in again["events"]] == ["start", "extend", "ack"]
    assert again["scanned_from"] == history["scanned_from"]
    assert again["scanned_to"] == history["scanned_to"] + 1

    # Binary: base64, capped by the setting (1024 bytes here), size is the full size.
    response = await client.get(
        f"/v1/messages/billing/{topic}/0/{positions[1][1]}", params={"markers": "false"}
    )
    value = response.json()["payload"]["value"]
    assert value["encoding"] == "base64"
    assert value["size"] == 512
    assert value["truncated"] is False
    assert base64.b64decode(value["data"]) == binary
    assert response.json()["markers"] is None
    # The database alone: no read from Kafka at all, the rest of the answer the same.
    kafka = env.context.reads

    async def no_kafka(*_: object, **__: object) -> None:
        raise AssertionError("read Kafka")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kafka, "fetch", no_kafka)
        patch.setattr(kafka.history, "run", no_kafka)
        quiet = await client.get(
            f"/v1/messages/billing/{topic}/0/{positions[1][1]}",
            params={"markers": "false", "payload": "false"},
        )
    assert quiet.status_code == 200, quiet.text
    assert (quiet.json()["payload"], quiet.json()["payload_error"]) == (None, None)
    assert (quiet.json()["markers"], quiet.json()["markers_error"]) == (None, None)
    assert quiet.json()["entry"] == response.json()["entry"]
    # Text over the cap: cut at a character boundary, flagged.
    response = await client.get(
        f"/v1/messages/billing/{topic}/0/{positions[2][1]}", params={"preview_bytes": 101}
    )
    value = response.json()["payload"]["value"]
    assert value == {"encoding": "utf-8", "data": "é" * 50, "size": 6000, "truncated": True}
    default = await client.get(f"/v1/messages/billing/{topic}/0/{positions[2][1]}")
    assert len(default.json()["payload"]["value"]["data"]) == 512  # 1024 bytes
    # Percent-encoded ids work the same.
    encoded = quote(f"billing/{topic}/0/{positions[0][1]}", safe="")
    assert (await client.get(f"/v1/messages/{encoded}")).json()["id"] == body["id"]


async def test_detail_of_a_dead_lettered_message_and_unknown_ids(
    env: ApiEnv, topic_factory: TopicFactory
) -> None:
    dlq = await topic_factory(partitions=1, prefix="orders-dlq")
    [(partition, offset)] = await produce(
        env.bootstrap, dlq, [(b"k", b"poison", [("kmq-dlq-reason", b"bad json")])]
    )
    [dead_id] = await insert_dead_letters(
        env.context,
        [{"origin_offset": 77, "dlq_topic": dlq, "dlq_partition": partition, "dlq_offset": offset}],
    )
    response = await env.client.get("/v1/messages/billing/orders/0/77")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "dead_lettered"
    assert body["entry"] is None
    assert [d["id"] for d in body["dead_letters"]] == [dead_id]
    assert body["payload"]["value"]["data"] == "poison"
    assert body["payload"]["position"] == {"topic": dlq, "partition": 0, "offset": offset}

    missing = await env.client.get("/v1/messages/billing/orders/0/78")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    for bad in ("nonsense", "billing/orders/x/1", "billing/bad topic/0/1", "/orders/0/1"):
        response = await env.client.get(f"/v1/messages/{quote(bad, safe='')}")
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["error"] == "validation_error"


async def test_actions_conflicts_and_audit_trail(env: ApiEnv) -> None:
    await insert_entries(
        env.context,
        [
            entry(1, due_at_ms=T0 + 3_600_000),
            entry(2, state=State.DELAYED, due_at_ms=T0 + 3_600_000),
            entry(3, state=State.REJECTED, due_at_ms=T0),
            entry(4, state=State.LOST),
            entry(5, due_at_ms=int(time.time() * 1000) + 60_000, claim_token=CLAIMED),
            entry(6),
        ],
    )
    client = env.client

    async def act(offset: int, action: str, **body: object) -> dict[str, object]:
        response = await client.post(
            f"/v1/messages/billing/orders/0/{offset}/{action}", json=body or None
        )
        return {"status": response.status_code, **response.json()}

    before = int(time.time() * 1000)
    # Redeliver now: due now, then "unchanged" when repeated.
    first = await act(1, "redeliver", reason="customer asked")
    assert first["status"] == 200
    action = first["action"]
    assert isinstance(action, dict)
    assert (action["outcome"], action["actor"], action["reason"]) == (
        "applied",
        "admin",
        "customer asked",
    )
    message = first["message"]
    assert isinstance(message, dict)
    due = datetime.fromisoformat(str(message["due_at"])).timestamp() * 1000
    assert before - 1000 <= due <= time.time() * 1000 + 1000
    again = await act(1, "redeliver")
    assert again["status"] == 200
    assert again["action"]["outcome"] == "unchanged"  # type: ignore[index]
    # Rejected and lost messages cannot be redelivered.
    for offset, words in ((3, "being dead-lettered"), (4, "lost")):
        refused = await act(offset, "redeliver")
        assert refused["status"] == 409
        assert refused["error"] == "conflict"
        assert words in str(refused["detail"])

    # Extend: only in flight.
    extended = await act(6, "extend", by_ms=120_000)
    assert extended["status"] == 200
    new_due = datetime.fromisoformat(str(extended["message"]["due_at"])).timestamp() * 1000  # type: ignore[index]
    assert abs(new_due - (time.time() * 1000 + 120_000)) < 5000
    refused = await act(2, "extend", by_ms=1000)
    assert refused["status"] == 409
    assert "in-flight" in str(refused["detail"])
    assert (await act(6, "extend"))["status"] == 422  # by_ms is required
    assert (await act(6, "extend", by_ms=0))["status"] == 422

    # Dead-letter now: rejected with the operator's reason; repeating changes nothing.
    dead = await act(2, "dead-letter", reason="poison, confirmed")
    assert dead["status"] == 200
    assert dead["message"]["state"] == "rejected"  # type: ignore[index]
    assert dead["message"]["reason"] == "dead-lettered by admin: poison, confirmed"  # type: ignore[index]
    assert (await act(2, "dead-letter"))["action"]["outcome"] == "unchanged"  # type: ignore[index]
    assert (await act(4, "dead-letter"))["status"] == 409

    # A message being republished right now is left alone.
    for action_name in ("redeliver", "ack", "dead-letter"):
        busy = await act(5, action_name)
        assert busy["status"] == 409
        assert "right now" in str(busy["detail"])

    # Ack: gone; acking again is fine; an unknown message is 404.
    acked = await act(4, "ack", reason="lost for good")
    assert acked["status"] == 200
    assert acked["message"] is None
    repeat = await act(4, "ack")
    assert repeat["status"] == 200
    assert repeat["action"]["outcome"] == "unchanged"  # type: ignore[index]
    assert (await act(99, "ack"))["status"] == 404
    assert (await act(99, "redeliver"))["status"] == 404

    # The audit trail, on the message itself.
    detail = await client.get("/v1/messages/billing/orders/0/4", params={"markers": "false"})
    body = detail.json()
    assert body["status"] == "acked"
    assert [(a["action"], a["outcome"]) for a in body["actions"]] == [
        ("redeliver", "conflict"),
        ("dead_letter", "conflict"),
        ("ack", "applied"),
        ("ack", "unchanged"),
    ]
    assert body["actions"][2]["reason"] == "lost for good"
    assert body["actions"][2]["state_before"] == "lost"


async def test_actions_are_idempotent_with_a_key(env: ApiEnv) -> None:
    await insert_entries(env.context, [entry(1), entry(2)])
    client = env.client
    key = {"Idempotency-Key": "op-123"}
    first = await client.post(
        "/v1/messages/billing/orders/0/1/extend", json={"by_ms": 60_000}, headers=key
    )
    assert first.status_code == 200
    second = await client.post(
        "/v1/messages/billing/orders/0/1/extend", json={"by_ms": 60_000}, headers=key
    )
    assert second.status_code == 200
    assert second.json()["replayed"] is True
    assert second.json()["action"] == first.json()["action"]
    # Same key, another request: refused, nothing done.
    for path, body in (
        ("/v1/messages/billing/orders/0/1/extend", {"by_ms": 1}),
        ("/v1/messages/billing/orders/0/1/extend", {"by_ms": 60_000, "reason": "another"}),
        ("/v1/messages/billing/orders/0/2/extend", {"by_ms": 60_000}),
        ("/v1/messages/billing/orders/0/1/ack", None),
    ):
        conflict = await client.post(path, json=body, headers=key)
        assert conflict.status_code == 409, conflict.text
        assert conflict.json()["error"] == "idempotency_conflict"
    # A refused request replays as refused.
    ack_key = {"Idempotency-Key": "ack-unknown"}
    assert (
        await client.post("/v1/messages/billing/orders/0/9/ack", headers=ack_key)
    ).status_code == 404
    assert (
        await client.post("/v1/messages/billing/orders/0/9/ack", headers=ack_key)
    ).status_code == 404
    detail = (
        await client.get("/v1/messages/billing/orders/0/1", params={"markers": "false"})
    ).json()
    assert len(detail["actions"]) == 1
    assert (
        await client.post(
            "/v1/messages/billing/orders/0/1/ack", headers={"Idempotency-Key": "bad key"}
        )
    ).status_code == 422


async def test_an_action_waits_for_a_marker_flush_of_its_partition(env: ApiEnv) -> None:
    """Like ingest, an action first updates the entry's markers partition row: a flush that
    holds it (and changes the entry) finishes first, and the action sees its result."""
    await insert_entries(env.context, [entry(1, markers_partition=2)])
    async with env.store.engine.begin() as conn:
        await conn.execute(
            partitions_table.insert().values(
                markers_topic=env.markers,
                partition=2,
                epoch=1,
                owner="replica-a",
                next_offset=0,
                updated_ms=T0,
            )
        )
    other = env.context.store.engine  # a flush on another connection of the pool
    flush_started = asyncio.Event()
    release = asyncio.Event()

    async def flush() -> None:
        async with other.begin() as conn:
            await conn.execute(
                update(partitions_table)
                .where(partitions_table.c.partition == 2)
                .values(updated_ms=T0 + 1)
            )
            await conn.execute(
                update(tracked)
                .where(tracked.c.origin_offset == 1)
                .values(state=State.DELAYED.value)
            )
            counts = CountChanges()  # as the store's flush counts it
            counts.add((2, "orders", "billing", State.IN_FLIGHT.value), -1)
            counts.add((2, "orders", "billing", State.DELAYED.value), 1)
            await counts.write(conn, tracked_counts)
            flush_started.set()
            await release.wait()

    flushing = asyncio.create_task(flush())
    await flush_started.wait()
    acting = asyncio.create_task(
        env.client.post("/v1/messages/billing/orders/0/1/extend", json={"by_ms": 1000})
    )
    await asyncio.sleep(0.3)
    assert not acting.done(), "the action must wait for the flush holding its partition"
    release.set()
    await flushing
    response = await acting
    assert response.status_code == 409, response.text
    assert "delayed" in response.json()["detail"]


async def test_read_token_reads_but_cannot_act(env: ApiEnv) -> None:
    await insert_entries(env.context, [entry(1)])
    reader = env.client_with(bearer(READ_TOKEN))
    assert (await reader.get("/v1/messages")).status_code == 200
    response = await reader.post("/v1/messages/billing/orders/0/1/ack")
    assert response.status_code == 403
    assert response.json() == {
        "error": "forbidden",
        "detail": "this token may only read; mutations need the admin token",
        "errors": None,
    }
    assert (await env.client.get("/v1/messages/billing/orders/0/1")).json()["status"] == "in_flight"


async def test_no_marker_history_when_the_search_is_turned_off(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    markers = await topic_factory(partitions=1, prefix="markers")
    async with api_env(kafka_bootstrap, sqlite_url, markers, api_marker_history_scan=0) as env:
        assert env.context.reads.marker_tail is None
        await insert_entries(env.context, [entry(5)])
        response = await env.client.get(
            "/v1/messages/billing/orders/0/5", params={"payload": "false"}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["status"] == "in_flight"
        assert (body["markers"], body["markers_error"]) == (None, None)
