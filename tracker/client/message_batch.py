"""The messages of one handed-over batch, made when the application looks at them.

Why not a list of :class:`KmqMessage`: with range markers, what the client knows about a
message of a batch is already in its runs (the records aiokafka fetched and the
:class:`~tracker.client.open_ranges.OpenRange` whose byte per offset holds its settled state).
A message object per record, made at hand-over and held for the whole batch, was the largest
per-message cost left in the batch form: making it (~0.2 us) and, above all, CPython's
cyclic GC, which runs a collection for every ~700 tracked objects allocated and not freed yet
(a batch of 500 records plus 500 messages is one or two collections per batch, and the
records fetched ahead survive into the older generations). Plain aiokafka frees each
batch's records before it fetches the next one and triggers almost none.

So a :class:`MessageBatch` keeps the runs and makes messages on demand:

* an application that settles the batch whole (``getmany()`` then ``ack_all()``) makes none;
* ``async for message in consumer`` reads it with :func:`each_once`: each message is made
  when it is reached and freed when the application lets it go, as plain aiokafka's records
  are (the worker pool reads it so too, but holds a job per message of the batch anyway);
* indexing or iterating it as a sequence makes all of them once and keeps them, so that the
  application sees the same object for a message every time. A batch is read one way or the
  other, never both: a retry or reject is kept on the message object (the range only knows
  the offset diverged), so two objects for one record could settle it twice. That is why
  :func:`each_once` is the client's, not the application's.

A message settled per message (a redelivered copy) is made at once: ``ack_all()`` needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, repeat
from operator import eq
from typing import Any, overload

from .message import KmqMessage, MessageContext
from .open_ranges import OpenRange
from .planning import Run

#: One part of a batch: the records that one range covers, or a message settled on its own.
_Part = tuple[OpenRange, Sequence[Any]] | KmqMessage


class MessageBatch(Sequence[KmqMessage]):
    """A batch of messages handed to the application, in fetch order (see the module doc)."""

    __slots__ = ("_context", "_length", "_made", "_parts")

    def __init__(
        self, runs: Iterable[Run], context: MessageContext, loose: list[KmqMessage]
    ) -> None:
        """``loose`` gets the messages settled per message (what ``ack_all`` must ack)."""
        parts: list[_Part] = []
        length = 0
        for opened, records, origin, attempt in runs:
            if opened is not None:
                parts.append((opened, records))
                length += len(records)
            else:
                message = KmqMessage(records[0], context, None, origin, attempt)
                loose.append(message)
                parts.append(message)
                length += 1
        self._parts = parts
        self._context = context
        self._length = length
        self._made: list[KmqMessage] | None = None

    def __len__(self) -> int:
        return self._length

    def _messages(self, part: _Part) -> Iterator[KmqMessage]:
        if isinstance(part, KmqMessage):
            return iter((part,))
        opened, records = part
        return map(KmqMessage, records, repeat(self._context), repeat(opened))

    def _each_once(self) -> Iterator[KmqMessage]:
        """Every message, made as it is reached and not kept (for readers that pass once)."""
        if self._made is not None:
            return iter(self._made)
        return chain.from_iterable(map(self._messages, self._parts))

    def _all(self) -> list[KmqMessage]:
        made = self._made
        if made is None:
            made = self._made = list(self._each_once())
        return made

    def __iter__(self) -> Iterator[KmqMessage]:
        return iter(self._all())

    @overload
    def __getitem__(self, index: int) -> KmqMessage: ...

    @overload
    def __getitem__(self, index: slice) -> list[KmqMessage]: ...

    def __getitem__(self, index: int | slice) -> KmqMessage | list[KmqMessage]:
        return self._all()[index]

    def __eq__(self, other: object) -> bool:
        """Equal to a sequence of the same messages (``getmany() == []`` works as for a list)."""
        if isinstance(other, MessageBatch | list | tuple):
            return len(other) == self._length and all(map(eq, self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists: unhashable, as they are

    def __repr__(self) -> str:
        return f"MessageBatch({self._length} messages)"


def each_once(messages: Sequence[KmqMessage]) -> Iterator[KmqMessage]:
    """Iterate ``messages`` once, without keeping the messages of a :class:`MessageBatch`.

    For the client's own readers of a batch the application never sees as a sequence
    (``async for``, the worker pool): see the module docstring.
    """
    if isinstance(messages, MessageBatch):
        return messages._each_once()
    return iter(messages)
