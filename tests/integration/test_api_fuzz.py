"""Property-based fuzzing of the admin API against its own OpenAPI schema (schemathesis).

The app is served by uvicorn (``api.server.serve``) in a thread of its own, on a real store
(SQLite, then PostgreSQL) and the real broker, with data to find: tracked messages, dead
letters with records on a DLQ topic, a running redrive runner. For every operation, schemathesis
generates valid requests and invalid ones (a bounded number of each) and sends them with the
admin token; every answer must be a documented status code, never a 5xx, with a body that
matches the documented schema and content type.

Times are not only RFC 3339: every ``date-time`` parameter and body field also gets the times
users write (naive, date-only, a space for the ``T``, epoch numbers as strings, other formats),
so that a time the API mistakes for a valid one (a naive time reaching the store: a 500) is
found here, not by a user. Random draws may miss the one body that gets through every other
check, so each ``date-time`` input of the schema is also sent one time of each kind, in an
otherwise valid request (the schema's example), and must be accepted or refused the same way
on every endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
import socket
import threading
from collections.abc import Iterator
from datetime import UTC
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi import unregister_string_format
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support.broker import create_topic, delete_topics
from support.databases import sqlite_url

from api.app import create_app
from api.context import ApiContext
from api.server import serve
from tracker.domain.entries import State
from tracker.runtime import standalone_api_context
from tracker.store.admin_reads import DeadLetterFilter
from tracker.store.redrive_jobs import RedriveSpec

from .api_support import (
    ADMIN_TOKEN,
    T0,
    api_settings,
    bearer,
    entry,
    insert_dead_letters,
    insert_entries,
    produce,
    reset_tables,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POSITIVE_EXAMPLES = 30
NEGATIVE_EXAMPLES = 15
#: Per known resource (message, dead letter, job): requests with its real id in the path.
KNOWN_EXAMPLES = 8
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


#: Times in formats people send that are not RFC 3339 date-times, or not times at all.
ODD_TIMES = [
    "",
    "now",
    "yesterday",
    "2026-01-01T24:00:00Z",
    "2026-02-30T00:00:00Z",
    "2026-01-01T23:59:60Z",
    "2026-01-01T00:00:00+01",
    "2026-01-01T00:00:00+24:00",
    "20260101T000000Z",
    "2026-W01-1",
    "+002026-01-01T00:00:00Z",
    "01/02/2026",
    "Thu, 01 Jan 2026 00:00:00 GMT",
    "1e10",
    "99999999999999999999",
]
_TIMESPECS = ["minutes", "seconds", "milliseconds", "microseconds"]


@st.composite
def user_times(draw: st.DrawFn) -> str:
    """A time as users write it: RFC 3339 (any offset, years 1 to 9999), the same with a space
    or lower case, naive, date-only, an epoch number (seconds or milliseconds) as a string, or
    one of the odd formats above. A naive or date-only time must be refused with a 422 saying a
    timezone is needed, an epoch number is UTC; whatever is sent, never a 5xx."""
    kind = draw(st.sampled_from(["aware", "naive", "date", "epoch", "odd"]))
    if kind == "odd":
        return draw(st.sampled_from(ODD_TIMES))
    moment = draw(st.datetimes())
    text = moment.isoformat(
        sep=draw(st.sampled_from(["T", " ", "t"])), timespec=draw(st.sampled_from(_TIMESPECS))
    )
    if kind == "aware":
        minutes = draw(st.integers(-(23 * 60 + 59), 23 * 60 + 59))
        hours, rest = divmod(abs(minutes), 60)
        offset = f"{'-' if minutes < 0 else '+'}{hours:02d}:{rest:02d}"
        return text + draw(st.sampled_from(["Z", "z", offset, offset.replace(":", "")]))
    if kind == "naive":
        return text
    if kind == "date":
        return moment.date().isoformat()
    seconds = moment.replace(tzinfo=UTC).timestamp()
    return draw(st.sampled_from([str(int(seconds)), str(int(seconds * 1000)), f"{seconds:.3f}"]))


#: One time of each kind for every ``date-time`` input, and whether the API takes it: a time
#: with a zone or an epoch number (UTC) is accepted; anything else is a 422 that asks for a time
#: with a timezone (a naive time is never read as local time, nor guessed to be UTC).
TIME_SAMPLES: list[tuple[str | int, bool]] = [
    ("2026-01-01T00:00:00Z", True),
    ("2026-01-01 00:00:00+01:00", True),
    ("2026-01-01t00:00:00.123456789z", True),
    ("2026-01-01T00:00-0130", True),
    ("0001-01-01T00:00:00+23:59", True),
    ("9999-12-31T23:59:59.999999-23:59", True),
    ("1767225600", True),
    ("1767225600000", True),
    ("-1.5", True),
    (1767225600, True),
    ("2026-01-01T00:00:00", False),
    ("2026-01-01 00:00:00", False),
    ("2026-01-01T00:00:00.5", False),
    ("2026-01-01", False),
    ("now", False),
    ("2026-02-30T00:00:00Z", False),
    ("Thu, 01 Jan 2026 00:00:00 GMT", False),
    ("99999999999999999999", False),
]


@contextlib.contextmanager
def user_time_formats() -> Iterator[None]:
    """While in force, schemathesis generates :func:`user_times` for ``format: date-time``."""
    schemathesis.openapi.format("date-time", user_times())
    try:
        yield
    finally:
        unregister_string_format("date-time")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServedApp:
    """The app on a real uvicorn server, in a thread with its own event loop."""

    def __init__(self, bootstrap: str, database_url: str) -> None:
        self.bootstrap = bootstrap
        self.database_url = database_url
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.topics: list[str] = []
        #: Ids of seeded resources, by path parameter name.
        self.known: dict[str, list[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fuzz-server", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start()/stop() in the test's thread
            self._error = exc

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        markers = await create_topic(self.bootstrap, 4, prefix="fuzz-markers")
        origin = await create_topic(self.bootstrap, 2, prefix="fuzz-orders")
        dlq = await create_topic(self.bootstrap, 1, prefix="fuzz-orders-dlq")
        self.topics = [markers, origin, dlq]
        settings_ = api_settings(self.bootstrap, self.database_url, markers)
        context = await standalone_api_context(settings_, run_redrive=True)
        try:
            await reset_tables(context)
            await self._seed(context, origin, dlq)
            await serve(create_app(context), "127.0.0.1", self.port, self._stopping)
        finally:
            await context.close()
            await delete_topics(self.bootstrap, self.topics)

    async def _seed(self, context: ApiContext, origin: str, dlq: str) -> None:
        states = [State.IN_FLIGHT, State.DELAYED, State.REJECTED, State.LOST]
        await insert_entries(
            context,
            [
                entry(offset, topic=origin, partition=offset % 2, state=states[offset % 4])
                for offset in range(40)
            ],
        )
        positions = await produce(
            self.bootstrap, dlq, [(b"k%d" % i, b"\x00\xffbinary", []) for i in range(10)]
        )
        dead = await insert_dead_letters(
            context,
            [
                {
                    "origin_topic": origin,
                    "origin_offset": 100 + i,
                    "dlq_topic": dlq,
                    "dlq_partition": p,
                    "dlq_offset": o,
                }
                for i, (p, o) in enumerate(positions)
            ],
        )
        job = await context.jobs.create_redrive_job(
            RedriveSpec(
                selection=DeadLetterFilter(),
                target_topic=None,
                rate=1.0,
                dry_run=True,
                actor="seed",
            ),
            T0,
        )
        self.known = {
            "message_id": [f"billing/{origin}/{o % 2}/{o}" for o in (0, 1, 2, 3)]
            + [f"billing/{origin}/0/100"],
            "dead_letter_id": dead[:3],
            "job_id": [job.id],
        }

    def start(self) -> None:
        self._thread.start()
        with httpx.Client(base_url=self.base_url) as client:
            for _ in range(400):
                if self._error is not None:
                    raise RuntimeError("the fuzz server failed to start") from self._error
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/healthz").status_code == 200:
                        return
                threading.Event().wait(0.05)
        raise RuntimeError("the fuzz server did not come up within 20 s")

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the fuzz server did not stop"
        if self._error is not None:
            raise self._error


@pytest.fixture(params=["sqlite", "postgres"])
def served(
    request: pytest.FixtureRequest, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServedApp]:
    if request.param == "sqlite":
        url = sqlite_url(tmp_path_factory.mktemp("fuzz") / "kmq.sqlite3")
    else:
        url = request.getfixturevalue("postgres_url")
    app = ServedApp(kafka_bootstrap, url)
    app.start()
    try:
        yield app
    finally:
        app.stop()


def _fuzz(
    operation: Any,
    mode: GenerationMode,
    examples: int,
    path_parameters: dict[str, Any] | None = None,
) -> int:
    """Run one operation's generated cases; returns how many requests were sent."""
    sent = 0
    headers = bearer(ADMIN_TOKEN)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
    def check(case: Any) -> None:
        nonlocal sent
        response = case.call(headers=headers, timeout=30)
        sent += 1
        case.validate_response(response, checks=CHECKS, headers=headers)

    try:
        check()
    except Unsatisfiable:
        # Nothing to make invalid (an operation without parameters or body).
        assert mode is GenerationMode.NEGATIVE, f"no valid request for {operation.label}"
    return sent


