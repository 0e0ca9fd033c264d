"""Shared fixtures: a Kafka-protocol cluster, fresh topics, and databases (SQLite + Postgres).

Everything here is lazy: a fixture starts the broker or touches Postgres only when a test asks
for it, so ``pytest tests/unit`` starts nothing. See docs/testing.md.

Imports use ``support.*`` (not ``tests.support.*``) because ``tests/`` has no ``__init__.py``:
pytest's default ``prepend`` import mode puts ``tests/`` itself on ``sys.path``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from support.broker import (
    LocalBroker,
    TopicFactory,
    create_topic,
    delete_topics,
    run_sync,
    wait_for_kafka,
)
from support.databases import PostgresTestDatabase, PostgresUnavailableError
from support.databases import sqlite_url as make_sqlite_url

from tracker.store.dialects import create_engine
from tracker.store.migrate import upgrade

#: Set to ``host:port[,host:port...]`` to run against that cluster instead of a tansu broker.
KAFKA_BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"
_EXTERNAL_KAFKA_WAIT = 30.0


def _external_bootstrap() -> str | None:
    return os.environ.get(KAFKA_BOOTSTRAP_ENV, "").strip() or None


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """Undo what a test's run of a command's ``main()`` did to the root logger.

    ``kmq-tracker run`` (``tracker.logs.configure_logging``) gives the root logger a handler
    on ``sys.stderr``, which during a test is the stream pytest captured for that test. Left
    in place, it outlived that stream: py4j closing the Spark session's connections at the
    end of the run logged through it and printed a ``--- Logging error ---`` traceback.
    Handlers a test added are removed (pytest's own come and go with each phase), and the
    levels it changed are put back.
    """
    root = logging.getLogger()
    before = set(root.handlers)
    levels = {name: logging.getLogger(name).level for name in ("", "aiokafka")}
    yield
    for handler in root.handlers[:]:
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(scope="session")
def tansu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker | None]:
    """The session's tansu broker, or None when ``KAFKA_BOOTSTRAP_SERVERS`` names a cluster.

    Ask for this (rather than ``kafka_bootstrap``) only to restart the broker or to adapt to
    tansu quirks; note that a restart wipes every topic of the session (memory storage).
    """
    if _external_bootstrap() is not None:
        yield None
        return
    broker = LocalBroker(log_dir=tmp_path_factory.mktemp("tansu"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(tansu_broker: LocalBroker | None) -> str:
    """``host:port`` of the session's Kafka-protocol cluster (tansu unless overridden)."""
    if tansu_broker is not None:
        return tansu_broker.bootstrap_servers
    external = _external_bootstrap()
    assert external is not None
    problem: str | None = None
    try:
        run_sync(lambda: wait_for_kafka(external, within=_EXTERNAL_KAFKA_WAIT))
    except Exception as exc:
        problem = str(exc)
    if problem is not None:
        pytest.fail(
            f"{KAFKA_BOOTSTRAP_ENV}={external!r} did not answer Kafka requests: {problem}",
            pytrace=False,
        )
    return external


@pytest.fixture
async def topic_factory(kafka_bootstrap: str) -> AsyncIterator[TopicFactory]:
    """``await topic_factory(partitions=3)`` creates a fresh topic and returns its name.

    The topic's partitions all have a leader in the metadata when the call returns. Optional
    ``prefix=`` (name prefix) and ``configs=`` (topic configs, e.g. ``{"retention.ms": "60000"}``).
    The topics are deleted after the test (best effort).
    """
    created: list[str] = []

    async def make(
        partitions: int = 1,
        *,
        prefix: str = "test",
        configs: Mapping[str, str] | None = None,
    ) -> str:
        name = await create_topic(kafka_bootstrap, partitions, prefix=prefix, configs=configs)
        created.append(name)
        return name

    yield make
    await delete_topics(kafka_bootstrap, created)


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """Name of a database at the latest schema that ``postgres_url`` copies (this session's)."""
    for url in _fresh_postgres_database():
        run_sync(functools.partial(_migrate, url))
        yield make_url(url).database or ""


async def _migrate(url: str) -> None:
    engine = create_engine(url)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()  # a template must have no connections when it is copied


@pytest.fixture
def postgres_url(postgres_template: str) -> Iterator[str]:
    """``postgresql+asyncpg://`` URL of a database of this test's own, at the latest schema,
    dropped after the test.

    Not shared with other tests: a database serves one markers topic (a tracker refuses one
    bound to another), and a tracker replica claims every due entry of its markers partitions,
    whoever wrote it. A copy of a migrated template costs ~0.2 s; a migration, twice that.
    The server comes from ``KMQ_TEST_POSTGRES_URL`` or the local default; no server is an error.
    """
    yield from _fresh_postgres_database(template=postgres_template)


@pytest.fixture
def empty_postgres_url() -> Iterator[str]:
    """Like ``postgres_url``, but an empty database (no schema): for the migration tests."""
    yield from _fresh_postgres_database()


def _fresh_postgres_database(template: str | None = None) -> Iterator[str]:
    """Create a database (empty, or a copy of ``template``), yield its URL, drop it; no server
    fails the test."""
    options = "" if template is None else f'TEMPLATE "{template}"'
    database = PostgresTestDatabase(options=options)
    problem: str | None = None
    try:
        url = database.create()
    except PostgresUnavailableError as exc:
        problem = str(exc)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    try:
        yield url
    finally:
        database.drop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """``sqlite+aiosqlite:///<tmp>/kmq.sqlite3``: a fresh SQLite database file for this test."""
    return make_sqlite_url(tmp_path / "kmq.sqlite3")


@pytest.fixture(params=["sqlite", "postgres"], ids=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs twice: on a fresh SQLite file, and on a fresh Postgres
    database (``postgres_url``); both are the test's own."""
    url = request.getfixturevalue(f"{request.param}_url")
    assert isinstance(url, str)
    return url
