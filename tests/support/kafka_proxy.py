"""A fault-injection proxy in front of a Kafka cluster whose advertised listeners we cannot set.

A Kafka client bootstraps from one address, then connects to the brokers *advertised* in
Metadata responses (and to the coordinator named in FindCoordinator responses). A plain
:class:`~support.proxy.TcpProxy` in front of an external cluster would therefore carry only the
bootstrap connection: every later connection would go straight to the brokers, around the
proxy, and ``drop()``/``stall()`` would cut nothing that matters.

:class:`KafkaProxy` is a ``TcpProxy`` that reads the Kafka framing (``int32`` size, then the
request header ``api_key, api_version, correlation_id``; responses start with the
``correlation_id``) and rewrites the broker addresses of exactly two responses, Metadata and
FindCoordinator, to loopback ports of its own, one listener per broker (opened the first time
the broker is named). Every other frame passes through untouched, byte for byte. All listeners
share the proxy's mode, so ``drop()``, ``stall()`` and ``resume()`` cut or heal the client's
whole view of the cluster.

Scope, checked rather than assumed:

* Plaintext only (``security.protocol=PLAINTEXT``): TLS frames cannot be read.
* The response layouts are aiokafka's own protocol classes, for the versions aiokafka sends
  (Metadata v0-v5, FindCoordinator v0-v1; aiokafka 0.14 has no flexible version of either).
  A response of another version of those two APIs cannot be rewritten and would let the client
  around the proxy, so the proxy refuses it: it records the error in ``errors`` and resets the
  connection (the client sees a connection error, the test sees ``errors``).
* None of the other APIs aiokafka uses carries a broker address in the versions it sends
  (Produce <= v8 and Fetch <= v11 predate KIP-951's leader endpoints).

The listeners bind ``127.0.0.1`` only; upstreams are the cluster named by the caller and the
brokers that cluster advertises (they need not be on loopback, unlike ``TcpProxy``'s single
upstream).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from io import BytesIO
from typing import Any

from aiokafka.protocol.coordination import FindCoordinatorResponse_v0, FindCoordinatorResponse_v1
from aiokafka.protocol.metadata import (
    MetadataResponse_v0,
    MetadataResponse_v1,
    MetadataResponse_v2,
    MetadataResponse_v3,
    MetadataResponse_v4,
    MetadataResponse_v5,
)

from .proxy import TcpProxy, _end, _Link

METADATA = 3
FIND_COORDINATOR = 10

#: ``(api_key, api_version) -> response class`` of the responses that name brokers.
RESPONSES: dict[tuple[int, int], Any] = {
    **{
        (METADATA, cls.API_VERSION): cls
        for cls in (
            MetadataResponse_v0,
            MetadataResponse_v1,
            MetadataResponse_v2,
            MetadataResponse_v3,
            MetadataResponse_v4,
            MetadataResponse_v5,
        )
    },
    (FIND_COORDINATOR, 0): FindCoordinatorResponse_v0,
    (FIND_COORDINATOR, 1): FindCoordinatorResponse_v1,
}
REWRITTEN_APIS = frozenset(key for key, _ in RESPONSES)

_SIZE = struct.Struct(">i")
_REQUEST_HEAD = struct.Struct(">hhi")  # api_key, api_version, correlation_id
#: Larger than any frame a test exchanges; a corrupt size prefix must not allocate gigabytes.
MAX_FRAME = 256 * 1024 * 1024


class UnsupportedResponse(ValueError):
    """A response that names brokers in a layout this proxy cannot rewrite."""


def parse_bootstrap(bootstrap: str) -> list[tuple[str, int]]:
    """``"host:port[,host:port]"`` -> ``[(host, port), ...]``."""
    out = []
    for item in bootstrap.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"not host:port: {item!r} in {bootstrap!r}")
        out.append((host.strip("[]"), int(port)))
    return out


Route = Callable[[str, int], Awaitable[tuple[str, int]]]


async def rewrite_response(
    api_key: int, api_version: int, body: bytes, route: Route
) -> tuple[bytes, int]:
    """``body`` (a response without its correlation id) with every broker address replaced.

    ``route`` is ``async (host, port) -> (host, port)``. Returns the new body and how many
    addresses were rewritten. Raises :class:`UnsupportedResponse` for a version it cannot
    decode, or when decoding does not consume the body exactly (re-encoding would corrupt it).
    """
    cls = RESPONSES.get((api_key, api_version))
    if cls is None:
        raise UnsupportedResponse(
            f"api {api_key} v{api_version} names brokers but cannot be rewritten "
            f"(supported: {sorted(RESPONSES)})"
        )
    data = BytesIO(body)
    response = cls.decode(data)
    if data.tell() != len(body):
        raise UnsupportedResponse(
            f"api {api_key} v{api_version}: decoded {data.tell()} of {len(body)} bytes"
        )
    rewritten = 0
    if api_key == METADATA:
        brokers = []
        for broker in response.brokers:
            node_id, host, port, *rest = broker
            host, port = await route(host, port)
            rewritten += 1
            brokers.append((node_id, host, port, *rest))
        response.brokers = brokers
    elif response.error_code == 0 and response.port >= 0:
        response.host, response.port = await route(response.host, response.port)
        rewritten += 1
    return response.encode(), rewritten


class KafkaProxy(TcpProxy):
    """A :class:`TcpProxy` in front of a Kafka cluster that keeps every client connection behind
    it by rewriting broker addresses in Metadata and FindCoordinator responses.

    ``address`` is the bootstrap address for clients (the listener of the first bootstrap
    server); ``brokers`` maps each upstream broker to its listener port.
    """

    def __init__(self, bootstrap: str, *, listen_port: int = 0) -> None:
        host, port = parse_bootstrap(bootstrap)[0]
        super().__init__(host, port, listen_port=listen_port)
        self.bootstrap_upstream = bootstrap
        #: responses rewritten, and broker addresses in them
        self.rewritten_responses = 0
        self.rewritten_addresses = 0
        #: responses the proxy could not rewrite (each reset its connection); must stay empty
        self.errors: list[str] = []

    @classmethod
    def _check_upstream(cls, host: str) -> None:
        """Any host: the upstreams are the caller's cluster and what it advertises."""

    @property
    def brokers(self) -> dict[tuple[str, int], int]:
        """``(upstream host, port) -> loopback listener port``, for every listener so far."""
        return {
            upstream: int(server.sockets[0].getsockname()[1])
            for upstream, server in list(self._servers.items())
        }

    async def _route(self, host: str, port: int) -> tuple[str, int]:
        return "127.0.0.1", await self._listen(host, port)

    def _forward(
        self,
        link: _Link,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
    ) -> list[asyncio.Task[None]]:
        pending: dict[int, tuple[int, int]] = {}
        return [
            asyncio.create_task(self._requests(link, upstream_writer, pending)),
            asyncio.create_task(self._responses(link, upstream_reader, pending)),
        ]

    async def _requests(
        self,
        link: _Link,
        upstream_writer: asyncio.StreamWriter,
        pending: dict[int, tuple[int, int]],
    ) -> None:
        """Client -> broker, frame by frame; remember which requests need their answer fixed."""
        try:
            while True:
                frame = await _read_frame(link.client_reader)
                if frame is None:
                    break
                if len(frame) >= 4 + _REQUEST_HEAD.size:
                    api_key, api_version, correlation = _REQUEST_HEAD.unpack_from(frame, 4)
                    if api_key in REWRITTEN_APIS:
                        # Recorded before the request leaves: its answer cannot overtake it.
                        pending[correlation] = (api_key, api_version)
                if not await self._pass(link, upstream_writer, frame):
                    break
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            _end(upstream_writer)

    async def _responses(
        self,
        link: _Link,
        upstream_reader: asyncio.StreamReader,
        pending: dict[int, tuple[int, int]],
    ) -> None:
        """Broker -> client, frame by frame; broker addresses replaced by the proxy's."""
        writer = link.client_writer
        try:
            while True:
                frame = await _read_frame(upstream_reader)
                if frame is None:
                    break
                if len(frame) >= 8:
                    (correlation,) = _SIZE.unpack_from(frame, 4)
                    request = pending.pop(correlation, None)
                    if request is not None:
                        try:
                            body, count = await rewrite_response(*request, frame[8:], self._route)
                        except (UnsupportedResponse, ValueError, struct.error) as exc:
                            self.errors.append(f"{type(exc).__name__}: {exc}")
                            link.abort()
                            break
                        payload = frame[4:8] + body
                        frame = _SIZE.pack(len(payload)) + payload
                        self.rewritten_responses += 1
                        self.rewritten_addresses += count
                if not await self._pass(link, writer, frame):
                    break
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            _end(writer)


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One size-prefixed frame, prefix included; None at a clean end of stream."""
    head = await reader.read(4)
    if not head:
        return None
    if len(head) < 4:
        head += await reader.readexactly(4 - len(head))
    (size,) = _SIZE.unpack(head)
    if not 0 <= size <= MAX_FRAME:
        raise OSError(f"not a Kafka frame: size {size}")
    return head + await reader.readexactly(size)
