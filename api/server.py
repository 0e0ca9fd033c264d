"""Serving the app with uvicorn inside an existing event loop (next to the tracker's tasks).

Signal handling stays with the caller (``kmq-tracker run`` stops everything on SIGTERM by
setting one event): uvicorn's own handlers are disabled, and the server shuts down gracefully
when ``stopping`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tracker.errors import KmqError


class ApiServerError(KmqError):
    """The HTTP API could not start (port in use, or the app failed at startup)."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """The process's owner handles signals; uvicorn must not replace its handlers."""
        yield


def bind_http(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for :func:`serve`, or :class:`ApiServerError`.

    The tracker binds before it touches the database or Kafka: a port that is taken must
    fail the start at once and without side effects, not after the replica joined the tracker
    group (which makes the running replicas rebalance twice) and connected everything.
    """
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        raise ApiServerError(f"the HTTP API cannot listen on {host}:{port}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listening now, not when uvicorn starts: two processes can both bind a port that
        # nobody listens on yet (SO_REUSEADDR), and the second must fail here, at once.
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ApiServerError(f"the HTTP API cannot listen on {host}:{port}: {reason}") from None
    return sock


async def serve(
    app: FastAPI,
    host: str,
    port: int,
    stopping: asyncio.Event,
    *,
    sockets: list[socket.socket] | None = None,
    access_log: bool = False,
) -> None:
    """Serve ``app`` until ``stopping`` is set. Raises :class:`ApiServerError` if it cannot."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        ws="none",  # no WebSocket endpoints (and no websockets import)
        log_config=None,
        access_log=access_log,
        server_header=False,
        timeout_graceful_shutdown=10,
    )
    server = _Server(config)

    async def watch() -> None:
        await stopping.wait()
        server.should_exit = True

    watcher = asyncio.create_task(watch(), name="kmq-api-stop")
    try:
        await server.serve(sockets=sockets)
    except SystemExit:
        # uvicorn exits the process when it cannot bind or the app fails to start; here
        # that is an error of this task, not of the whole process.
        raise ApiServerError(
            f"the HTTP API could not start on {host}:{port} (see the log above)"
        ) from None
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
