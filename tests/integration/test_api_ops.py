"""Authentication, errors, limits, CORS, health, readiness, metrics, and serving with uvicorn."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from support.broker import unique_topic

from api.app import create_app
from api.server import ApiServerError, serve
from tracker.domain.entries import State
from tracker.runtime import create_standalone_app

from .api_support import (
    ADMIN_TOKEN,
    READ_TOKEN,
    ApiEnv,
    api_env,
    api_settings,
    bearer,
    client_for,
    entry,
    insert_dead_letters,
    insert_entries,
)
from .engine_support import eventually

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]

#: One request per endpoint; each must refuse a caller without a valid token.
READS = [
    "/v1/messages",
    "/v1/messages/billing/orders/0/1",
    "/v1/topics",
    "/v1/topics/orders",
    "/v1/dlq",
    "/v1/dlq/1",
    "/v1/redrive-jobs",
    "/v1/redrive-jobs/1",
    "/v1/redrive-jobs/1/items",
]
WRITES: list[tuple[str, object]] = [
    ("/v1/messages/billing/orders/0/1/redeliver", None),
    ("/v1/messages/billing/orders/0/1/ack", None),
    ("/v1/messages/billing/orders/0/1/extend", {"by_ms": 1000}),
    ("/v1/messages/billing/orders/0/1/dead-letter", None),
    ("/v1/redrive-jobs", {"filter": {}, "dry_run": True}),
    ("/v1/redrive-jobs/1/cancel", None),
    (
        "/v1/markers",
        {"kind": "ack", "group": "g", "topic": "orders", "partition": 0, "offset": 1},
    ),
]


@pytest.fixture
async def markers(topic_factory: TopicFactory) -> str:
    return await topic_factory(partitions=4, prefix="markers")


@pytest.fixture
async def env(kafka_bootstrap: str, markers: str, sqlite_url: str) -> AsyncIterator[ApiEnv]:
    async with api_env(kafka_bootstrap, sqlite_url, markers, api_max_body_bytes=4096) as env:
        yield env


async def test_every_endpoint_refuses_missing_or_invalid_tokens(env: ApiEnv) -> None:
    wrong = env.client_with(bearer("not-the-token"))
    basic = env.client_with({"Authorization": "Basic YWRtaW46YWRtaW4="})
    for client, expected in (
        (env.anonymous, "missing bearer token"),
        (basic, "missing bearer token"),
        (wrong, "invalid bearer token"),
    ):
        for path in READS:
            response = await client.get(path)
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"] == "unauthorized"
            assert expected in response.json()["detail"]
            assert response.headers["www-authenticate"] == "Bearer"
        for path, body in WRITES:
            response = await client.post(path, json=body)
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"] == "unauthorized"
    reader = env.client_with(bearer(READ_TOKEN))
    for path in READS:
        assert (await reader.get(path)).status_code in (200, 404), path
    for path, body in WRITES:
        response = await reader.post(path, json=body)
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"] == "forbidden"
    # Ops endpoints need no token (probes and scrapers).
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert (await env.anonymous.get(path)).status_code == 200, path


async def test_without_tokens_reads_are_open_and_mutations_refused(
    kafka_bootstrap: str, markers: str, sqlite_url: str
) -> None:
    async with api_env(
        kafka_bootstrap, sqlite_url, markers, api_token=None, api_read_token=None
    ) as env:
        assert (await env.anonymous.get("/v1/messages")).status_code == 200
        for path, body in WRITES:
            response = await env.anonymous.post(path, json=body)
            assert response.status_code == 503, (path, response.text)
            assert response.json()["error"] == "not_configured"
            assert "KMQ_API_TOKEN" in response.json()["detail"]


async def test_tokens_never_reach_the_logs(env: ApiEnv, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    await env.client.get("/v1/messages")
    await env.client_with(bearer("wrong-token-value")).get("/v1/messages")
    await env.client.post("/v1/messages/billing/orders/0/1/ack")
    assert ADMIN_TOKEN not in repr(env.settings)
    for record in caplog.records:
        text = record.getMessage()
        assert ADMIN_TOKEN not in text
        assert "wrong-token-value" not in text


async def test_errors_are_json_with_the_right_status(
    env: ApiEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = env.client
    unknown = await client.get("/v2/nothing")
    assert unknown.status_code == 404
    assert unknown.json()["error"] == "not_found"
    method = await client.delete("/v1/messages")
    assert method.status_code == 405
    assert method.json()["error"] == "method_not_allowed"
    broken = await client.post(
        "/v1/markers", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert broken.status_code == 422
    assert broken.json()["error"] == "validation_error"

    async def explode(*_: object, **__: object) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(env.context.queries, "list_entries", explode)
    crashed = await client.get("/v1/messages")
    assert crashed.status_code == 500
    body = crashed.json()
    assert body["error"] == "internal_error"
    assert "reference" in body["detail"]
    assert "secret internals" not in crashed.text
    assert "Traceback" not in crashed.text


async def test_request_bodies_over_the_limit_get_413(env: ApiEnv) -> None:
    big = {
        "markers": [
            {"kind": "ack", "group": "g" * 200, "topic": "t", "partition": 0, "offset": i}
            for i in range(40)
        ]
    }
    response = await env.client.post("/v1/markers", json=big)
    assert response.status_code == 413
    assert response.json()["error"] == "payload_too_large"
    assert "4096" in response.json()["detail"]

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"markers": ['
        for _ in range(100):
            yield b'{"kind": "ack", "group": "g", "topic": "t", "partition": 0, "offset": 1},'
        yield b"]}"

    streamed = await env.client.post(
        "/v1/markers", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413
    assert streamed.json()["error"] == "payload_too_large"


async def test_cors_is_off_by_default_and_on_when_configured(
    env: ApiEnv, kafka_bootstrap: str, markers: str, sqlite_url: str
) -> None:
    headers = {"Origin": "https://console.example", "Access-Control-Request-Method": "GET"}
    response = await env.anonymous.options("/v1/messages", headers=headers)
    assert "access-control-allow-origin" not in response.headers
    response = await env.client.get("/v1/messages", headers={"Origin": "https://console.example"})
    assert "access-control-allow-origin" not in response.headers
    async with api_env(
        kafka_bootstrap, sqlite_url, markers, api_cors_origins=["https://console.example"]
    ) as cors:
        response = await cors.anonymous.options("/v1/messages", headers=headers)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://console.example"


async def test_health_readiness_and_metrics(env: ApiEnv, topic_factory: TopicFactory) -> None:
    assert (await env.anonymous.get("/healthz")).json() == {"status": "ok"}
    ready = await env.anonymous.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["ready"] is True
    assert set(ready.json()["checks"]) == {"store", "broker"}

    now = int(time.time() * 1000)
    await insert_entries(
        env.context,
        [
            entry(1, topic="orders", due_at_ms=now + 5000),
            entry(2, topic="orders", state=State.DELAYED, due_at_ms=now + 60_000),
            entry(3, topic="orders", state=State.LOST),
        ],
    )
    await insert_dead_letters(env.context, [{"origin_topic": "orders"}])
    await env.client.get("/v1/messages")
    text = (await env.anonymous.get("/metrics")).text
    assert 'kmq_tracked_messages{state="in_flight",topic="orders"} 1.0' in text
    assert 'kmq_tracked_messages{state="delayed",topic="orders"} 1.0' in text
    assert 'kmq_tracked_messages{state="lost",topic="orders"} 1.0' in text
    assert 'kmq_dead_letters{topic="orders"} 1.0' in text
    assert "kmq_oldest_in_flight_age_seconds{" in text
    assert "kmq_next_delayed_due_seconds{" in text
    assert 'kmq_api_requests_total{method="GET",route="/v1/messages",status="200"}' in text
    assert "kmq_ingest_flush_seconds_bucket" in text
    assert "kmq_redelivery_round_seconds_bucket" in text

    # Not ready: the markers topic is missing (a fresh name: a fixed one may exist on a
    # long-lived cluster, auto-created by whatever once named it).
    missing = env.settings.model_copy(update={"markers_topic": unique_topic("no-such-markers")})
    env.context.settings = missing
    not_ready = await env.anonymous.get("/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["checks"]["broker"]["ok"] is False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_serve_runs_uvicorn_until_stopped(env: ApiEnv) -> None:
    port = _free_port()
    stopping = asyncio.Event()
    server = asyncio.create_task(serve(create_app(env.context), "127.0.0.1", port, stopping))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while True:
                try:
                    response = await http.get("/healthz")
                    break
                except httpx.ConnectError:
                    assert loop.time() < deadline, "uvicorn did not come up"
                    await asyncio.sleep(0.05)
            assert response.json() == {"status": "ok"}
            listed = await http.get("/v1/messages", headers=bearer(ADMIN_TOKEN))
            assert listed.status_code == 200
        # The port is taken now: a second server reports it instead of exiting the process.
        with pytest.raises(ApiServerError, match=str(port)):
            await serve(create_app(env.context), "127.0.0.1", port, asyncio.Event())
    finally:
        stopping.set()
        await asyncio.wait_for(server, 15)


async def test_the_app_alone_reports_startup(env: ApiEnv) -> None:
    """An app whose context is not set yet answers 503 rather than failing."""
    from fastapi import FastAPI  # noqa: PLC0415

    app = create_app(env.context)
    assert isinstance(app, FastAPI)
    del app.state.context
    async with client_for(httpx.ASGITransport(app=app), bearer(ADMIN_TOKEN)) as client:
        response = await client.get("/v1/messages")
    assert response.status_code == 503
    assert "starting" in response.json()["detail"]


async def test_the_standalone_app_builds_and_closes_its_own_context(
    kafka_bootstrap: str, markers: str, sqlite_url: str
) -> None:
    settings = api_settings(kafka_bootstrap, sqlite_url, markers)
    port = _free_port()
    stopping = asyncio.Event()
    server = asyncio.create_task(
        serve(create_standalone_app(settings), "127.0.0.1", port, stopping)
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while True:
                try:
                    ready = await http.get("/readyz")
                    break
                except httpx.ConnectError:
                    assert loop.time() < deadline, "the standalone app did not come up"
                    await asyncio.sleep(0.05)
            assert ready.status_code == 200, ready.text
            created = await http.post(
                "/v1/redrive-jobs", json={"filter": {}}, headers=bearer(ADMIN_TOKEN)
            )
            assert created.status_code == 201
            job_id = created.json()["id"]

            async def finished() -> bool:
                job = await http.get(f"/v1/redrive-jobs/{job_id}", headers=bearer(ADMIN_TOKEN))
                return bool(job.json()["state"] == "done")

            await eventually(finished, within=10, what="the app's own redrive runner")
    finally:
        stopping.set()
        await asyncio.wait_for(server, 15)
