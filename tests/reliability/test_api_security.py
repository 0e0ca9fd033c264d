"""Security of the admin API: nobody in without the right token, nothing leaks, limits hold.

The app runs in this process on a real store and broker (``integration.api_support``). The
endpoints are enumerated from the app's own OpenAPI schema, so a route added later is covered
without touching this file:

* every mutating operation (POST/PUT/PATCH/DELETE) refuses a missing token, a wrong one, a
  non-Bearer scheme (401) and the read-only token (403), and a refused request changes nothing
  (no table row, no marker on Kafka); every read outside the ops endpoints refuses a missing
  or wrong token;
* the tokens never appear in a log line (formatted by the JSON formatter, at DEBUG, for
  successful and refused requests alike) nor in any response body;
* SQL-injection-shaped values in every filter (query strings, the redrive filter, path ids)
  get a 4xx or an empty result, on SQLite and PostgreSQL, and every table is intact after;
  ``%`` and ``_`` are not wildcards in the substring filter;
* a body over ``api_max_body_bytes`` gets 413 (declared or streamed), and every paginated
  listing refuses a page size outside 1..1000 with 422.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from integration.api_support import (
    ADMIN_TOKEN,
    READ_TOKEN,
    ApiEnv,
    api_env,
    bearer,
    entry,
    insert_dead_letters,
    insert_entries,
)
from integration.engine_support import high_watermarks
from sqlalchemy import func, inspect, select

from api.app import create_app
from tracker.domain.entries import State
from tracker.logs import JsonFormatter
from tracker.store.models import Base

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]

MUTATING = {"post", "put", "patch", "delete"}
#: Open by design (probes, scrapers, the schema); everything else needs a token.
OPEN_PATHS = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"}
#: Values for path parameters, by name; other names get a type-appropriate placeholder.
PATH_VALUES = {
    "message_id": "billing/orders/0/1",
    "dead_letter_id": "1",
    "job_id": "1",
    "topic": "orders",
}
MAX_BODY = 4096

INJECTIONS = [
    "' OR 1=1 --",
    "' OR '1'='1",
    '"; DROP TABLE tracked_messages; --',
    "'; DELETE FROM dead_letters; --",
    "billing' UNION SELECT * FROM markers_partitions --",
    "1; SELECT pg_sleep(5); --",
    "%",
    "_",
    "%' --",
    "\\",
    "'",
    "\\'; DROP TABLE redrive_jobs; --",
    "x\x00y",
    "caf\u00e9' OR '\u00e9'='\u00e9",
]


@pytest.fixture
async def markers(topic_factory: TopicFactory) -> str:
    return await topic_factory(partitions=4, prefix="sec-markers")


@pytest.fixture
async def env(kafka_bootstrap: str, markers: str, sqlite_url: str) -> AsyncIterator[ApiEnv]:
    async with api_env(kafka_bootstrap, sqlite_url, markers, api_max_body_bytes=MAX_BODY) as env:
        yield env


def operations(env: ApiEnv) -> list[tuple[str, str, dict[str, Any]]]:
    """``(method, path template, operation)`` for every operation in the app's schema.

    Each operation gets ``x-request-examples``: the documented examples of its JSON body
    (``$ref`` resolved), to send valid bodies too.
    """
    schema: dict[str, Any] = create_app(env.context).openapi()
    components = schema.get("components", {}).get("schemas", {})
    out = []
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method not in MUTATING | {"get"}:
                continue
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            body_schema = body.get("schema", {})
            ref = body_schema.get("$ref", "")
            if ref:
                body_schema = components.get(ref.rsplit("/", 1)[-1], {})
            examples = body_schema.get("examples", [])
            out.append((method, path, {**op, "x-request-examples": list(examples)}))
    return out


def concrete(path: str, op: dict[str, Any]) -> str:
    """The path with every ``{param}`` filled in."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1).split(":")[0]
        if name in PATH_VALUES:
            return PATH_VALUES[name]
        for param in op.get("parameters", []):
            if param["name"] == name and param.get("schema", {}).get("type") == "integer":
                return "1"
        return "x"

    return re.sub(r"{([^}]+)}", value, path)


def example_bodies(op: dict[str, Any]) -> list[Any]:
    """``{}`` plus the request examples the schema documents (valid bodies)."""
    return [{}, *op.get("x-request-examples", [])]


