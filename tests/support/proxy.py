"""A controllable TCP proxy on loopback, to cut and heal the network in reliability tests.

``TcpProxy`` listens on ``127.0.0.1:<port>`` and forwards every connection to one upstream
``host:port`` (loopback only: this is a test tool, never a relay). It runs its own event loop
in a thread, so whatever the test's loop is busy with, the proxy keeps its timing. Modes:

* ``pass`` (``resume()``): forward bytes both ways;
* ``drop`` (``drop()``): reset every open connection (both sides) and reset each new one right
  after accepting it, like a broker that went away (clients see connection errors at once);
* ``stall`` (``stall()``): stop forwarding on open connections and accept new ones without
  connecting them upstream, like a black-holed network (clients see only timeouts). On
  ``resume()`` the held connections are connected upstream and everything flows again, as
  when a partition heals.

Control calls are synchronous and thread-safe; each returns once the new mode is in effect.
Use as a context manager (sync or async)::

    with TcpProxy("127.0.0.1", broker_port) as proxy:
        bootstrap = proxy.address       # "127.0.0.1:<port>"
        proxy.drop(); ...; proxy.resume()

Subclasses may open more listeners on the proxy's loop (``_listen``: one per upstream, all in
the same mode) and look inside the byte stream (``_forward``): see
:class:`support.kafka_proxy.KafkaProxy`, which keeps Kafka clients behind the proxy in front of
a cluster whose advertised listeners it cannot change.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import ipaddress
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

_CHUNK = 65536


class Mode(enum.Enum):
    PASS = "pass"  # noqa: S105 - a proxy mode, not a password
    DROP = "drop"
    STALL = "stall"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(eq=False)
class _Link:
    """One client connection and, once connected, its upstream connection."""

    client_reader: asyncio.StreamReader
    client_writer: asyncio.StreamWriter
    upstream_writer: asyncio.StreamWriter | None = None
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    dropped: asyncio.Event = field(default_factory=asyncio.Event)

    def abort(self) -> None:
        """Reset both sides; the pumps and the connection handler then end on their own."""
        self.dropped.set()
        for writer in (self.client_writer, self.upstream_writer):
            if writer is not None:
                _reset(writer)
        for task in self.pumps:
            task.cancel()


@dataclass
class ProxyStats:
    accepted: int = 0  #: client connections accepted, in any mode
    refused: int = 0  #: connections reset because the proxy was in drop mode
    forwarded_bytes: int = 0


class TcpProxy:
    """Forward ``127.0.0.1:<listen_port>`` to ``upstream_host:upstream_port``; cut on demand."""

    def __init__(self, upstream_host: str, upstream_port: int, *, listen_port: int = 0) -> None:
        self._check_upstream(upstream_host)
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self._listen_port = listen_port
        self._mode = Mode.PASS
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        #: every listener, by the upstream ``(host, port)`` it forwards to
        self._servers: dict[tuple[str, int], asyncio.Server] = {}
        self._listening: asyncio.Lock | None = (
            None  #: one listener per upstream, even if asked twice
        )
        self._thread: threading.Thread | None = None
        self._links: set[_Link] = set()
        self._flowing: asyncio.Event | None = None  #: set while in pass mode
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopped: asyncio.Event | None = None
        self.stats = ProxyStats()
        #: (monotonic time, mode) of every mode change, for reports.
        self.history: list[tuple[float, Mode]] = []

    @classmethod
    def _check_upstream(cls, host: str) -> None:
        if not _is_loopback(host):
            raise ValueError(f"TcpProxy forwards to loopback only, not {host!r}")

    # -- public API ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not running: start() it first")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, for clients (``bootstrap_servers``)."""
        return f"127.0.0.1:{self.port}"

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def open_connections(self) -> int:
        return len(self._links)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start within 10 s")
        if self._startup_error is not None:
            raise RuntimeError("the proxy could not start") from self._startup_error
        self.history.append((time.monotonic(), Mode.PASS))

    def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stopped is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stopped.set)
        thread.join(10)

    def drop(self) -> None:
        """Reset every connection now, and every new one, until ``resume()``."""
        self._switch(Mode.DROP)

    def stall(self) -> None:
        """Stop forwarding (open and new connections hang) until ``resume()``."""
        self._switch(Mode.STALL)

    def resume(self) -> None:
        """Forward again (held connections are connected upstream)."""
        self._switch(Mode.PASS)

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
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        where = self.address if self._server is not None else "not started"
        return (
            f"<TcpProxy {where} -> {self.upstream_host}:{self.upstream_port} "
            f"{self._mode.value}, {len(self._links)} connections>"
        )

    # -- the proxy's own loop -----------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._stopped = asyncio.Event()
        self._listening = asyncio.Lock()
        try:
            await self._listen(self.upstream_host, self.upstream_port, self._listen_port)
        except OSError as exc:
            self._startup_error = exc
            self._ready.set()
            return
        self._server = self._servers[(self.upstream_host, self.upstream_port)]
        self._ready.set()
        try:
            await self._stopped.wait()
        finally:
            servers = list(self._servers.values())
            for server in servers:
                server.close()
            links = list(self._links)
            for link in links:
                link.abort()
            await asyncio.gather(*(t for link in links for t in link.pumps), return_exceptions=True)
            for server in servers:
                await server.wait_closed()

    async def _listen(self, host: str, port: int, listen_port: int = 0) -> int:
        """The loopback port that forwards to ``host:port``; opens a listener the first time.

        Runs on the proxy's loop. Every listener shares the mode: ``drop()`` and ``stall()``
        cut them all.
        """
        assert self._listening is not None
        async with self._listening:
            server = self._servers.get((host, port))
            if server is None:
                self._check_upstream(host)
                server = await asyncio.start_server(
                    functools.partial(self._accept, (host, port)),
                    "127.0.0.1",
                    listen_port,
                    reuse_address=True,
                )
                self._servers[(host, port)] = server
        bound: int = server.sockets[0].getsockname()[1]
        return bound

    def _switch(self, mode: Mode) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            raise RuntimeError("the proxy is not running")
        done = threading.Event()

        def apply() -> None:
            self._apply(mode)
            done.set()

        loop.call_soon_threadsafe(apply)
        if not done.wait(10):
            raise RuntimeError(f"the proxy did not switch to {mode.value} within 10 s")
        self.history.append((time.monotonic(), mode))

    def _apply(self, mode: Mode) -> None:
        assert self._flowing is not None
        self._mode = mode
        if mode is Mode.PASS:
            self._flowing.set()
            return
        self._flowing.clear()
        if mode is Mode.DROP:
            for link in list(self._links):
                link.abort()
            self._links.clear()

    async def _accept(
        self,
        upstream: tuple[str, int],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.stats.accepted += 1
        if self._mode is Mode.DROP:
            self.stats.refused += 1
            _reset(writer)
            return
        link = _Link(reader, writer)
        self._links.add(link)
        try:
            await self._serve(link, upstream)
        except OSError:
            pass  # upstream refused (the broker is down): the client sees a reset
        finally:
            self._links.discard(link)
            link.abort()

    async def _serve(self, link: _Link, upstream: tuple[str, int]) -> None:
        # Stall mode: held here, unconnected, until resume (or drop).
        if not await self._gate(link):
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(*upstream)
        link.upstream_writer = upstream_writer
        if link.dropped.is_set():  # dropped while connecting
            _reset(upstream_writer)
            return
        link.pumps = self._forward(link, upstream_reader, upstream_writer)
        # Either direction closing ends the link (Kafka connections are full duplex).
        await asyncio.wait(link.pumps, return_when=asyncio.FIRST_COMPLETED)

    def _forward(
        self,
        link: _Link,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
    ) -> list[asyncio.Task[None]]:
        """The tasks that move bytes between ``link``'s client and its upstream connection."""
        return [
            asyncio.create_task(self._pump(link.client_reader, upstream_writer, link)),
            asyncio.create_task(self._pump(upstream_reader, link.client_writer, link)),
        ]

    async def _gate(self, link: _Link) -> bool:
        """Wait while stalled; True to go on forwarding, False once ``link`` is dropped."""
        assert self._flowing is not None
        return await _first(self._flowing, link.dropped)

    async def _pass(self, link: _Link, writer: asyncio.StreamWriter, data: bytes) -> bool:
        """Forward ``data`` to ``writer`` unless stalled; False (nothing sent) once dropped.

        Stalled, the bytes are held (the sender's socket buffers fill up) until resume.
        """
        if not await self._gate(link):
            return False
        writer.write(data)
        self.stats.forwarded_bytes += len(data)
        await writer.drain()
        return True

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data or not await self._pass(link, writer, data):
                    break
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            _end(writer)


async def _first(flowing: asyncio.Event, dropped: asyncio.Event) -> bool:
    """Wait until ``flowing`` (True) or ``dropped`` (False) is set."""
    if dropped.is_set():
        return False
    if flowing.is_set():
        return True
    waits = [asyncio.ensure_future(flowing.wait()), asyncio.ensure_future(dropped.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waits:
            waiter.cancel()
    return not dropped.is_set()


def _end(writer: asyncio.StreamWriter) -> None:
    """Half-close (FIN) what the pump was writing to: the peer sees the end of the stream."""
    with contextlib.suppress(OSError):
        if writer.can_write_eof():
            writer.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), not a polite FIN: the peer notices at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