def _deref(spec: dict[str, Any], node: Any) -> Any:
    """``node`` with its local ``$ref`` (``#/components/schemas/X``) followed."""
    while isinstance(node, dict) and "$ref" in node:
        target: Any = spec
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _time_inputs(
    spec: dict[str, Any], node: Any, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Paths of the ``date-time`` strings in a schema (through ``$ref``, unions, properties)."""
    node = _deref(spec, node)
    if not isinstance(node, dict) or len(path) > 8:
        return
    if node.get("format") == "date-time":
        yield path
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in node.get(key, ()):
            yield from _time_inputs(spec, branch, path)
    for name, sub in node.get("properties", {}).items():
        yield from _time_inputs(spec, sub, (*path, name))


def _with_time(example: Any, path: tuple[str, ...], value: str | int) -> dict[str, Any]:
    """A copy of the body ``example`` with ``value`` at ``path`` (objects made on the way)."""
    body: dict[str, Any] = copy.deepcopy(example) if isinstance(example, dict) else {}
    node = body
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value
    return body


def _sweep_times(operation: Any, spec: dict[str, Any], served: ServedApp) -> tuple[int, int]:
    """Send each time of :data:`TIME_SAMPLES` to each ``date-time`` input of ``operation``, in
    an otherwise valid request; returns (inputs, requests). A time with a zone or an epoch
    number is accepted; anything else is a 422 whose message for that input asks for a
    timezone; every answer also passes the fuzz checks."""
    headers = bearer(ADMIN_TOKEN)
    definition = operation.definition.raw
    inputs: list[tuple[str, tuple[str, ...]]] = []
    for raw in definition.get("parameters", ()):
        parameter = _deref(spec, raw)
        if parameter.get("in") == "query":
            inputs += [
                ("query", (parameter["name"], *p))
                for p in _time_inputs(spec, parameter.get("schema"))
            ]
    body_schema = (
        _deref(spec, definition.get("requestBody", {}))
        .get("content", {})
        .get("application/json", {})
        .get("schema")
    )
    example = (_deref(spec, body_schema) or {}).get("examples", [{}])[0]
    inputs += [("body", p) for p in _time_inputs(spec, body_schema)] if body_schema else []
    if not inputs:
        return 0, 0
    path_parameters = {
        name: served.known[name][0] for name in re.findall(r"{(\w+)}", operation.path)
    }
    sent = 0
    for where, path in inputs:
        for value, accepted in TIME_SAMPLES:
            if where == "query":
                case = operation.Case(query={path[0]: value}, path_parameters=path_parameters)
            else:
                case = operation.Case(
                    body=_with_time(example, path, value),
                    media_type="application/json",
                    path_parameters=path_parameters,
                )
            response = case.call(headers=headers, timeout=30)
            sent += 1
            case.validate_response(response, checks=CHECKS, headers=headers)
            what = f"{operation.label} {where}.{'.'.join(path)}={value!r}"
            if accepted:
                assert response.status_code < 300, f"{what}: {response.text}"
                continue
            assert response.status_code == 422, f"{what}: {response.text}"
            about = [
                item["msg"]
                for item in response.json()["errors"]
                if tuple(item["loc"][1:]) == path and item["loc"][0] == where
            ]
            assert about, f"{what}: no error about the time: {response.text}"
            assert all("timezone" in msg for msg in about), f"{what}: {about}"
    return len(inputs), sent


# schemathesis' generators draw from the `random` module in places; Hypothesis flags that
# (it only affects replaying a failure, which derandomize=True keeps reproducible anyway).
@pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies"
    ":hypothesis.errors.HypothesisDeprecationWarning"
)
def test_no_server_errors_and_no_schema_violations(served: ServedApp) -> None:
    schema = schemathesis.openapi.from_url(f"{served.base_url}/openapi.json")
    operations = 0
    sent = 0
    spec = httpx.get(f"{served.base_url}/openapi.json", timeout=30).json()
    time_inputs = 0
    with user_time_formats():
        for result in schema.get_all_operations():
            assert isinstance(result, Ok), f"the schema is invalid: {result.err()}"
            operation = result.ok()
            operations += 1
            inputs, requests = _sweep_times(operation, spec, served)
            time_inputs += inputs
            sent += requests
            sent += _fuzz(operation, GenerationMode.POSITIVE, POSITIVE_EXAMPLES)
            sent += _fuzz(operation, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES)
            for name in re.findall(r"{(\w+)}", operation.path):
                for value in served.known.get(name, []):
                    sent += _fuzz(operation, GenerationMode.POSITIVE, KNOWN_EXAMPLES, {name: value})
    assert operations >= 18, f"only {operations} operations in the schema"
    # due_before/due_after, since/until (GET /v1/dlq) and the redrive filter's since/until.
    assert time_inputs >= 6, f"only {time_inputs} date-time inputs found in the schema"
    assert sent >= operations * 20, f"only {sent} requests for {operations} operations"
