"""Settling whole batches: the client side of range markers (protocol v2).

With ``marker_version=2`` the consumer covers each fetched partition batch of first deliveries
with one RANGE_START. What the application then does to each message is kept in an
:class:`OpenRange`: one byte per offset of the batch, set by ``ack()`` (no marker, no
allocation), and turned into RANGE_SETTLE records when the :class:`RangeBook` flushes: before
the next batch is handed over, every ``SETTLE_INTERVAL`` while messages are acked, on the
consumer's ``flush()`` and on stop. A message that diverges (retry, reject) gets its v1 marker
at once and is left out of every SETTLE, so a SETTLE never covers an offset that was retried
or rejected (docs/protocol.md, "Version 2").
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable

from tracker.protocol_v2 import MAX_RANGE_WIDTH, RangeMarker

#: Flag of each offset of an open range.
OPEN = 0  #: handed over (or about to be), not settled
ACKED = 1  #: acked by the application, SETTLE not sent yet
DIVERGED = 2  #: retried or rejected: a v1 marker settles it; never in a SETTLE
NOT_OURS = 3  #: not covered by this range's START (gap, copy, deferred, skipped)
SENT = 4  #: acked, and a SETTLE covering it was queued

#: ``bytes.translate`` tables to the exceptions of a marker: the flag that the marker covers
#: -> "0", anything else -> "1" (an exception), so the bitmask is one ``int(..., 2)`` of the
#: reversed text. A SETTLE covers the ACKED offsets, a START the OPEN ones.
_NOT_ACKED = bytes([ord("0") if i == ACKED else ord("1") for i in range(256)])
_NOT_OPEN = bytes([ord("0") if i == OPEN else ord("1") for i in range(256)])
#: ACKED -> SENT, the rest unchanged.
_MARK_SENT = bytes([SENT if i == ACKED else i for i in range(256)])

#: Longest time an ack waits for its SETTLE to be queued (the tracker applies it after its
#: coalescing window anyway; this bounds how stale the tracker's view is).
SETTLE_INTERVAL = 0.05


class OpenRange:
    """One RANGE_START's offsets and what became of each (see the module docstring)."""

    __slots__ = ("first", "flags", "group", "partition", "queued", "topic")

    def __init__(
        self,
        group: str,
        topic: str,
        partition: int,
        first: int,
        width: int,
        *,
        all_open: bool = False,
    ) -> None:
        if not 0 < width <= MAX_RANGE_WIDTH:
            raise ValueError(f"a range covers 1 to {MAX_RANGE_WIDTH} offsets, not {width}")
        self.group = group
        self.topic = topic
        self.partition = partition
        self.first = first
        #: ``all_open``: every offset is a message handed over (a batch without gaps, copies
        #: or delayed messages: the common case, no byte set one by one)
        self.flags = bytearray([OPEN if all_open else NOT_OURS]) * width
        self.queued = False  #: in its book's list of ranges with acks to send

    @property
    def last(self) -> int:
        return self.first + len(self.flags) - 1

    def start(self, consumer: str, timeout_ms: int) -> RangeMarker:
        """The RANGE_START of the offsets marked OPEN."""
        return RangeMarker.start(
            self.group,
            self.topic,
            self.partition,
            self.first,
            self.last,
            exceptions=_bits(self.flags, _NOT_OPEN),
            timeout_ms=timeout_ms,
            consumer=consumer,
        )

    def extend(self, timeout_ms: int, offsets: Iterable[int] | None = None) -> RangeMarker | None:
        """A RANGE_EXTEND of the offsets still open (of ``offsets`` only, when given): their
        leases run ``timeout_ms`` from now (1 ms gives them back to the tracker at once).
        None when none of them is open."""
        flags = self.flags
        if offsets is not None:
            only = bytearray([NOT_OURS]) * len(flags)
            first = self.first
            for offset in offsets:
                index = offset - first
                only[index] = flags[index]
            flags = only
        if OPEN not in flags:
            return None
        return RangeMarker.extend(
            self.group,
            self.topic,
            self.partition,
            self.first,
            self.last,
            timeout_ms=timeout_ms,
            exceptions=_bits(flags, _NOT_OPEN),
        )

    def ack_all(self) -> None:
        """Every offset still open is acked."""
        self.flags = self.flags.replace(b"\x00", b"\x01")

    def settle(self) -> RangeMarker | None:
        """The RANGE_SETTLE of what was acked since the last one (None: nothing was)."""
        flags = self.flags
        if ACKED not in flags:
            return None
        marker = RangeMarker.settle(
            self.group,
            self.topic,
            self.partition,
            self.first,
            self.last,
            exceptions=_bits(flags, _NOT_ACKED),
        )
        self.flags = flags.translate(_MARK_SENT)
        return marker

    @property
    def done(self) -> bool:
        """Nothing left to settle: every offset is sent, diverged or not ours."""
        flags = self.flags
        return OPEN not in flags and ACKED not in flags


def _bits(flags: bytearray, table: bytes) -> int:
    """The bitmask of ``flags`` turned into ``"0"``/``"1"`` by ``table``: bit ``i`` is
    ``table[flags[i]]`` (one ``translate`` and one ``int(..., 2)``, no loop in Python)."""
    text = flags.translate(table)
    text.reverse()
    return int(text, 2)


#: Ranges :meth:`RangeBook.ack_all` remembers; older ones are forgotten (their messages stay
#: with the tracker, which redelivers what is not settled; a later ``ack()`` still works).
MAX_HANDED = 10_000


class RangeBook:
    """The ranges handed to the application, and when their SETTLEs go out.

    Only ranges with acks not sent yet are looked at when flushing (an ack puts its range on
    that list, once), so a flush costs what was acked, not what is open: an application that
    leaves messages to the tracker's redelivery leaves nothing here that grows. ``send``
    queues a marker without waiting (the sink's ``send_later``): like v1 ACKs, a lost SETTLE
    only makes the tracker redeliver (at least once).
    """

    def __init__(self, send: Callable[[RangeMarker], None]) -> None:
        self._send = send
        self._acked: list[OpenRange] = []
        self._handed: collections.deque[OpenRange] = collections.deque(maxlen=MAX_HANDED)
        self._timer: asyncio.TimerHandle | None = None

    def add(self, opened: OpenRange) -> None:
        """A range is handed to the application."""
        self._handed.append(opened)

    def acked(self, opened: OpenRange) -> None:
        """An offset of ``opened`` was acked: its SETTLE goes out with the next flush."""
        if not opened.queued:
            opened.queued = True
            self._acked.append(opened)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(SETTLE_INTERVAL, self.flush)

    def ack_all(self) -> None:
        """Ack every open offset of every range handed out (and still remembered)."""
        for opened in self._handed:
            if OPEN in opened.flags:
                opened.ack_all()
                self.acked(opened)
        self._handed = collections.deque(
            (opened for opened in self._handed if not opened.done), maxlen=MAX_HANDED
        )
        self.flush()

    def take(self) -> list[RangeMarker]:
        """The SETTLEs of every range with new acks (their offsets count as sent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        acked, self._acked = self._acked, []
        markers: list[RangeMarker] = []
        for opened in acked:
            opened.queued = False
            marker = opened.settle()
            if marker is not None:
                markers.append(marker)
        return markers

    def flush(self) -> None:
        """Queue the SETTLE of every range with new acks."""
        for marker in self.take():
            self._send(marker)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
