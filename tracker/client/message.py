"""A message handed to the application, with the job-queue verbs on it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

from tracker.clock import from_millis
from tracker.errors import AlreadySettled, InvalidDelay, MarkerWriteFailed
from tracker.headers import without_kmq_headers
from tracker.ids import MessageId
from tracker.protocol import (
    MAX_DELAY_MS,
    MAX_REASON_LENGTH,
    MAX_TIMEOUT_MS,
    AnyMarker,
    Marker,
    MarkerKind,
)

from .marker_sink import MarkerSink
from .open_ranges import ACKED, DIVERGED, OPEN, SENT, OpenRange, RangeBook

log = logging.getLogger(__name__)


def _reason_text(text: str, limit: int = MAX_REASON_LENGTH) -> str:
    """``text`` as a marker's reason: NUL characters (which the protocol refuses: no
    PostgreSQL text holds one) replaced by U+FFFD, cut to at most ``limit`` UTF-8 bytes
    without splitting a character. Reasons are often an exception's text, which may quote
    binary data."""
    text = text.replace("\x00", "\ufffd")
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


class MessageContext:
    """What every message of one consumer shares: its group, marker sink and range book."""

    __slots__ = ("book", "group", "sink")

    def __init__(self, group: str, sink: MarkerSink, book: RangeBook) -> None:
        self.group = group
        self.sink = sink
        self.book = book


class KmqMessage:
    """One record received through :class:`tracker.client.KmqConsumer`.

    By the time the application sees it, a START marker for it is acknowledged by the broker;
    the queue offset past it is committed only after that (in the background, protocol v2).
    Settle it with exactly one of :meth:`ack`, :meth:`retry` or :meth:`reject`;
    :meth:`extend` renews the lease while processing. A message left unsettled is
    redelivered by the tracker when its lease expires.

    The settling verbs queue their marker in the client's batching producer and return without a
    network round trip; pass ``wait=True`` (or call the consumer's ``flush()``) to wait for the
    broker's acknowledgement. A message covered by a range marker (protocol v2) is acked by
    setting one byte of its batch's :class:`~tracker.client.open_ranges.OpenRange`: the RANGE_SETTLE
    goes out with the batch's other acks.

    Cheap to make: it keeps the record and decodes identity, headers and timestamp only when
    they are asked for.
    """

    __slots__ = ("_attempt", "_context", "_origin", "_range", "_record", "_settled")

    def __init__(
        self,
        record: Any,
        context: MessageContext,
        in_range: OpenRange | None = None,
        origin: MessageId | None = None,
        attempt: int = 1,
    ) -> None:
        # Positional, six slots: made once per record handed over, so it is kept to what
        # differs per message (what the consumer's messages share is in ``context``).
        self._record = record
        self._context = context
        self._range = in_range  #: the range whose START covers it (None: settled per message)
        self._origin = origin  #: None: a first delivery, its own origin
        self._attempt = attempt
        self._settled: MarkerKind | None = None

    @property
    def consumer_group(self) -> str:
        return self._context.group

    # -- identity -------------------------------------------------------------------------

    @property
    def id(self) -> MessageId:
        record = self._record
        return MessageId(record.topic, record.partition, record.offset)

    @property
    def origin(self) -> MessageId:
        """The first delivery of the logical message (the message itself on a first one)."""
        return self._origin if self._origin is not None else self.id

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def topic(self) -> str:
        return str(self._record.topic)

    @property
    def partition(self) -> int:
        return int(self._record.partition)

    @property
    def offset(self) -> int:
        return int(self._record.offset)

    @property
    def key(self) -> bytes | None:
        return self._record.key  # type: ignore[no-any-return]

    @property
    def value(self) -> bytes | None:
        return self._record.value  # type: ignore[no-any-return]

    @property
    def raw_headers(self) -> tuple[tuple[str, bytes | None], ...]:
        """Every header of the record, kmq ones included."""
        return tuple(self._record.headers or ())

    @property
    def headers(self) -> tuple[tuple[str, bytes | None], ...]:
        """The application's headers (the record's, without kmq's own)."""
        raw = self.raw_headers
        return tuple(without_kmq_headers(raw)) if raw else raw

    @property
    def timestamp(self) -> datetime:
        return from_millis(self._record.timestamp)

    @property
    def is_redelivery(self) -> bool:
        return self._origin is not None and self._origin != self.id

    @property
    def settled(self) -> MarkerKind | None:
        """How the message was settled (ACK, DELAY or REJECT), or None while in progress."""
        opened = self._range
        if self._settled is None and opened is not None:
            flag = opened.flags[self._record.offset - opened.first]
            if flag in (ACKED, SENT):
                return MarkerKind.ACK
        return self._settled

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name`` (application headers and kmq ones)."""
        for key, value in reversed(self.raw_headers):
            if key == name:
                return value
        return None

    def __repr__(self) -> str:
        settled = self.settled
        return (
            f"KmqMessage(id={self.id}, origin={self.origin}, attempt={self.attempt}, "
            f"settled={settled.name if settled else None})"
        )

    # -- verbs ----------------------------------------------------------------------------

    def _origin_field(self) -> MessageId | None:
        return self._origin if self._origin is not None and self._origin != self.id else None

    async def _write(self, marker: Marker, wait: bool) -> None:
        if wait:
            await (await self._context.sink.send(marker))
        else:
            # Sent with the next batch; a failure is logged, and the tracker will redeliver
            # the message (at-least-once), so nothing is lost.
            self._context.sink.send_later(marker)

    def _settle(self, kind: MarkerKind) -> None:
        settled = self.settled
        if settled is not None:
            raise AlreadySettled(
                f"message {self.id} was already settled with {settled.name}; cannot {kind.name} it"
            )

    def _diverge(self) -> None:
        """Keep this message out of its batch's RANGE_SETTLE (a v1 marker settles it)."""
        opened = self._range
        if opened is not None:
            opened.flags[self._record.offset - opened.first] = DIVERGED

    async def ack(self, *, wait: bool = False) -> None:
        """Processing succeeded: the message is done."""
        opened = self._range
        if opened is not None and self._settled is None:
            flags = opened.flags
            index = self._record.offset - opened.first
            if flags[index] == OPEN:  # the common case: one byte, no marker
                flags[index] = ACKED
                book = self._context.book
                if not opened.queued:  # queued: its SETTLE (and the book's timer) is due
                    book.acked(opened)
                if wait:
                    try:
                        await self._context.sink.send_all(book.take())
                    except MarkerWriteFailed:
                        opened.flags[index] = OPEN  # not settled: the caller may retry
                        raise
                return
        self._settle(MarkerKind.ACK)
        marker = Marker.ack(
            self._context.group, self.id, attempt=self.attempt, origin=self._origin_field()
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
            self._context.group,
            self.id,
            attempt=self.attempt,
            origin=self._origin_field(),
            delay_ms=delay_ms,
            reason=_reason_text(reason),
        )
        self._diverge()  # before the write: even a write that fails may reach the broker
        await self._write(marker, wait)
        self._settled = MarkerKind.DELAY

    def _extension(self, timeout_ms: int) -> Marker:
        return Marker.extend(
            self._context.group,
            self.id,
            attempt=self.attempt,
            origin=self._origin_field(),
            timeout_ms=timeout_ms,
        )

    async def extend(self, by: timedelta, *, wait: bool = False) -> None:
        """Renew the lease: the message is not redelivered until ``by`` from now.

        Like SQS ``ChangeMessageVisibility``, the new deadline counts from now (the marker's
        timestamp), not from the old deadline.
        """
        if self.settled is not None:
            raise AlreadySettled(f"message {self.id} is already settled; cannot extend it")
        timeout_ms = _millis(by, "extension", minimum=1, maximum=MAX_TIMEOUT_MS)
        await self._write(self._extension(timeout_ms), wait)

    async def reject(self, reason: str, *, wait: bool = False) -> None:
        """The message is poison: dead-letter it now, with ``reason``."""
        self._settle(MarkerKind.REJECT)
        marker = Marker.reject(
            self._context.group,
            self.id,
            attempt=self.attempt,
            origin=self._origin_field(),
            reason=_reason_text(reason),
        )
        self._diverge()  # before the write: even a write that fails may reach the broker
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
            if self.settled is None:
                await self.retry(retry_delay, reason=f"{type(exc).__name__}: {exc}")
            if not suppress:
                raise
        else:
            if self.settled is None:
                await self.ack()


def extensions(
    ranges: Iterable[OpenRange], loose: Iterable[KmqMessage], timeout_ms: int
) -> list[AnyMarker]:
    """EXTENDs of ``timeout_ms`` for what is still unsettled: one RANGE_EXTEND per range
    (covering its open offsets) and one EXTEND per unsettled message settled per message."""
    out: list[AnyMarker] = []
    for opened in ranges:
        marker = opened.extend(timeout_ms)
        if marker is not None:
            out.append(marker)
    for message in loose:
        if message.settled is None:
            out.append(message._extension(timeout_ms))
    return out


def releases(messages: Iterable[KmqMessage]) -> list[AnyMarker]:
    """Give unsettled messages back to the tracker: EXTENDs of 1 ms (redelivered at once, as
    SQS does with a visibility timeout of 0 and share groups with RELEASE).

    The messages of one range go in one RANGE_EXTEND; from then on they are left out of that
    range's SETTLEs and EXTENDs (an ``ack()`` after this writes a per-message ACK, which the
    tracker ignores if it redelivered the message already).
    """
    out: list[AnyMarker] = []
    by_range: dict[int, tuple[OpenRange, list[int]]] = {}
    for message in messages:
        if message.settled is not None:
            continue
        opened = message._range
        if opened is None:
            out.append(message._extension(1))
            continue
        offset = message._record.offset
        if opened.flags[offset - opened.first] == OPEN:
            by_range.setdefault(id(opened), (opened, []))[1].append(offset)
    for opened, offsets in by_range.values():
        marker = opened.extend(1, offsets)
        if marker is not None:
            out.append(marker)
        for offset in offsets:
            opened.flags[offset - opened.first] = DIVERGED
    return out
