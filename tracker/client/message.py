"""A message handed to the application, with the job-queue verbs on it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

from tracker.clock import from_millis
from tracker.errors import AlreadySettled, InvalidDelay
from tracker.headers import without_kmq_headers
from tracker.ids import MessageId
from tracker.protocol import MAX_DELAY_MS, MAX_REASON_LENGTH, MAX_TIMEOUT_MS, Marker, MarkerKind

from .markers import MarkerSink

log = logging.getLogger(__name__)


def _truncate_utf8(text: str, limit: int = MAX_REASON_LENGTH) -> str:
    """Cut ``text`` to at most ``limit`` UTF-8 bytes without splitting a character."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore")


def _millis(delta: timedelta, what: str, *, minimum: int, maximum: int) -> int:
    if not isinstance(delta, timedelta):
        raise InvalidDelay(f"{what} must be a datetime.timedelta, got {type(delta).__name__}")
    ms = round(delta.total_seconds() * 1000)
    if ms < minimum:
        raise InvalidDelay(f"{what} must be at least {minimum} ms, got {delta}")
    if ms > maximum:
        raise InvalidDelay(f"{what} of {delta} is longer than the protocol allows")
    return ms


class KmqMessage:
    """One record received through :class:`tracker.client.KmqConsumer`.

    By the time the application sees it, a START marker for it is acknowledged by the broker and
    the queue offset past it is committed. Settle it with exactly one of :meth:`ack`,
    :meth:`retry` or :meth:`reject`; :meth:`extend` renews the lease while processing. A message
    left unsettled is redelivered by the tracker when its lease expires.

    The settling verbs queue their marker in the client's batching producer and return without a
    network round trip; pass ``wait=True`` (or call the consumer's ``flush()``) to wait for the
    broker's acknowledgement.
    """

    __slots__ = (
        "_settled",
        "_sink",
        "attempt",
        "consumer_group",
        "headers",
        "id",
        "key",
        "origin",
        "raw_headers",
        "timestamp",
        "value",
    )

    def __init__(
        self,
        record: Any,
        *,
        origin: MessageId,
        attempt: int,
        group: str,
        sink: MarkerSink,
    ) -> None:
        self.id = MessageId(record.topic, record.partition, record.offset)
        self.origin = origin
        self.attempt = attempt
        self.consumer_group = group
        self.key: bytes | None = record.key
        self.value: bytes | None = record.value
        raw: tuple[tuple[str, bytes | None], ...] = tuple(record.headers or ())
        self.raw_headers = raw
        self.headers: tuple[tuple[str, bytes | None], ...] = (
            tuple(without_kmq_headers(raw)) if raw else raw
        )
        self.timestamp: datetime = from_millis(record.timestamp)
        self._sink = sink
        self._settled: MarkerKind | None = None

    # -- identity -------------------------------------------------------------------------

    @property
    def topic(self) -> str:
        return self.id.topic

    @property
    def partition(self) -> int:
        return self.id.partition

    @property
    def offset(self) -> int:
        return self.id.offset

    @property
    def is_redelivery(self) -> bool:
        return self.origin != self.id

    @property
    def settled(self) -> MarkerKind | None:
        """How the message was settled (ACK, DELAY or REJECT), or None while in progress."""
        return self._settled

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name`` (application headers and kmq ones)."""
        for key, value in reversed(self.raw_headers):
            if key == name:
                return value
        return None

    def __repr__(self) -> str:
        return (
            f"KmqMessage(id={self.id}, origin={self.origin}, attempt={self.attempt}, "
            f"settled={self._settled.name if self._settled else None})"
        )

    # -- verbs ----------------------------------------------------------------------------

    def _origin_field(self) -> MessageId | None:
        return self.origin if self.origin != self.id else None

    async def _write(self, marker: Marker, wait: bool) -> None:
        if wait:
            await (await self._sink.send(marker))
        else:
            # Sent with the next batch; a failure is logged, and the tracker will redeliver
            # the message (at-least-once), so nothing is lost.
            self._sink.send_later(marker)

    def _settle(self, kind: MarkerKind) -> None:
        if self._settled is not None:
            raise AlreadySettled(
                f"message {self.id} was already settled with {self._settled.name}; "
                f"cannot {kind.name} it"
            )

    async def ack(self, *, wait: bool = False) -> None:
        """Processing succeeded: the message is done."""
        self._settle(MarkerKind.ACK)
        marker = Marker.ack(
            self.consumer_group, self.id, attempt=self.attempt, origin=self._origin_field()
        )
        await self._write(marker, wait)
        self._settled = MarkerKind.ACK

    async def retry(
        self, delay: timedelta | None = None, *, reason: str = "", wait: bool = False
    ) -> None:
        """Processing failed: redeliver after ``delay`` (None: the topic's backoff policy)."""
        self._settle(MarkerKind.DELAY)
        delay_ms = (
            None
            if delay is None
            else _millis(delay, "retry delay", minimum=0, maximum=MAX_DELAY_MS)
        )
        marker = Marker.delay(
            self.consumer_group,
            self.id,
            attempt=self.attempt,
            origin=self._origin_field(),
            delay_ms=delay_ms,
            reason=_truncate_utf8(reason),
        )
        await self._write(marker, wait)
        self._settled = MarkerKind.DELAY

    async def extend(self, by: timedelta, *, wait: bool = False) -> None:
        """Renew the lease: the message is not redelivered until ``by`` from now.

        Like SQS ``ChangeMessageVisibility``, the new deadline counts from now (the marker's
        timestamp), not from the old deadline.
        """
        if self._settled is not None:
            raise AlreadySettled(f"message {self.id} is already settled; cannot extend it")
        timeout_ms = _millis(by, "extension", minimum=1, maximum=MAX_TIMEOUT_MS)
        marker = Marker.extend(
            self.consumer_group,
            self.id,
            attempt=self.attempt,
            origin=self._origin_field(),
            timeout_ms=timeout_ms,
        )
        await self._write(marker, wait)

    async def reject(self, reason: str, *, wait: bool = False) -> None:
        """The message is poison: dead-letter it now, with ``reason``."""
        self._settle(MarkerKind.REJECT)
        marker = Marker.reject(
            self.consumer_group,
            self.id,
            attempt=self.attempt,
            origin=self._origin_field(),
            reason=_truncate_utf8(reason),
        )
        await self._write(marker, wait)
        self._settled = MarkerKind.REJECT

    @asynccontextmanager
    async def processing(
        self, *, retry_delay: timedelta | None = None, suppress: bool = False
    ) -> AsyncIterator[KmqMessage]:
        """Ack when the block succeeds, retry when it raises.

        The exception's text becomes the retry reason. It is re-raised unless ``suppress``.
        Settling the message inside the block (e.g. ``reject``) is respected. Cancellation
        (``asyncio.CancelledError``) settles nothing: the lease expires and the tracker
        redelivers.
        """
        try:
            yield self
        except Exception as exc:
            if self._settled is None:
                await self.retry(retry_delay, reason=f"{type(exc).__name__}: {exc}")
            if not suppress:
                raise
        else:
            if self._settled is None:
                await self.ack()
