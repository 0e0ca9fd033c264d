"""The producer helper: send a message now, after a delay, or at a given time."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaProducer

from tracker.clock import Clock, SystemClock
from tracker.errors import ClientClosed, InvalidDelay, InvalidHeader
from tracker.headers import DELIVER_AT, RESERVED_PREFIX, format_deliver_at
from tracker.protocol import MAX_DELAY_MS


def resolve_deliver_at(
    now: datetime, *, delay: timedelta | None = None, deliver_at: datetime | None = None
) -> datetime | None:
    """When a message asked for with ``delay=`` or ``deliver_at=`` becomes due (None: now).

    Refuses both at once, naive datetimes, and delays that are zero, negative, in the past or
    longer than the protocol's limit, with an :class:`InvalidDelay` that says which.
    """
    if delay is not None and deliver_at is not None:
        raise InvalidDelay("pass either delay= or deliver_at=, not both")
    if delay is not None:
        if not isinstance(delay, timedelta):
            raise InvalidDelay(f"delay must be a datetime.timedelta, got {type(delay).__name__}")
        if delay <= timedelta(0):
            raise InvalidDelay(f"delay must be positive, got {delay}")
        deliver_at = now + delay
    elif deliver_at is not None:
        if not isinstance(deliver_at, datetime):
            raise InvalidDelay("deliver_at must be a datetime.datetime")
        if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
            raise InvalidDelay(
                "deliver_at is a naive datetime; pass a timezone-aware one "
                "(e.g. datetime.now(UTC) + timedelta(hours=1))"
            )
        if deliver_at <= now:
            raise InvalidDelay(f"deliver_at {deliver_at.isoformat()} is not in the future")
    else:
        return None
    if (deliver_at - now).total_seconds() * 1000 > MAX_DELAY_MS:
        raise InvalidDelay("the delay is longer than the protocol's limit of ten years")
    return deliver_at


class KmqProducer:
    """Produce queue messages, optionally delayed (``delay=`` / ``deliver_at=``).

    A delayed message is an ordinary record with a ``kmq-deliver-at`` header. A
    :class:`~tracker.client.KmqConsumer` that reads it early does not hand it over: it writes a
    DELAY marker and the tracker republishes the message when it is due. Delays are bounded only
    by the topic's retention (the tracker keeps a copy of payloads that would outlive it).

    Pass ``producer=`` to reuse an aiokafka producer you manage; otherwise one is created from
    ``bootstrap_servers`` and ``**config`` and owned by this helper.
    """

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str] | None = None,
        *,
        producer: Any = None,
        clock: Clock | None = None,
        **config: Any,
    ) -> None:
        if producer is None and bootstrap_servers is None:
            raise ValueError("pass bootstrap_servers= or an aiokafka producer=")
        self._owned = producer is None
        self._producer: Any = producer or AIOKafkaProducer(
            bootstrap_servers=bootstrap_servers, **{"acks": "all", **config}
        )
        self._clock: Clock = clock or SystemClock()
        self._running = not self._owned

    async def start(self) -> None:
        if self._owned:
            await self._producer.start()
        self._running = True

    async def stop(self) -> None:
        if self._owned and self._running:
            await self._producer.stop()
        self._running = False

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _headers(
        self,
        headers: Sequence[tuple[str, bytes]] | None,
        delay: timedelta | None,
        deliver_at: datetime | None,
    ) -> list[tuple[str, bytes]]:
        out = list(headers or ())
        for name, _ in out:
            if name.startswith(RESERVED_PREFIX):
                raise InvalidHeader(f"header {name!r} uses the reserved prefix {RESERVED_PREFIX!r}")
        due = resolve_deliver_at(self._clock.now(), delay=delay, deliver_at=deliver_at)
        if due is not None:
            out.append((DELIVER_AT, format_deliver_at(due)))
        return out

    async def send(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        partition: int | None = None,
        delay: timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> Any:
        """Send one message and wait for the broker's acknowledgement (returns its metadata)."""
        future = await self.send_nowait(
            topic,
            value,
            key=key,
            headers=headers,
            partition=partition,
            delay=delay,
            deliver_at=deliver_at,
        )
        return await future

    async def send_nowait(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        partition: int | None = None,
        delay: timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> Any:
        """Queue one message (batched by the producer); returns a future of its metadata."""
        if not self._running:
            raise ClientClosed()
        return await self._producer.send(
            topic,
            value=value,
            key=key,
            partition=partition,
            headers=self._headers(headers, delay, deliver_at),
        )

    async def flush(self) -> None:
        await self._producer.flush()
