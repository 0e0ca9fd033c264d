"""Shared pieces of the benchmark scenarios: infrastructure, figures with targets, statistics.

Every scenario measures the product next to a baseline *in the same run* (the machine is shared
and noisy, so absolute numbers move; ratios against a same-run baseline are what is judged).
Each result is a :class:`Figure` with its target and a PASS/MISS verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from tracker.kafka.topic_admin import ensure_topic, topic_partitions

ROOT = Path(__file__).resolve().parent.parent
KAFKA_ENV = "KAFKA_BOOTSTRAP_SERVERS"
POSTGRES_ENV = "KMQ_BENCH_POSTGRES_URL"

#: Consumer-group settings that keep joins short on tansu (a join takes ~half the session).
FAST_GROUP: dict[str, Any] = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}

Op = Literal["<=", ">="]


# -- figures ----------------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured figure; with a target it gets a PASS/MISS verdict."""

    name: str
    value: float | None
    unit: str
    target: float | None = None
    op: Op = ">="
    note: str = ""

    @property
    def status(self) -> str:
        if self.target is None:
            return "INFO"
        if self.value is None or math.isnan(self.value):
            return "MISS"
        ok = self.value >= self.target if self.op == ">=" else self.value <= self.target
        return "PASS" if ok else "MISS"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": None if self.value is None else round(self.value, 4),
            "unit": self.unit,
            "target": self.target,
            "op": self.op if self.target is not None else None,
            "status": self.status,
            "note": self.note,
        }

    def line(self) -> str:
        value = "n/a" if self.value is None else f"{self.value:,.3f}".rstrip("0").rstrip(".")
        target = f"  target {self.op} {self.target:g}" if self.target is not None else ""
        return f"  [{self.status:4}] {self.name}: {value} {self.unit}{target}"


@dataclass
class ScenarioResult:
    scenario: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  #: raw series for plots and the JSON
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        print(figure.line(), flush=True)
        return figure

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "title": self.title,
            "seconds": round(self.seconds, 1),
            "figures": [f.as_dict() for f in self.figures],
            "data": self.data,
            "notes": self.notes,
        }


# -- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max of durations in seconds, in milliseconds."""
    return {
        "n": len(seconds),
        "p50_ms": percentile(seconds, 50) * 1000,
        "p95_ms": percentile(seconds, 95) * 1000,
        "p99_ms": percentile(seconds, 99) * 1000,
        "max_ms": (max(seconds) * 1000) if seconds else math.nan,
    }


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def rss_mb(pid: int | None = None) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MiB, from /proc (Linux)."""
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    values: dict[str, float] = {}
    for line in status.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", math.nan), values.get("VmHWM", math.nan)


class Stopwatch:
    def __init__(self) -> None:
        self.started = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


# -- infrastructure ---------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(5)}"


@dataclass
class Infra:
    """Where the scenarios run: a Kafka cluster, a Postgres server, a scratch directory."""

    bootstrap: str
    scratch: Path
    postgres_server: str | None = None  #: server URL (a fresh database is made per use)
    external_kafka: bool = False
    _databases: list[Any] = field(default_factory=list)

    def sqlite_url(self, name: str) -> str:
        return f"sqlite+aiosqlite:///{self.scratch / (name + '.sqlite3')}"

    def postgres_url(self) -> str:
        """A fresh, empty Postgres database (dropped by :meth:`close`)."""
        database = _postgres_database(self.postgres_server)
        url: str = database.create()
        self._databases.append(database)
        return url

    def database_url(self, store: str, name: str) -> str:
        return self.sqlite_url(name) if store == "sqlite" else self.postgres_url()

    def drop_databases(self) -> None:
        while self._databases:
            with contextlib.suppress(Exception):
                self._databases.pop().drop()


def _postgres_database(server: str | None) -> Any:
    """A ``PostgresTestDatabase`` from the test harness (tests/support/databases.py)."""
    tests_dir = str(ROOT / "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    databases = importlib.import_module("support.databases")
    return databases.PostgresTestDatabase(server, prefix="kmq_bench")


@contextlib.contextmanager
def infrastructure(scratch: Path | None = None) -> Iterator[Infra]:
    """Start a tansu broker unless ``KAFKA_BOOTSTRAP_SERVERS`` names a cluster; SQLite in a
    temp dir; Postgres from ``KMQ_BENCH_POSTGRES_URL`` or the local default server."""
    external = os.environ.get(KAFKA_ENV, "").strip()
    postgres = os.environ.get(POSTGRES_ENV, "").strip() or None
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kmq-bench-")))
        if external:
            bootstrap = external
        else:
            from tracker.localbroker import LocalBroker  # noqa: PLC0415

            broker = stack.enter_context(LocalBroker(startup_timeout=30))
            bootstrap = broker.bootstrap_servers
        infra = Infra(bootstrap, scratch, postgres, external_kafka=bool(external))
        try:
            yield infra
        finally:
            infra.drop_databases()


async def create_topic(
    bootstrap: str, name: str, partitions: int, configs: Mapping[str, str] | None = None
) -> str:
    await ensure_topic(bootstrap, name, partitions=partitions, configs=configs)
    return name


async def delete_topics(bootstrap: str, names: Sequence[str]) -> None:
    """Best effort: frees the broker's memory (tansu keeps everything in memory)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        await admin.delete_topics(list(names))
    except Exception as exc:
        print(f"  (could not delete topics {list(names)}: {exc!r})")
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def topics(
    bootstrap: str, spec: Mapping[str, int], configs: Mapping[str, str] | None = None
) -> AsyncIterator[None]:
    for name, partitions in spec.items():
        await create_topic(bootstrap, name, partitions, configs)
    try:
        yield
    finally:
        await delete_topics(bootstrap, list(spec))


async def highwaters(bootstrap: str, topic: str) -> dict[int, int]:
    """Per partition, the high watermark as reported by a *fetch* (tansu's ListOffsets is wrong
    after batched produces, see docs/testing.md)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        # Asked of the cluster: a consumer's metadata only covers its own topics on Kafka.
        count = await topic_partitions(bootstrap, topic)
        tps = [TopicPartition(topic, p) for p in range(count or 0)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, 0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=100, max_records=1)
            marks = {tp.partition: consumer.highwater(tp) for tp in tps}
            if all(v is not None for v in marks.values()):
                return {p: int(v) for p, v in marks.items() if v is not None}
        raise TimeoutError(f"no high watermarks for {topic}")
    finally:
        await consumer.stop()


async def wait_until(
    check: Callable[[], Any], within: float, what: str, interval: float = 0.05
) -> float:
    """Poll a sync or async predicate until true; returns the perf_counter when it held."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.perf_counter()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


def python_loop_us() -> float:
    """Microseconds for a fixed pure-Python loop (``sum(range(10_000))``, best of 5).

    Why: the same VM has run Python more than 2x slower on one day than on another (the
    unit suite in 135 s against 60 s), and within a sitting this loop has taken from 166 to
    304 us a minute apart; that moves every absolute figure and every CPU-bound cell. The runs
    and re-runs of one results file record it at their start, so that figures of different
    sittings can be told apart from the code's own changes (a snapshot, not a guarantee for
    the whole run).
    """
    import timeit  # noqa: PLC0415

    loops = 200
    best = min(timeit.repeat("sum(range(10_000))", number=loops, repeat=5))
    return round(best / loops * 1e6, 1)


def machine() -> dict[str, Any]:
    import platform  # noqa: PLC0415

    load = os.getloadavg()
    return {
        "python": platform.python_version(),
        "processor": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "python_loop_us": python_loop_us(),
    }
