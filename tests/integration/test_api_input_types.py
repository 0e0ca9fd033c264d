"""What the admin API makes of the input types clients get wrong: times, numbers, text lengths.

Regression tests of an operability review, through HTTP on SQLite and PostgreSQL:

* a time without a timezone (naive, date-only) is refused with a 422 that says a timezone is
  needed, the same way on every endpoint that takes a time (it was a 500 in a redrive filter);
  a time with any offset, or an epoch number, is read as the UTC instant it names;
* a number or a flag of a request body sent as a JSON string (``{"by_ms": "10"}``) is a 422,
  not read as 10 ms; query parameters are strings on the wire and keep taking numbers;
* a text over its length limit is reported in characters, not "items".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import httpx
import pytest

from tracker.domain.entries import State

from .api_support import T0, ApiEnv, api_env, entry, insert_dead_letters, insert_entries

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]
HOUR_MS = 3_600_000
#: One second after T0: the instant every spelling below names.
AT = datetime.fromtimestamp(T0 / 1000 + 1, UTC)
NAIVE = [
    AT.replace(tzinfo=None).isoformat(),  # 2027-01-15T08:00:01
    AT.replace(tzinfo=None).isoformat(sep=" "),  # 2027-01-15 08:00:01
    AT.replace(tzinfo=None).isoformat(timespec="milliseconds"),
    AT.date().isoformat(),  # 2027-01-15
]
#: The same instant as users write it: any offset, a space or lower case, epoch numbers.
AWARE: list[str | int] = [
    AT.isoformat().replace("+00:00", "Z"),
    AT.astimezone(timezone(timedelta(hours=1))).isoformat(sep=" "),
    AT.astimezone(timezone(timedelta(hours=-5, minutes=-30))).isoformat(),
    AT.isoformat().replace("+00:00", "z").replace("T", "t"),
    str(T0 // 1000 + 1),  # epoch seconds
    str(T0 + 1000),  # epoch milliseconds
]
MARKER = {"kind": "start", "group": "billing", "topic": "orders", "partition": 0, "offset": 1}


@pytest.fixture
async def env(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> AsyncIterator[ApiEnv]:
    markers = await topic_factory(partitions=2, prefix="markers")
    async with api_env(kafka_bootstrap, database_url, markers) as env:
        yield env


def refusal(response: httpx.Response, *loc: str | int) -> str:
    """The message of the 422's error about ``loc`` (there must be one)."""
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "validation_error"
    assert "Traceback" not in response.text
    found = [item["msg"] for item in body["errors"] if tuple(item["loc"]) == loc]
    assert len(found) == 1, (loc, body)
    assert found[0] in body["detail"]
    message: str = found[0]
    return message


async def seed(env: ApiEnv) -> None:
    """A message and a dead letter at T0, another of each an hour later."""
    await insert_entries(env.context, [entry(1, due_at_ms=T0), entry(2, due_at_ms=T0 + HOUR_MS)])
    await insert_dead_letters(
        env.context,
        [
            {"origin_offset": 1, "dead_lettered_ms": T0},
            {"origin_offset": 2, "dead_lettered_ms": T0 + HOUR_MS},
        ],
    )


async def time_requests(client: httpx.AsyncClient, value: str | int) -> dict[str, httpx.Response]:
    """``value`` given to every time input of the API: the answers, by input."""
    answers: dict[str, httpx.Response] = {}
    for path, names in (
        ("/v1/messages", ("due_before", "due_after")),
        ("/v1/dlq", ("since", "until")),
    ):
        for name in names:
            answers[f"{path}?{name}"] = await client.get(path, params={name: value})
    for name in ("since", "until"):
        body = {"filter": {"topic": "orders", name: value}, "dry_run": True}
        answers[f"/v1/redrive-jobs filter.{name}"] = await client.post(
            "/v1/redrive-jobs", json=body
        )
    return answers


def loc_of(where: str) -> tuple[str, ...]:
    if "?" in where:
        return ("query", where.split("?")[1])
    return ("body", "filter", where.split(".")[1])


