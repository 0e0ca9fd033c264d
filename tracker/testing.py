"""Test doubles shipped with the package, for unit tests of code built on kmq-tracker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

from tracker.errors import MarkerWriteFailed
from tracker.protocol import AnyMarker, Marker, decode_marker, encode_any


def _done() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class InMemoryMarkerSink:
    """A :class:`tracker.client.marker_sink.MarkerSink` that keeps markers in a list.

    Markers go through the real encoder and decoder, so an invalid one fails here as it would
    against Kafka. Set ``fail`` to make the next writes raise :class:`MarkerWriteFailed`; a
    ``send_later`` while failing loses its marker and the next ``flush`` raises, as the Kafka
    sink does.
    """

    def __init__(self) -> None:
        self.markers: list[AnyMarker] = []
        self.fail = False
        self._lost = False

    @property
    def v1(self) -> list[Marker]:
        """The per-message (v1) markers written so far, in order; range markers left out."""
        return [marker for marker in self.markers if isinstance(marker, Marker)]

    async def send(self, marker: AnyMarker) -> Awaitable[None]:
        if self.fail:
            raise MarkerWriteFailed("InMemoryMarkerSink was told to fail")
        self.markers.append(decode_marker(encode_any(marker)))
        return _done()

    def send_later(self, marker: AnyMarker) -> None:
        """Like the Kafka sink: a failure is not raised to the caller (the marker is lost)."""
        encoded = encode_any(marker)  # an invalid marker raises to the caller, as in Kafka
        if self.fail:
            self._lost = True
        else:
            self.markers.append(decode_marker(encoded))

    async def send_all(self, markers: Sequence[AnyMarker]) -> None:
        for marker in markers:
            await self.send(marker)

    async def flush(self) -> None:
        lost, self._lost = self._lost, False
        if self.fail or lost:
            raise MarkerWriteFailed("InMemoryMarkerSink was told to fail")