async def table_counts(env: ApiEnv) -> dict[str, int]:
    async with env.store.engine.connect() as conn:
        names = set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))
        counts = {}
        for table in Base.metadata.sorted_tables:
            assert table.name in names, f"table {table.name} is gone"
            counts[table.name] = int(
                await conn.scalar(select(func.count()).select_from(table)) or 0
            )
        return counts


async def seed(env: ApiEnv) -> None:
    await insert_entries(
        env.context,
        [
            entry(o, topic="orders", partition=o % 2, state=[State.IN_FLIGHT, State.DELAYED][o % 2])
            for o in range(10)
        ],
    )
    await insert_dead_letters(
        env.context,
        [{"origin_offset": 100 + i, "reason": "max attempts reached"} for i in range(5)],
    )


async def test_every_mutating_operation_refuses_bad_credentials(env: ApiEnv) -> None:
    await seed(env)
    before = await table_counts(env)
    refusers = {
        "no token": (env.anonymous, 401),
        "wrong token": (env.client_with(bearer("not-the-admin-token")), 401),
        "admin token + 1 char": (env.client_with(bearer(ADMIN_TOKEN + "x")), 401),
        "admin token prefix": (env.client_with(bearer(ADMIN_TOKEN[:-1])), 401),
        "basic auth": (env.client_with({"Authorization": f"Basic {ADMIN_TOKEN}"}), 401),
        "token without scheme": (env.client_with({"Authorization": ADMIN_TOKEN}), 401),
        "empty bearer": (env.client_with({"Authorization": "Bearer "}), 401),
        "read token": (env.client_with(bearer(READ_TOKEN)), 403),
    }
    mutating = [(m, p, op) for m, p, op in operations(env) if m in MUTATING]
    assert len(mutating) >= 7, f"only {len(mutating)} mutating operations found"
    checked = 0
    for method, template, op in mutating:
        path = concrete(template, op)
        for body in example_bodies(op):
            for name, (client, status) in refusers.items():
                response = await client.request(method.upper(), path, json=body)
                assert response.status_code == status, (name, method, path, body, response.text)
                assert response.json()["error"] in ("unauthorized", "forbidden")
                checked += 1
    assert await table_counts(env) == before, "a refused request changed the database"
    ends = await high_watermarks(env.bootstrap, env.markers)
    assert sum(ends.values()) == 0, "a refused sidecar request wrote a marker"
    print(f"\n[api security] {len(mutating)} mutating operations, {checked} refused requests")


async def test_every_read_outside_ops_needs_a_token(env: ApiEnv) -> None:
    reads = [(p, op) for m, p, op in operations(env) if m == "get" and p not in OPEN_PATHS]
    assert len(reads) >= 8
    for template, op in reads:
        path = concrete(template, op)
        for client in (env.anonymous, env.client_with(bearer("not-the-read-token"))):
            response = await client.get(path)
            assert response.status_code == 401, (path, response.text)
        assert (await env.client_with(bearer(READ_TOKEN)).get(path)).status_code in (200, 404)
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert (await env.anonymous.get(path)).status_code == 200, path