async def test_a_time_without_a_timezone_is_a_422_saying_so_on_every_endpoint(
    env: ApiEnv,
) -> None:
    await seed(env)
    for value in NAIVE:
        answers = await time_requests(env.client, value)
        assert len(answers) == 6
        messages = {refusal(response, *loc_of(where)) for where, response in answers.items()}
        # The same words everywhere, and they say what to do.
        assert len(messages) == 1, (value, messages)
        (message,) = messages
        assert "timezone" in message, message
        assert "2026-11-21T09:30:00Z" in message, message
    # Not a time at all: a 422 too, that shows what a time looks like.
    for value in ("yesterday", "2027-02-30T00:00:00Z", "Fri, 15 Jan 2027 08:00:01 GMT"):
        answers = await time_requests(env.client, value)
        for where, response in answers.items():
            message = refusal(response, *loc_of(where))
            assert "timezone" in message, (value, where, message)
    # No redrive job was created by any of these.
    listed = await env.client.get("/v1/redrive-jobs")
    assert listed.json()["items"] == []


async def test_a_time_with_any_offset_or_an_epoch_number_is_that_utc_instant(
    env: ApiEnv,
) -> None:
    await seed(env)
    client = env.client
    first, second = "billing/orders/0/1", "billing/orders/0/2"
    values: list[str | int] = [*AWARE, T0 // 1000 + 1]  # a JSON number too (bodies)
    for value in values:
        before = await client.get("/v1/messages", params={"due_before": value})
        assert [m["id"] for m in before.json()["items"]] == [first], (value, before.text)
        after = await client.get("/v1/messages", params={"due_after": value})
        assert [m["id"] for m in after.json()["items"]] == [second], (value, after.text)
        since = await client.get("/v1/dlq", params={"since": value})
        assert [d["origin"]["offset"] for d in since.json()["items"]] == [2], (value, since.text)
        until = await client.get("/v1/dlq", params={"until": value})
        assert [d["origin"]["offset"] for d in until.json()["items"]] == [1], (value, until.text)
        for name, expected in (("since", 1), ("until", 1)):
            body = {"filter": {"topic": "orders", name: value}, "dry_run": True}
            job = await client.post("/v1/redrive-jobs", json=body)
            assert job.status_code == 201, (value, job.text)
            assert job.json()["total"] == expected, (value, name, job.json())
    # The far ends of what a time can be are answered too, not a 500.
    for value in ("0001-01-01T00:00:00+23:59", "9999-12-31T23:59:59.999999-23:59"):
        answers = await time_requests(client, value)
        for where, response in answers.items():
            assert response.status_code in (200, 201), (value, where, response.text)


async def test_body_numbers_and_flags_sent_as_strings_are_refused(env: ApiEnv) -> None:
    await insert_entries(env.context, [entry(1, state=State.IN_FLIGHT)])
    [dead] = await insert_dead_letters(env.context, [{"origin_offset": 5}])
    client = env.client
    message = "/v1/messages/billing/orders/0/1"
    due = (await client.get(message)).json()["entry"]["due_at"]

    for by_ms in ("10", "600000", True):
        response = await client.post(f"{message}/extend", json={"by_ms": by_ms})
        assert "a JSON number" in refusal(response, "body", "by_ms"), by_ms
    # Nothing happened to the message.
    assert (await client.get(message)).json()["entry"]["due_at"] == due
    assert (await client.get(message)).json()["actions"] == []
    # A JSON number is still fine, a whole one written with a fraction too.
    extended = await client.post(f"{message}/extend", json={"by_ms": 600000.0})
    assert extended.status_code == 200, extended.text

    redrive = {"ids": [dead], "dry_run": True}
    cases: list[tuple[dict[str, Any], tuple[str | int, ...], str]] = [
        ({**redrive, "ids": [str(dead)]}, ("body", "ids", 0), "a JSON number"),
        ({**redrive, "rate": "50"}, ("body", "rate"), "a JSON number"),
        ({**redrive, "rate": True}, ("body", "rate"), "a JSON number"),
        ({**redrive, "dry_run": "true"}, ("body", "dry_run"), "a JSON boolean"),
        ({**redrive, "dry_run": "false"}, ("body", "dry_run"), "a JSON boolean"),
    ]
    for body, loc, expected in cases:
        response = await client.post("/v1/redrive-jobs", json=body)
        assert expected in refusal(response, *loc), body
    assert (await client.get("/v1/redrive-jobs")).json()["items"] == []
    created = await client.post("/v1/redrive-jobs", json={**redrive, "rate": 50})
    assert created.status_code == 201, created.text

    markers: list[tuple[dict[str, Any], str, str]] = [
        ({**MARKER, "partition": "zero"}, "partition", "a JSON number"),
        ({**MARKER, "offset": "-1"}, "offset", "a JSON number"),
        ({**MARKER, "offset": True}, "offset", "a JSON number"),
        ({**MARKER, "attempt": "2"}, "attempt", "a JSON number"),
        ({**MARKER, "timeout_ms": "30000"}, "timeout_ms", "a JSON number"),
        ({**MARKER, "kind": "delay", "delay_ms": "1000"}, "delay_ms", "a JSON number"),
        ({**MARKER, "kind": "delay", "delay_ms": 5, "deferred": "true"}, "deferred", "boolean"),
    ]
    for marker, name, expected in markers:
        single = await client.post("/v1/markers", json=marker)
        assert expected in refusal(single, "body", "marker", name), marker
        batch = await client.post("/v1/markers", json={"markers": [MARKER, marker]})
        assert expected in refusal(batch, "body", "batch", "markers", 1, "marker", name), marker
    # A position as a string of digits is a position: int64 offsets are JSON strings in many
    # stacks (kafkajs, protobuf's JSON mapping), and the sidecar serves those clients.
    as_text = {**MARKER, "partition": "0", "offset": "9223372036854775806"}
    accepted = await client.post("/v1/markers", json=as_text)
    assert accepted.status_code < 300, accepted.text


async def test_query_numbers_and_flags_stay_strings_on_the_wire(env: ApiEnv) -> None:
    await insert_entries(env.context, [entry(i) for i in range(3)])
    [dead] = await insert_dead_letters(env.context, [{"origin_offset": 5}])
    client = env.client
    page = await client.get("/v1/messages", params={"limit": "2", "min_attempt": "1"})
    assert page.status_code == 200, page.text
    assert len(page.json()["items"]) == 2
    listed = await client.get("/v1/dlq", params={"redriven": "false", "limit": "10"})
    assert [d["id"] for d in listed.json()["items"]] == [dead]
    stats = await client.get("/v1/topics/orders", params={"window_minutes": "5"})
    assert stats.status_code == 200, stats.text


async def test_text_over_its_limit_is_counted_in_characters(env: ApiEnv) -> None:
    await insert_entries(env.context, [entry(1)])
    client = env.client
    cases: list[tuple[str, dict[str, Any], tuple[str | int, ...], str]] = [
        (
            "/v1/messages/billing/orders/0/1/ack",
            {"reason": "é" * 1001},
            ("body", "reason"),
            "at most 1000 characters",
        ),
        (
            "/v1/messages/billing/orders/0/1/extend",
            {"by_ms": 1000, "reason": "x" * 1001},
            ("body", "reason"),
            "at most 1000 characters",
        ),
        (
            "/v1/redrive-jobs",
            {"filter": {"reason": "x" * 1001}},
            ("body", "filter", "reason"),
            "at most 1000 characters",
        ),
        (
            "/v1/redrive-jobs",
            {"filter": {"group": "g" * 256}},
            ("body", "filter", "group"),
            "at most 255 characters",
        ),
        (
            "/v1/redrive-jobs",
            {"filter": {"group": ""}},
            ("body", "filter", "group"),
            "at least 1 character",
        ),
        (
            "/v1/redrive-jobs",
            {"ids": [1], "reason": "x" * 1001},
            ("body", "reason"),
            "at most 1000 characters",
        ),
        (
            "/v1/markers",
            {**MARKER, "consumer": "c" * 256},
            ("body", "marker", "consumer"),
            "at most 255 characters",
        ),
        (
            "/v1/markers",
            {**MARKER, "group": "g" * 256},
            ("body", "marker", "group"),
            "at most 255 characters",
        ),
        (
            "/v1/markers",
            {**MARKER, "kind": "reject", "reason": "r" * 4097},
            ("body", "marker", "reason"),
            "at most 4096 characters",
        ),
    ]
    for path, body, loc, expected in cases:
        message = refusal(await client.post(path, json=body), *loc)
        assert expected in message, (path, body, message)
        assert "item" not in message, message
    # A list's limit is still in items; a NUL in a text says so.
    too_many = {"markers": [MARKER] * 1001}
    assert "1000 items" in refusal(
        await client.post("/v1/markers", json=too_many), "body", "batch", "markers"
    )
    nul = await client.post("/v1/messages/billing/orders/0/1/ack", json={"reason": "a\x00b"})
    assert refusal(nul, "body", "reason") == "must not contain NUL characters"
    surrogate = await client.post(
        "/v1/messages/billing/orders/0/1/ack",
        content=rb'{"reason": "a\ud800"}',  # a lone surrogate, escaped as JSON allows
        headers={"Content-Type": "application/json"},
    )
    assert "unicode" in refusal(surrogate, "body", "reason")
    nul_query = await client.get("/v1/dlq", params={"group": "a\x00b"})
    assert refusal(nul_query, "query", "group") == "must not contain NUL characters"


async def test_statuses_of_the_error_table(
    env: ApiEnv, kafka_bootstrap: str, sqlite_url: str
) -> None:
    """What docs/api.md's error table says of 400, 405, 415 and 429: a body that is not JSON
    is a 422 that says so (never 400 or 415), whatever its Content-Type; an unknown method is
    405; only a refused CORS preflight is a 400 (Starlette's plain text)."""
    client = env.client
    marker = b'{"kind": "ack", "group": "g", "topic": "t", "partition": 0, "offset": 1}'
    for headers, sent in (
        ({"Content-Type": "text/plain"}, "Content-Type text/plain"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, "Content-Type application/x-www"),
        ({}, "no Content-Type"),
    ):
        for path, content in (("/v1/markers", marker), ("/v1/redrive-jobs", b'{"ids": [1]}')):
            response = await client.post(path, content=content, headers=headers)
            message = refusal(response, "body")
            assert "Content-Type: application/json" in message, message
            assert sent in message, message
    # JSON with its Content-Type, but not what the endpoint takes: the model's own words.
    wrong = await client.post("/v1/markers", json=["not", "an", "object"])
    assert "marker object" in refusal(wrong, "body")
    missing = await client.post("/v1/messages/billing/orders/0/1/extend")
    assert refusal(missing, "body") == "Field required"
    undecodable = await client.post(
        "/v1/markers", content=b"\xff{", headers={"Content-Type": "application/json"}
    )
    assert undecodable.status_code == 422, undecodable.text
    # No method but GET here, OPTIONS included when CORS is off.
    for method in ("DELETE", "PUT", "PATCH", "OPTIONS"):
        response = await client.request(method, "/v1/messages")
        assert response.status_code == 405, (method, response.text)
        assert response.json()["error"] == "method_not_allowed"
    async with api_env(
        kafka_bootstrap, sqlite_url, env.markers, api_cors_origins=["https://console.example"]
    ) as cors:
        for origin, method in (("https://evil.example", "GET"), ("https://console.example", "PUT")):
            preflight = await cors.anonymous.options(
                "/v1/messages",
                headers={"Origin": origin, "Access-Control-Request-Method": method},
            )
            assert preflight.status_code == 400, preflight.text
            assert preflight.text.startswith("Disallowed CORS")
