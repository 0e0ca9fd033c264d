"""The web console over HTTP (no browser): login, sessions, CSRF, roles, escaping, headers.

The app runs on a real store (SQLite and PostgreSQL) and the test broker; rows are written to
the store directly. What only a browser can show (scripts not running, htmx refreshes, the
chart) is in tests/browser.
"""

from __future__ import annotations

import dataclasses
import html
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import markupsafe
import pytest

from api.app import create_app
from api.console.security_headers import CONTENT_SECURITY_POLICY
from api.console.session import COOKIE
from tracker.domain.entries import State
from tracker.runtime import standalone_api_context

from .api_support import (
    ADMIN_TOKEN,
    READ_TOKEN,
    ApiEnv,
    api_env,
    client_for,
    entry,
    insert_dead_letters,
    insert_entries,
)

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]
XSS_REASON = '<script>document.title="pwned"</script>"><img src=x onerror=alert(1)>'


@pytest.fixture
async def env(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> AsyncIterator[ApiEnv]:
    markers = await topic_factory(partitions=2, prefix="markers")
    async with api_env(kafka_bootstrap, database_url, markers) as env:
        yield env


async def browser(env: ApiEnv, token: str | None) -> httpx.AsyncClient:
    """A client without bearer token, logged in to the console with ``token`` (if any)."""
    client = env.client_with({})
    client.headers.pop("Authorization", None)
    if token is not None:
        response = await client.post("/console/login", data={"token": token, "next": "/console/"})
        assert response.status_code == 303, response.text
    return client


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "no CSRF token in the page"
    return found.group(1)


def cell(page: str, topic: str, column: str, *, group: str | None = None) -> str:
    """A column of the overview's row of ``topic``, or of its ``group``'s row under it."""
    opening = (
        f'<tr data-topic="{re.escape(topic)}">'
        if group is None
        else f'<tr class="sub" data-topic="{re.escape(topic)}" data-group="{re.escape(group)}">'
    )
    row = re.search(rf"{opening}(.*?)</tr>", page, re.S)
    assert row, f"no row for {topic} {group or ''}"
    value = re.search(rf'data-col="{column}">(.*?)</td>', row.group(1), re.S)
    assert value, f"no {column} column"
    return re.sub(r"<[^>]+>", "", value.group(1)).strip()


async def test_pages_need_a_login_and_a_wrong_token_gets_none(env: ApiEnv) -> None:
    client = await browser(env, None)
    response = await client.get("/console/topics/orders?state=in_flight")
    assert response.status_code == 303
    assert response.headers["location"] == (
        "/console/login?next=%2Fconsole%2Ftopics%2Forders%3Fstate%3Din_flight"
    )
    # A background refresh is told to load the login page rather than swap it in.
    refresh = await client.get("/console/", headers={"HX-Request": "true"})
    assert refresh.headers["HX-Redirect"].startswith("/console/login")
    wrong = await client.post("/console/login", data={"token": "not-the-token"})
    assert wrong.status_code == 401
    assert "not valid" in wrong.text
    assert COOKIE not in wrong.headers.get("set-cookie", "")
    # The bearer token of the API is not a console session.
    api_client = env.client
    assert (await api_client.get("/console/")).status_code == 303


async def test_login_sets_a_strict_cookie_that_holds_no_token(env: ApiEnv) -> None:
    client = env.client_with({})
    client.headers.pop("Authorization", None)
    response = await client.post(
        "/console/login", data={"token": ADMIN_TOKEN, "next": "/console/dlq"}
    )
    assert response.status_code == 303
    assert response.headers["location"] == "/console/dlq"
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/console"):
        assert attribute.lower() in cookie.lower()
    assert ADMIN_TOKEN not in cookie
    # Another site as the target of `next` is refused.
    elsewhere = await client.post(
        "/console/login", data={"token": ADMIN_TOKEN, "next": "//evil.example/x"}
    )
    assert elsewhere.headers["location"] == "/console/"


async def test_every_page_answers_with_a_strict_policy(env: ApiEnv) -> None:
    await insert_entries(env.context, [entry(1)])
    client = await browser(env, ADMIN_TOKEN)
    for path in (
        "/console/",
        "/console/topics/orders",
        "/console/messages/billing/orders/0/1",
        "/console/message-records/billing/orders/0/1",
        "/console/dlq",
        "/console/parked",
    ):
        response = await client.get(path)
        assert response.status_code == 200, (path, response.text[:500])
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["cache-control"] == "no-store"
        assert "<script>" not in response.text  # scripts come from files only
    static = await client.get("/console/static/vendor/htmx.min.js")
    assert static.status_code == 200
    assert static.headers["content-security-policy"] == CONTENT_SECURITY_POLICY


async def test_overview_counts_the_store(env: ApiEnv) -> None:
    now = int(time.time() * 1000)
    await insert_entries(
        env.context,
        [
            entry(1, due_at_ms=now + 600_000),
            entry(2, due_at_ms=now + 600_000),
            entry(3, due_at_ms=now - 5_000),  # its lease ran out: due now
            entry(4, state=State.DELAYED, due_at_ms=now + 60_000),
            entry(5, topic="payments", due_at_ms=now + 600_000),
            # A second group reads orders too: the overview shows each group's share.
            entry(6, group="audit", due_at_ms=now + 600_000),
            entry(7, group="audit", state=State.DELAYED, due_at_ms=now + 60_000),
            entry(8, group="audit", state=State.LOST, due_at_ms=None),
        ],
    )
    await insert_dead_letters(
        env.context,
        [
            {"dead_lettered_ms": now - 120_000},
            {"dead_lettered_ms": now - 60_000, "redriven_ms": now},
        ],
    )
    client = await browser(env, READ_TOKEN)
    page = (await client.get("/console/")).text
    assert cell(page, "orders", "in_flight") == "4"
    assert cell(page, "orders", "delayed") == "2"
    assert cell(page, "orders", "rejected") == "1"
    assert cell(page, "orders", "due") == "1"
    assert cell(page, "orders", "dead_letters") == "1 / 2"
    by_group = {
        group: [
            cell(page, "orders", col, group=group)
            for col in ("in_flight", "delayed", "rejected", "dead_letters")
        ]
        for group in ("audit", "billing")
    }
    assert by_group == {"audit": ["1", "1", "1", "0 / 0"], "billing": ["3", "1", "0", "1 / 2"]}
    assert "/console/topics/orders?group=audit" in page
    assert cell(page, "payments", "in_flight") == "1"
    assert cell(page, "payments", "group") == "group billing"  # its only group, named inline
    assert 'data-topic="payments" data-group=' not in page
    series = re.search(r'data-series="([^"]+)"', page)
    assert series
    assert '"dead_letters"' in html.unescape(series.group(1))


async def test_values_from_kafka_and_operators_render_as_text(env: ApiEnv) -> None:
    await insert_entries(env.context, [entry(1, reason=XSS_REASON)])
    await insert_dead_letters(env.context, [{"origin_offset": 2, "reason": XSS_REASON}])
    client = await browser(env, ADMIN_TOKEN)
    for path in (
        "/console/messages/billing/orders/0/1",
        "/console/message-records/billing/orders/0/1",
        "/console/dlq",
        "/console/messages/billing/orders/0/2",
        "/console/message-records/billing/orders/0/2",
    ):
        page = (await client.get(path)).text
        assert "<script>document" not in page
        assert "<img src=x" not in page
        if "message-records" not in path or path.endswith("/2"):
            assert str(markupsafe.escape(XSS_REASON)) in page


async def test_a_message_page_answers_from_the_store_and_loads_kafka_after(env: ApiEnv) -> None:
    """The page itself reads no Kafka: the markers and the payload come in a fragment that
    the page loads (``#kafka``), which also shows the history the store has."""
    await insert_entries(env.context, [entry(1)])
    await insert_dead_letters(env.context, [{"origin_offset": 1, "reason": "bad json"}])
    client = await browser(env, READ_TOKEN)
    page = (await client.get("/console/messages/billing/orders/0/1")).text
    assert 'hx-get="/console/message-records/billing/orders/0/1"' in page
    assert 'data-testid="kafka-pending"' in page
    assert 'data-testid="value"' not in page
    assert "dead-lettered" in page  # the store's part of the history is there at once
    fragment = await client.get("/console/message-records/billing/orders/0/1")
    assert fragment.status_code == 200
    assert fragment.text.lstrip().startswith('<div id="kafka" data-testid="kafka-read">')
    assert "<html" not in fragment.text
    assert "dead-lettered" in fragment.text
    # The inserted entry's copy is not in Kafka: the fragment says what it could not read.
    assert "<h2>Payload</h2>" in fragment.text
    assert 'data-testid="kafka-pending"' not in fragment.text
    # Gone meanwhile (acked): the fragment says so, as a fragment htmx swaps in (not a 404,
    # which htmx would not swap, leaving "Reading ... from Kafka" on the page).
    missing = await client.get("/console/message-records/billing/orders/0/99")
    assert missing.status_code == 200
    assert 'data-testid="kafka-error"' in missing.text
    assert "no message billing/orders/0/99" in missing.text
    # A refresh or fragment whose session ran out logs in back to the page, not the fragment.
    anonymous = await browser(env, None)
    expired = await anonymous.get(
        "/console/message-records/billing/orders/0/1",
        headers={
            "HX-Request": "true",
            "HX-Current-URL": "http://testserver/console/messages/billing/orders/0/1",
        },
    )
    assert expired.headers["hx-redirect"] == (
        "/console/login?next=%2Fconsole%2Fmessages%2Fbilling%2Forders%2F0%2F1"
    )


async def test_actions_need_the_admin_login_and_the_forms_token(env: ApiEnv) -> None:
    now = int(time.time() * 1000)
    await insert_entries(env.context, [entry(1, due_at_ms=now + 600_000)])
    message = "billing/orders/0/1"
    admin = await browser(env, ADMIN_TOKEN)
    page = (await admin.get(f"/console/messages/{message}?confirm=redeliver")).text
    assert 'data-testid="confirm"' in page
    token = csrf_of(page)
    # Without the form's token (a cross-site post cannot read it): refused, nothing changes.
    forged = await admin.post("/console/actions/redeliver", data={"message_id": message})
    assert forged.status_code == 403
    cross = await admin.post(
        "/console/actions/redeliver",
        data={"message_id": message, "csrf": token},
        headers={"Origin": "https://evil.example"},
    )
    assert cross.status_code == 403
    view = await env.context.queries.get_entry(("billing", "orders", 0, 1))
    assert view is not None
    assert view.entry.due_at_ms == now + 600_000

    reader = await browser(env, READ_TOKEN)
    read_page = (await reader.get(f"/console/messages/{message}?confirm=redeliver")).text
    assert 'data-testid="actions"' not in read_page
    assert 'data-testid="confirm"' not in read_page
    refused = await reader.post(
        "/console/actions/redeliver", data={"message_id": message, "csrf": csrf_of(read_page)}
    )
    assert refused.status_code == 403
    assert "may only read" in refused.text

    done = await admin.post(
        "/console/actions/redeliver",
        data={"message_id": message, "csrf": token, "reason": "from the console"},
    )
    assert done.status_code == 303, done.text
    assert done.headers["location"] == f"/console/messages/{message}?done=redeliver"
    view = await env.context.queries.get_entry(("billing", "orders", 0, 1))
    assert view is not None
    assert view.entry.due_at_ms is not None
    assert view.entry.due_at_ms <= int(time.time() * 1000)
    [action] = (await env.context.queries.message_record(("billing", "orders", 0, 1))).actions
    assert (action.actor, action.reason) == ("admin (console)", "from the console")
    # An action the state does not allow answers the API's 409 as a page.
    await insert_entries(env.context, [entry(9, state=State.LOST)])
    lost = await admin.post(
        "/console/actions/extend",
        data={"message_id": "billing/orders/0/9", "csrf": token, "extend_minutes": "5"},
    )
    assert lost.status_code == 409
    assert 'data-testid="error"' in lost.text


async def test_a_rotated_token_ends_its_sessions(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    markers = await topic_factory(partitions=1, prefix="markers")
    async with api_env(kafka_bootstrap, sqlite_url, markers) as before:
        client = await browser(before, ADMIN_TOKEN)
        cookie = client.cookies[COOKIE]
        assert (await client.get("/console/")).status_code == 200
        tampered = cookie.replace(".admin.", ".read.")
        client.cookies.set(COOKIE, tampered, domain="kmq.test", path="/console")
        assert (await client.get("/console/")).status_code == 303
    async with api_env(
        kafka_bootstrap,
        sqlite_url,
        markers,
        api_token="a-brand-new-admin-token",  # noqa: S106
    ) as after:
        other = after.client_with({})
        other.headers.pop("Authorization", None)
        other.cookies.set(COOKIE, cookie, domain="kmq.test", path="/console")
        assert (await other.get("/console/")).status_code == 303


async def test_a_logged_out_session_is_refused_by_every_replica(env: ApiEnv) -> None:
    client = await browser(env, ADMIN_TOKEN)
    ended = client.cookies[COOKIE]
    other = await browser(env, ADMIN_TOKEN)  # another session of the same token
    page = await client.get("/console/")
    assert page.status_code == 200
    response = await client.post("/console/logout", data={"csrf": csrf_of(page.text)})
    assert response.status_code == 303
    assert response.headers["location"] == "/console/login"
    assert COOKIE not in client.cookies

    # A copy of the cookie (kept by an attacker, or by another tab) is refused from now on,
    # though it is signed and not expired; the other session goes on.
    replay = await browser(env, None)
    replay.cookies.set(COOKIE, ended, domain="kmq.test", path="/console")
    assert (await replay.get("/console/")).status_code == 303
    assert (await replay.post("/console/logout")).status_code == 303  # nothing to end twice
    assert (await other.get("/console/")).status_code == 200

    # Another replica on the same database (or this one restarted) refuses it too.
    context = await standalone_api_context(env.settings, run_redrive=False)
    try:
        transport = httpx.ASGITransport(app=create_app(context))
        async with client_for(transport) as replica:
            replica.cookies.set(COOKIE, ended, domain="kmq.test", path="/console")
            assert (await replica.get("/console/")).status_code == 303
            replica.cookies.set(COOKIE, other.cookies[COOKIE], domain="kmq.test", path="/console")
            assert (await replica.get("/console/")).status_code == 200
    finally:
        await context.close()


async def test_without_tokens_the_console_reads_and_cannot_act(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    markers = await topic_factory(partitions=1, prefix="markers")
    async with api_env(
        kafka_bootstrap, sqlite_url, markers, api_token=None, api_read_token=None
    ) as env:
        await insert_entries(env.context, [entry(1)])
        client = await browser(env, None)
        page = await client.get("/console/messages/billing/orders/0/1?confirm=ack")
        assert page.status_code == 200
        assert "open read-only" in page.text
        assert 'data-testid="actions"' not in page.text
        refused = await client.post(
            "/console/actions/ack", data={"message_id": "billing/orders/0/1", "csrf": ""}
        )
        assert refused.status_code == 403


async def test_the_console_can_be_turned_off(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    markers = await topic_factory(partitions=1, prefix="markers")
    async with api_env(kafka_bootstrap, sqlite_url, markers, console_enabled=False) as env:
        client = await browser(env, None)
        assert (await client.get("/console/")).status_code == 404
        assert (await client.get("/console/static/console.css")).status_code == 404


async def test_a_dry_run_shows_what_would_move(env: ApiEnv) -> None:
    await insert_dead_letters(
        env.context,
        [{"origin_offset": 1, "reason": "boom"}, {"origin_offset": 2, "reason": "boom"}],
    )
    admin = await browser(env, ADMIN_TOKEN)
    page = (await admin.get("/console/dlq")).text
    response = await admin.post(
        "/console/redrive",
        data={
            "csrf": csrf_of(page),
            "topic": "orders",
            "reason_filter": "boom",
            "rate": "50",
            "dry_run": "on",
        },
    )
    assert response.status_code == 303, response.text
    job_page = await admin.get(response.headers["location"])
    assert job_page.status_code == 200, job_page.text
    assert re.search(r'data-testid="job-counts">\s*2', job_page.text)
    assert job_page.text.count("/console/messages/billing/orders/0/") == 2
    # By record key: the listing and the redrive take the whole key.
    await insert_dead_letters(
        env.context, [{"origin_offset": 3, "reason": "boom", "message_key": b"order-42"}]
    )
    keyed = (await admin.get("/console/dlq?key=order-42")).text
    assert keyed.count("/console/messages/billing/orders/0/") == 1
    assert "/console/messages/billing/orders/0/3" in keyed
    assert (
        "/console/messages/billing/orders/0/"
        not in (await admin.get("/console/dlq?key=order")).text
    )
    by_key = await admin.post(
        "/console/redrive",
        data={"csrf": csrf_of(page), "key_filter": "order-42", "rate": "50", "dry_run": "on"},
    )
    assert by_key.status_code == 303, by_key.text
    key_job = (await admin.get(by_key.headers["location"])).text
    assert re.search(r'data-testid="job-counts">\s*1', key_job)
    assert "key=order-42" in key_job
    # Its "for real" form carries the key: it would move the same one dead letter.
    assert 'name="key_filter" value="order-42"' in key_job
    bad = await admin.post("/console/redrive", data={"csrf": csrf_of(page), "rate": "-1"})
    assert bad.status_code == 422
    assert 'data-testid="error"' in bad.text


async def test_requeue_by_id_and_posts_from_behind_a_tls_proxy(env: ApiEnv) -> None:
    [dead] = await insert_dead_letters(env.context, [{"origin_offset": 7}])
    admin = await browser(env, ADMIN_TOKEN)
    page = (await admin.get("/console/messages/billing/orders/0/7?confirm=requeue")).text
    assert f'name="ids" value="{dead}"' in page
    # The browser's origin is https (the proxy ends TLS), the app sees http: same host, fine.
    response = await admin.post(
        "/console/redrive",
        data={"csrf": csrf_of(page), "ids": str(dead), "why": "fixed"},
        headers={"Origin": "https://kmq.test"},
    )
    assert response.status_code == 303, response.text
    job = await env.context.jobs.get_job(int(response.headers["location"].rsplit("/", 1)[1]))
    assert job is not None
    assert job.selection == {"ids": [dead]}
    assert (job.total, job.created_by) == (1, "admin (console)")
    bad = await admin.post("/console/redrive", data={"csrf": csrf_of(page), "ids": "7, x"})
    assert bad.status_code == 422


async def test_topic_filters_left_empty_and_an_age_filter_across_pages(env: ApiEnv) -> None:
    # entry() makes them first seen in 2027 minus seconds: "older than a minute" is false for
    # them unless the clock is past that; put them an hour in the past instead.
    old = int(time.time() * 1000) - 3_600_000
    await insert_entries(
        env.context, [dataclasses.replace(entry(i), first_seen_ms=old - i) for i in range(60)]
    )
    client = await browser(env, READ_TOKEN)
    # A form submitted with empty number fields filters on nothing.
    response = await client.get(
        "/console/topics/orders", params={"min_attempt": "", "min_age_minutes": "", "group": ""}
    )
    assert response.status_code == 200, response.text
    assert response.text.count("/console/messages/billing/orders/0/") == 50
    # "Older than 1 minute" (every entry is older), then the next page: the same listing.
    first = await client.get("/console/topics/orders", params={"min_age_minutes": "1"})
    assert first.status_code == 200
    found = re.search(r'href="(/console/topics/orders\?[^"]*cursor=[^"]+)" rel="next"', first.text)
    assert found, "no next page"
    assert "seen_before_ms=" in found.group(1)
    second = await client.get(html.unescape(found.group(1)))
    assert second.status_code == 200, second.text
    assert second.text.count("/console/messages/billing/orders/0/") == 10
    assert (await client.get("/console/topics/orders?min_attempt=x")).status_code == 422


async def test_a_cookie_that_is_not_ascii_is_no_session(env: ApiEnv) -> None:
    client = await browser(env, None)
    cookie = f"{COOKIE}=v1.admin.9999999999.\u00e9.x".encode()
    response = await client.get("/console/", headers={b"Cookie": cookie})
    assert response.status_code == 303
