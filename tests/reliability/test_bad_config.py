"""Bad configuration: ``kmq-tracker run`` refuses it at once, in one clear line.

Each case starts a real ``kmq-tracker run`` process (several at a time) with a bad setting in
the environment or in a TOML file, and expects it to exit non-zero within ``EXIT_WITHIN``
seconds with exactly one line on stderr, ``kmq-tracker: ...``, that names the setting (so an
operator knows what to fix without reading a traceback).

Two tables:

* **invalid settings**: values the settings model refuses (or a configuration file that is
  missing or is not TOML); nothing is started, nothing is logged, exit code 2;
* **unusable resources**: settings that validate but name a database that cannot be used (a
  file in a missing directory, a server that refuses connections, a schema not migrated, a
  database that serves another markers topic).
  These fail in the first second of startup, after logging is configured: the last line of
  stderr must be the one-line message, and there must be no traceback and no "Unclosed ..."
  complaint about clients that were never closed.

The broker address points at a closed port in every case: no case may get as far as Kafka.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.databases import sqlite_url

from tracker.store.database import SqlDatabase
from tracker.store.migrate import upgrade
from tracker.store.topic_binding import bind_markers_topic, bound_markers_topic

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
EXIT_WITHIN = 20.0  #: generous for a loaded CI machine; a refused setting takes ~1 s
PARALLEL = 4


@dataclass(frozen=True)
class Case:
    id: str
    env: dict[str, str] = field(default_factory=dict)
    toml: str | None = None  #: written to a file passed with --config
    config_arg: str | None = None  #: --config value (when not a written file)
    names: tuple[str, ...] = ()  #: words the one line must contain (the setting)
    command: str = "run"  #: the kmq-tracker command to start
    args: tuple[str, ...] = ()  #: arguments after the command


INVALID_SETTINGS = [
    Case("zero markers partitions", {"KMQ_MARKERS_PARTITIONS": "0"}, names=("markers_partitions",)),
    Case("unknown database", {"KMQ_DATABASE_URL": "mysql://kmq@db/kmq"}, names=("database_url",)),
    Case("negative window", {"KMQ_COALESCE_WINDOW": "-1"}, names=("coalesce_window",)),
    Case("unreadable duration", {"KMQ_CLAIM_LEASE": "soon"}, names=("claim_lease",)),
    Case("claim lease too short", {"KMQ_CLAIM_LEASE": "0.5"}, names=("claim_lease",)),
    Case("short api token", {"KMQ_API_TOKEN": "short"}, names=("api_token",)),
    Case(
        "read token equals admin token",
        {"KMQ_API_TOKEN": "same-token-1234", "KMQ_API_READ_TOKEN": "same-token-1234"},
        names=("api_read_token",),
    ),
    Case("illegal markers topic", {"KMQ_MARKERS_TOPIC": "bad topic"}, names=("markers_topic",)),
    Case(
        "invalid topic equals markers topic",
        {"KMQ_MARKERS_TOPIC": "kmq-m", "KMQ_INVALID_MARKERS_TOPIC": "kmq-m"},
        names=("invalid_markers_topic",),
    ),
    Case("zero max attempts", {"KMQ_DEFAULT_POLICY__MAX_ATTEMPTS": "0"}, names=("max_attempts",)),
    Case("unknown log level", {"KMQ_LOG_LEVEL": "LOUD"}, names=("log_level",)),
    Case("port out of range", {"KMQ_HTTP_PORT": "70000"}, names=("http_port",)),
    Case("zero pending markers", {"KMQ_MAX_PENDING_MARKERS": "0"}, names=("max_pending_markers",)),
    Case("huge redelivery batch", {"KMQ_REDELIVERY_BATCH": "1000000"}, names=("redelivery_batch",)),
    Case(
        "SASL without credentials",
        {"KMQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"},
        names=("kafka_sasl_mechanism",),
    ),
    Case(
        "TLS key without certificate",
        {"KMQ_KAFKA_SECURITY_PROTOCOL": "SSL", "KMQ_KAFKA_SSL_KEYFILE": "/etc/kmq/key.pem"},
        names=("kafka_ssl_certfile",),
    ),
    Case(
        "client config is not JSON",
        {"KMQ_KAFKA_CLIENT_CONFIG": "{security_protocol: SSL"},
        names=("kafka_client_config",),
    ),
    Case(
        "unknown key in TOML", toml='markers_topik = "orders-markers"\n', names=("markers_topik",)
    ),
    Case(
        "illegal topic in TOML",
        toml='[topics."bad topic"]\nmax_attempts = 3\n',
        names=("topics",),
    ),
    Case(
        "backoff initial over max",
        toml="[default_policy.backoff]\ninitial = 60\nmax = 1\n",
        names=("backoff",),
    ),
    Case("TOML that is not TOML", toml='markers_topic = "x"\n[[broken\n', names=("kmq.toml",)),
    Case(
        "missing config file", config_arg="/nonexistent/kmq.toml", names=("/nonexistent/kmq.toml",)
    ),
]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: connecting is refused


#: A SQLite file that serves ``BOUND_TOPIC``; the cases run with the default markers topic.
BOUND_DATABASE = "bound.sqlite3"
BOUND_TOPIC = "orders-markers"


async def bind_database(path: Path, markers_topic: str) -> None:
    database = SqlDatabase.from_url(sqlite_url(path))
    try:
        await upgrade(database.engine)
        await bind_markers_topic(database, markers_topic, by="test", now_ms=0)
    finally:
        await database.close()


def unusable_resources(tmp: Path, taken_port: int) -> list[Case]:
    port = _closed_port()
    return [
        Case(
            # Refused before the database and Kafka are touched: with the broker's port
            # closed, getting as far as Kafka would fail on Kafka, after its timeout.
            "HTTP port already taken",
            {"KMQ_API_ENABLED": "true", "KMQ_HTTP_PORT": str(taken_port)},
            names=("HTTP API", str(taken_port)),
        ),
        Case(
            "migrate to an unknown revision",
            {"KMQ_DATABASE_URL": sqlite_url(tmp / "unknown-revision.sqlite3")},
            names=("bogus",),
            command="migrate",
            args=("--revision", "bogus"),
        ),
        Case(
            "sqlite file in a missing directory",
            {"KMQ_DATABASE_URL": sqlite_url(tmp / "missing-dir" / "kmq.sqlite3")},
            names=("database",),
        ),
        Case(
            "migrate into a missing directory",
            {"KMQ_DATABASE_URL": sqlite_url(tmp / "missing-dir" / "kmq.sqlite3")},
            names=("database",),
            command="migrate",
        ),
        Case(
            "postgres server refusing connections",
            {"KMQ_DATABASE_URL": f"postgresql+asyncpg://kmq@127.0.0.1:{port}/kmq"},
            names=("database",),
        ),
        Case(
            "database serving another markers topic",
            {"KMQ_DATABASE_URL": sqlite_url(tmp / BOUND_DATABASE)},
            names=(BOUND_TOPIC, "kmq-markers", "rebind-markers-topic --from"),
        ),
        Case(
            "API on a database serving another markers topic",
            {"KMQ_DATABASE_URL": sqlite_url(tmp / BOUND_DATABASE)},
            names=(BOUND_TOPIC, "kmq-markers"),
            command="api",
        ),
        Case(
            "rebind from a markers topic the database does not serve",
            {"KMQ_DATABASE_URL": sqlite_url(tmp / BOUND_DATABASE)},
            names=(BOUND_TOPIC, "payments-markers", "nothing changed"),
            command="rebind-markers-topic",
            args=("--from", "payments-markers"),
        ),
        Case(
            "schema not migrated",
            {
                "KMQ_DATABASE_URL": sqlite_url(tmp / "empty.sqlite3"),
                "KMQ_MIGRATE_ON_START": "false",
            },
            names=("migrate",),
        ),
    ]


@dataclass
class Outcome:
    case: Case
    code: int | None
    seconds: float
    stderr: list[str]


async def run_case(case: Case, tmp: Path, semaphore: asyncio.Semaphore) -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KMQ_")}
    env.update(
        {
            "KMQ_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{_closed_port()}",
            "KMQ_DATABASE_URL": sqlite_url(tmp / f"{abs(hash(case.id))}.sqlite3"),
            "KMQ_MIGRATE_ON_START": "true",
            "KMQ_API_ENABLED": "false",
            "KMQ_HTTP_PORT": "0",
        }
    )
    env.update(case.env)
    args = [sys.executable, "-m", "tracker.cli", case.command, *case.args]
    if case.toml is not None:
        directory = tmp / f"case-{abs(hash(case.id))}"
        directory.mkdir()
        path = directory / "kmq.toml"
        path.write_text(case.toml)
        args += ["--config", str(path)]
    elif case.config_arg is not None:
        args += ["--config", case.config_arg]
    async with semaphore:
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *args,
            env=env,
            cwd=str(tmp),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, err = await asyncio.wait_for(process.communicate(), EXIT_WITHIN)
        except TimeoutError:
            process.kill()
            _, err = await process.communicate()
            return Outcome(case, None, time.monotonic() - started, err.decode().splitlines())
        return Outcome(
            case, process.returncode, time.monotonic() - started, err.decode().splitlines()
        )


def _problem(outcome: Outcome, *, only_line: bool) -> str | None:
    case, lines = outcome.case, outcome.stderr
    if outcome.code is None:
        return f"still running after {EXIT_WITHIN:.0f}s"
    if outcome.code == 0:
        return "exited with code 0"
    if only_line and len(lines) != 1:
        return f"{len(lines)} lines on stderr (want 1): {lines[:3]} ... {lines[-3:]}"
    if not lines:
        return "nothing on stderr"
    last = lines[-1]
    if any("Traceback" in line for line in lines):
        return "a traceback on stderr:\n" + "\n".join(lines)
    if any(line.startswith("Unclosed") or "Unclosed " in line for line in lines):
        return f"clients left unclosed: {[x for x in lines if 'Unclosed' in x]}"
    if not last.startswith("kmq-tracker: "):
        return f"the last line is not a kmq-tracker message: {last!r}"
    missing = [word for word in case.names if word not in last]
    if missing:
        return f"the message does not name {missing}: {last!r}"
    return None


async def _run_table(cases: list[Case], tmp: Path, *, only_line: bool) -> list[Outcome]:
    semaphore = asyncio.Semaphore(PARALLEL)
    outcomes = await asyncio.gather(*(run_case(case, tmp, semaphore) for case in cases))
    problems = {
        o.case.id: problem
        for o in outcomes
        if (problem := _problem(o, only_line=only_line)) is not None
    }
    slowest = max(o.seconds for o in outcomes)
    print(
        f"\n[bad config] {len(cases)} cases, slowest exit {slowest:.1f}s, "
        f"{len(problems)} not refused cleanly: {sorted(problems)}"
    )
    for o in outcomes:
        print(f"  {o.case.id}: exit {o.code} in {o.seconds:.1f}s: {o.stderr[-1:] or '-'}")
    assert problems == {}, "\n".join(f"{k}: {v}" for k, v in problems.items())
    return outcomes


async def test_invalid_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    outcomes = await _run_table(INVALID_SETTINGS, tmp_path, only_line=True)
    assert {o.code for o in outcomes} == {2}


async def test_unusable_resources_are_reported_in_one_line(tmp_path: Path) -> None:
    await bind_database(tmp_path / BOUND_DATABASE, BOUND_TOPIC)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cases = unusable_resources(tmp_path, taken.getsockname()[1])
        outcomes = await _run_table(cases, tmp_path, only_line=False)
    port_taken = next(o for o in outcomes if o.case.id == "HTTP port already taken")
    assert port_taken.seconds < 10, "a taken port must fail the start at once"
    database = SqlDatabase.from_url(sqlite_url(tmp_path / BOUND_DATABASE))
    try:  # refused and left alone: still bound to its topic
        assert await bound_markers_topic(database) == BOUND_TOPIC
    finally:
        await database.close()
