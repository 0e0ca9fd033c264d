"""``kmq-tracker run`` as a real subprocess in its own session, logging JSON lines to stderr.

Tests that need the process as an operator runs it (signals, exit status, what it logs) use
:class:`TrackerRun`; readiness is read from its HTTP API.
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

from support.broker import free_port, unique_topic
from support.databases import sqlite_url

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN = 20.0  #: from the signal to the exit; ~3 s is usual, creating a topic waits 30 s
READY_WITHIN = 60.0

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


def ready(readiness: Any) -> bool:
    return bool(readiness.get("ready"))


def broker_down(readiness: Any) -> bool:
    return readiness.get("checks", {}).get("broker", {}).get("ok") is False
