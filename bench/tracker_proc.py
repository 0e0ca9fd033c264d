"""A tracker replica with its admin API on real uvicorn, in its own process (for RSS and HTTP).

``python -m bench.tracker_proc SETTINGS_JSON PORT``: builds a tracker (``create_tracker``) from the
JSON settings, serves ``api.app.create_app(engine_api_context(tracker))`` on ``PORT``, prints
``READY`` once the API answers and the tracker owns markers partitions, and runs until SIGTERM.

``python -m bench.tracker_proc SETTINGS_JSON PORT api``: the admin API alone, as
``kmq-tracker api`` runs it (``tracker.runtime.create_standalone_app``: its own store and Kafka
clients, no engine), next to a replica on the same store; ``READY`` once it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

from tracker.gc_policy import apply_gc_policy

from .common import ROOT, rss_mb


async def _ready(port: int, waiting: Callable[[], bool], within: float = 60) -> None:
    """Until ``/healthz`` answers 200 and ``waiting()`` is false (or ``within`` seconds)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/healthz")).status_code == 200 and not waiting():
                    return
            await asyncio.sleep(0.1)


async def _api_only(settings_json: str, port: int) -> None:
    from api.server import serve  # noqa: PLC0415
    from tracker.runtime import create_standalone_app  # noqa: PLC0415
    from tracker.settings import TrackerSettings  # noqa: PLC0415

    logging.basicConfig(level=logging.ERROR)
    settings = TrackerSettings(**json.loads(settings_json))
    apply_gc_policy(settings.gc_gen0_threshold)  # as `kmq-tracker api` does
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    app = create_standalone_app(settings)
    server = asyncio.create_task(serve(app, "127.0.0.1", port, stopping))
    try:
        await _ready(port, lambda: False)
        print("READY", flush=True)
        await stopping.wait()
    finally:
        stopping.set()
        await server


async def _main(settings_json: str, port: int) -> None:
    from api.app import create_app  # noqa: PLC0415
    from api.server import serve  # noqa: PLC0415
    from tracker.runtime import create_tracker, engine_api_context  # noqa: PLC0415
    from tracker.settings import TrackerSettings  # noqa: PLC0415

    logging.basicConfig(level=logging.ERROR)
    # The replica's own HTTP service on a free port (the API is served on ``port`` below):
    # the bench must not need 8080.
    settings = TrackerSettings(**{"http_port": 0, **json.loads(settings_json)})
    apply_gc_policy(settings.gc_gen0_threshold)  # as `kmq-tracker run` does
    tracker = create_tracker(settings)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    await tracker.start()
    context = engine_api_context(tracker)
    server = asyncio.create_task(serve(create_app(context), "127.0.0.1", port, stopping))
    try:
        await _ready(port, lambda: not tracker.ingest.owned_epochs())
        print("READY", flush=True)
        await stopping.wait()
    finally:
        stopping.set()
        with contextlib.suppress(Exception):
            await server
        await context.close()
        await tracker.close()


class TrackerProcess:
    """Start/stop the subprocess; its RSS from /proc."""

    def __init__(
        self, settings: dict[str, Any], port: int, log: Path, *, api_only: bool = False
    ) -> None:
        self._settings = settings
        self._api_only = api_only
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self._log_path = log
        self._log: IO[bytes] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def start(self, within: float = 90) -> None:
        self._log = self._log_path.open("wb")
        self._process = subprocess.Popen(  # noqa: S603, ASYNC220 - our own module; returns at once
            [
                sys.executable,
                "-m",
                "bench.tracker_proc",
                json.dumps(self._settings, default=str),
                str(self.port),
                *(["api"] if self._api_only else []),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        assert self._process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self._process.stdout.readline), within)
        if line.strip() != b"READY":
            await self.stop()
            tail = self._log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"tracker process did not come up: {line!r}\n{tail}")

    def rss(self) -> tuple[float, float]:
        return rss_mb(self.pid)

    async def stop(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 60)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait, 10)
        if process is not None and process.stdout is not None:
            process.stdout.close()
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None


if __name__ == "__main__":
    main = _api_only if sys.argv[3:] == ["api"] else _main
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
