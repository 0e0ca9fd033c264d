"""``kmq-tracker run`` stops cleanly on SIGINT and SIGTERM, also while the broker is away.

Each test starts a real ``kmq-tracker run`` in its own session and signals its whole process
group, as a terminal's Ctrl-C or a container runtime does, with the broker:

* answering (the session's cluster: an external one when ``KAFKA_BOOTSTRAP_SERVERS`` is set);
* gone while the tracker runs (a private tansu broker, stopped once readiness reports it);
* never there (an address where nothing listens: the tracker is still starting).

A clean stop is: exit status 0 within ``STOP_WITHIN`` seconds, and on stderr nothing but
JSON log records, none with a traceback, none from ``asyncio`` (where "Unclosed
AIOKafkaProducer" and lost task exceptions are reported), and no error but aiokafka's
complaints about the connections it cannot make while the broker is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.broker import TansuBroker, delete_topics, free_port, unique_topic
from support.databases import sqlite_url

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN = 20.0  #: signal to exit; ~3 s is usual, a startup gives up on Kafka after 30 s
READY_WITHIN = 60.0
BROKER_DOWN_WITHIN = 30.0  #: readiness says the broker is down ~5 s after it went away
SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")]

Record = dict[str, Any]


class TrackerRun:
    """``python -m tracker.cli run`` in its own session, logging JSON lines to stderr."""

    def __init__(self, bootstrap: str, tmp_path: Path) -> None:
        self.markers = unique_topic("clean-stop-markers")
        self.http_port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KMQ_")}
        self.env.update(
            {
                "KMQ_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
                "KMQ_DATABASE_URL": sqlite_url(tmp_path / "kmq.sqlite3"),
                "KMQ_MIGRATE_ON_START": "true",
                "KMQ_MARKERS_TOPIC": self.markers,
                "KMQ_MARKERS_PARTITIONS": "2",
                "KMQ_TRACKER_GROUP": unique_topic("clean-stop-tracker"),
                "KMQ_HTTP_PORT": str(self.http_port),
                "KMQ_LOG_FORMAT": "json",
                "KMQ_LOG_LEVEL": "INFO",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.stderr: list[str] = []
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TrackerRun:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tracker.cli",
            "run",
            env=self.env,
            cwd=str(ROOT),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.process is not None
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            self.stderr.append(raw.decode(errors="replace").rstrip("\n"))

    async def __aexit__(self, *exc: object) -> None:
        if self.process is not None and self.process.returncode is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 10)

    @property
    def log(self) -> str:
        return "\n".join(self.stderr)

    def records(self) -> list[Record]:
        """The stderr lines that are JSON log records (so far)."""
        found = []
        for line in self.stderr:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    found.append(record)
        return found

    def check_alive(self) -> None:
        assert self.process is not None
        assert self.process.returncode is None, (
            f"the tracker exited with {self.process.returncode}:\n{self.log}"
        )

    async def wait_for_record(self, what: str, match: Callable[[Record], bool]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_WITHIN
        while not any(match(record) for record in self.records()):
            self.check_alive()
            assert loop.time() < deadline, f"no log record {what} within:\n{self.log}"
            await asyncio.sleep(0.1)

    async def wait_for_readiness(
        self, what: str, match: Callable[[Any], bool], within: float = READY_WITHIN
    ) -> None:
        """Poll ``/readyz`` until its answer (``{"ready": ..., "checks": ...}``) matches."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        last: object = None
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.http_port}") as http:
            while True:
                self.check_alive()
                with contextlib.suppress(httpx.TransportError):
                    last = (await http.get("/readyz", timeout=5)).json()
                    if match(last):
                        return
                assert loop.time() < deadline, f"readiness never {what} (last: {last}):\n{self.log}"
                await asyncio.sleep(0.2)

    async def stop_with(self, signum: int) -> int:
        """Send ``signum`` to the tracker's process group; its exit code (bounded wait)."""
        assert self.process is not None
        self.check_alive()
        os.killpg(self.process.pid, signum)
        try:
            code = await asyncio.wait_for(self.process.wait(), STOP_WITHIN)
        except TimeoutError:
            raise AssertionError(
                f"still running {STOP_WITHIN:.0f}s after {signal.Signals(signum).name}:\n{self.log}"
            ) from None
        assert self._reader is not None
        await asyncio.wait_for(self._reader, 10)
        return code


def assert_clean_stop(run: TrackerRun, code: int, *, broker_away: bool) -> None:
    """Exit 0, and stderr holds only log records, without a traceback or asyncio complaint.

    Errors are allowed only from aiokafka while the broker is away (its connection attempts).
    """
    assert code == 0, f"exit status {code}:\n{run.log}"
    records = run.records()
    assert len(records) == len(run.stderr), f"stderr holds more than log records:\n{run.log}"
    for record in records:
        logger = str(record.get("logger"))
        assert "exception" not in record, f"a traceback was logged:\n{run.log}"
        assert logger != "asyncio", f"asyncio complained:\n{run.log}"
        if record.get("level") in ("ERROR", "CRITICAL"):
            expected = broker_away and logger.startswith("aiokafka")
            assert expected, f"an error was logged:\n{run.log}"


def ready(readiness: Any) -> bool:
    return bool(readiness.get("ready"))


def broker_down(readiness: Any) -> bool:
    return readiness.get("checks", {}).get("broker", {}).get("ok") is False


async def test_run_stops_cleanly_on_ctrl_c_while_the_broker_answers(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    run = TrackerRun(kafka_bootstrap, tmp_path)
    try:
        async with run:
            await run.wait_for_readiness("ready", ready)
            code = await run.stop_with(signal.SIGINT)
    finally:
        await delete_topics(kafka_bootstrap, [run.markers, f"{run.markers}.invalid"])
    assert_clean_stop(run, code, broker_away=False)


@pytest.mark.parametrize("signum", SIGNALS)
async def test_run_stops_cleanly_while_the_broker_is_away(signum: int, tmp_path: Path) -> None:
    broker = TansuBroker(log_dir=tmp_path / "tansu")
    async with broker, TrackerRun(broker.bootstrap_servers, tmp_path) as run:
        await run.wait_for_readiness("ready", ready)
        await broker.astop()
        await run.wait_for_readiness(
            "reporting the broker down", broker_down, within=BROKER_DOWN_WITHIN
        )
        code = await run.stop_with(signum)
    assert_clean_stop(run, code, broker_away=True)


@pytest.mark.parametrize("signum", SIGNALS)
async def test_run_stops_cleanly_while_starting_without_a_broker(
    signum: int, tmp_path: Path
) -> None:
    async with TrackerRun(f"127.0.0.1:{free_port()}", tmp_path) as run:
        # aiokafka complains about each refused connection: the tracker is waiting for Kafka.
        await run.wait_for_record(
            "from aiokafka", lambda record: str(record.get("logger")).startswith("aiokafka")
        )
        code = await run.stop_with(signum)
    assert_clean_stop(run, code, broker_away=True)