async def test_tokens_never_appear_in_logs_or_bodies(
    env: ApiEnv, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(env)
    caplog.set_level(logging.DEBUG)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.setLevel(logging.DEBUG)
    logging.getLogger().addHandler(handler)
    near_misses = [ADMIN_TOKEN + "x", ADMIN_TOKEN.upper(), f"{READ_TOKEN}-but-wrong"]
    bodies: list[str] = []
    try:
        clients = [
            env.client,
            env.client_with(bearer(READ_TOKEN)),
            env.anonymous,
            *(env.client_with(bearer(t)) for t in near_misses),
            env.client_with({"Authorization": f"Basic {ADMIN_TOKEN}"}),
            env.client_with({"Authorization": f"bearer  {ADMIN_TOKEN}"}),
        ]
        for client in clients:
            for method, template, op in operations(env):
                path = concrete(template, op)
                if method == "get":
                    response = await client.get(path)
                else:
                    response = await client.request(method.upper(), path, json={"reason": "x"})
                bodies.append(response.text)
                bodies.append(json.dumps(dict(response.headers)))
        # A body that is invalid in a field next to the token in the headers.
        response = await env.client.post("/v1/redrive-jobs", json={"filter": {}, "rate": -1})
        bodies.append(response.text)
    finally:
        logging.getLogger().removeHandler(handler)
    logs = stream.getvalue() + "\n".join(
        f"{r.getMessage()} {r.args!r} {r.__dict__!r}" for r in caplog.records
    )
    assert logs, "nothing was logged: the check would prove nothing"
    for secret in (ADMIN_TOKEN, READ_TOKEN, *near_misses):
        assert secret not in logs, f"a token ({secret[:4]}...) reached the logs"
        for body in bodies:
            assert secret not in body, f"a token ({secret[:4]}...) is in a response: {body[:200]}"
    assert ADMIN_TOKEN not in repr(env.settings)
    assert ADMIN_TOKEN not in str(env.settings.model_dump())


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
async def test_sql_injection_through_filters_is_inert(
    database: str, kafka_bootstrap: str, markers: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(f"{database}_url")
    async with api_env(kafka_bootstrap, url, markers) as env:
        await seed(env)
        before = await table_counts(env)
        outcomes: dict[str, int] = {}

        async def probe(what: str, response: httpx.Response) -> None:
            assert response.status_code < 500, (what, response.status_code, response.text)
            outcomes[what] = response.status_code
            if response.status_code == 200:
                body = response.json()
                items = body.get("items")
                if items is not None:
                    assert items == [], (what, items[:2])
                elif "total" in body:
                    assert body["total"] == 0, (what, body)

        client = env.client
        for value in INJECTIONS:
            for param in ("group", "topic", "state"):
                await probe(
                    f"messages {param}={value!r}",
                    await client.get("/v1/messages", params={param: value}),
                )
            for param in ("group", "reason", "topic"):
                await probe(
                    f"dlq {param}={value!r}", await client.get("/v1/dlq", params={param: value})
                )
            await probe(
                f"jobs state={value!r}",
                await client.get("/v1/redrive-jobs", params={"state": value}),
            )
            for field in ("group", "reason", "topic"):
                await probe(
                    f"redrive filter {field}={value!r}",
                    await client.post(
                        "/v1/redrive-jobs",
                        json={"filter": {field: value}, "dry_run": True, "rate": 1},
                    ),
                )
            safe = value.replace("/", "").replace("\x00", "%00")
            await probe(
                f"message id {value!r}", await client.get(f"/v1/messages/{safe}/orders/0/1")
            )
            await probe(f"topic {value!r}", await client.get(f"/v1/topics/{safe}"))
        after = await table_counts(env)
        # Dry runs create finished job rows (and maybe their items); nothing else may change,
        # nothing may vanish.
        for table in ("redrive_jobs", "redrive_items"):
            assert after.pop(table) >= before.pop(table)
        assert after == before, "an injection attempt changed the tables"
        # The filters still work for real values (the injections were not just "all 422").
        listed = (await client.get("/v1/messages", params={"group": "billing"})).json()
        assert len(listed["items"]) == 10
        found = (await client.get("/v1/dlq", params={"reason": "ATTEMPTS"})).json()
        assert len(found["items"]) == 5
    statuses = sorted(set(outcomes.values()))
    print(f"\n[api security] {len(outcomes)} injection probes on {database}: statuses {statuses}")


async def test_body_and_page_size_limits_hold(env: ApiEnv) -> None:
    oversize = {"reason": "x" * (MAX_BODY + 1)}
    mutating = [(m, p, op) for m, p, op in operations(env) if m in MUTATING]
    for method, template, op in mutating:
        path = concrete(template, op)
        for client in (env.client, env.anonymous):
            response = await client.request(method.upper(), path, json=oversize)
            assert response.status_code == 413, (path, response.text)
            assert response.json()["error"] == "payload_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"reason": "'
        for _ in range(MAX_BODY // 100 + 2):
            yield b"y" * 100
        yield b'"}'

    streamed = await env.client.post(
        "/v1/redrive-jobs", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413, streamed.text
    lying = await env.client.post(
        "/v1/redrive-jobs",
        content=b"{}",
        headers={"Content-Type": "application/json", "Content-Length": str(10 * MAX_BODY)},
    )
    assert lying.status_code in (400, 413, 422), lying.text

    paged = [
        (p, op)
        for m, p, op in operations(env)
        if m == "get" and any(q["name"] == "limit" for q in op.get("parameters", []))
    ]
    assert len(paged) >= 4, [p for p, _ in paged]
    for template, op in paged:
        path = concrete(template, op)
        for limit in ("0", "-1", "1001", str(10**30), "1e3", "abc", "1.5"):
            response = await env.client.get(path, params={"limit": limit})
            assert response.status_code == 422, (path, limit, response.text)
        assert (await env.client.get(path, params={"limit": "1000"})).status_code in (200, 404)
