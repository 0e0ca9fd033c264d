"""Property-based fuzzing of the admin API against its own OpenAPI schema (schemathesis).

The app is served by uvicorn (``api.server.serve``) in a thread of its own, on a real store
(SQLite, then PostgreSQL) and the real broker, with data to find: tracked messages, dead
letters with records on a DLQ topic, a running redrive runner. For every operation, schemathesis
generates valid requests and invalid ones (a bounded number of each) and sends them with the
admin token; every answer must be a documented status code, never a 5xx, with a body that
matches the documented schema and content type.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
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
from tracker.engine.entries import State
from tracker.store.admin import DeadLetterFilter, RedriveSpec

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
        context = await ApiContext.standalone(settings_, run_redrive=True)
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
        job = await context.admin.create_redrive_job(
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
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"the schema is invalid: {result.err()}"
        operation = result.ok()
        operations += 1
        sent += _fuzz(operation, GenerationMode.POSITIVE, POSITIVE_EXAMPLES)
        sent += _fuzz(operation, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES)
        for name in re.findall(r"{(\w+)}", operation.path):
            for value in served.known.get(name, []):
                sent += _fuzz(operation, GenerationMode.POSITIVE, KNOWN_EXAMPLES, {name: value})
    assert operations >= 18, f"only {operations} operations in the schema"
    assert sent >= operations * 20, f"only {sent} requests for {operations} operations"
