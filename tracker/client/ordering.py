"""Which waiting messages a worker pool may start, and in what order: per-key (or per-partition)
lanes, as in Confluent Parallel Consumer's ordering modes.

A *lane* is what must not run concurrently: with :attr:`Ordering.KEY` the messages of one key
of one topic, with :attr:`Ordering.PARTITION` those of one partition, with
:attr:`Ordering.UNORDERED` nothing (every message is ready as soon as it arrives). Within a lane
messages start one at a time, in the order they were added (offset order: the consumer hands
over each partition's records in offset order), and the next one only after the one before it
is done. Different lanes run in parallel. A message without a key is in no lane in key mode:
Kafka spreads keyless records over partitions without an order to keep.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Keyed(Protocol):
    """What a lane is made of (a :class:`~tracker.client.KmqMessage` has all three)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...


class Ordering(enum.StrEnum):
    """What a worker pool keeps in order (see the module docstring)."""

    UNORDERED = "unordered"
    KEY = "key"
    PARTITION = "partition"


class Lanes(Generic[T]):
    """Waiting items, FIFO per lane, at most one item per lane ready or running at a time.

    ``lane_of`` gives an item's lane (None: no lane, ready at once). The pool takes items with
    :meth:`pop_ready`, reports each finished one with :meth:`done` (which lets the next of its
    lane become ready), and gives up waiting items with :meth:`remove`.
    """

    def __init__(self, lane_of: Callable[[T], Hashable | None]) -> None:
        self._lane_of = lane_of
        self._ready: collections.deque[T] = collections.deque()
        #: lane -> its items waiting behind the one ready or running (present: lane busy)
        self._lanes: dict[Hashable, collections.deque[T]] = {}
        self._blocked = 0  #: items waiting in lanes behind a busy one

    @property
    def ready(self) -> int:
        """Items that may start now."""
        return len(self._ready)

    @property
    def waiting(self) -> int:
        """Items not started: ready ones and ones blocked behind their lane."""
        return len(self._ready) + self._blocked

    def add(self, item: T) -> None:
        lane = self._lane_of(item)
        if lane is None:
            self._ready.append(item)
            return
        behind = self._lanes.get(lane)
        if behind is None:
            self._lanes[lane] = collections.deque()
            self._ready.append(item)
        else:
            behind.append(item)
            self._blocked += 1

    def pop_ready(self) -> T | None:
        """The next item that may start (it holds its lane until :meth:`done`), or None."""
        return self._ready.popleft() if self._ready else None

    def done(self, item: T) -> None:
        """``item`` (popped before) finished: the next of its lane may start."""
        lane = self._lane_of(item)
        if lane is None:
            return
        behind = self._lanes[lane]
        if behind:
            self._ready.append(behind.popleft())
            self._blocked -= 1
        else:
            del self._lanes[lane]

    def any_waiting(self, matches: Callable[[T], bool]) -> bool:
        """Whether a waiting item ``matches``."""
        return any(map(matches, self._ready)) or any(
            any(map(matches, behind)) for behind in self._lanes.values()
        )

    def remove(self, matches: Callable[[T], bool]) -> list[T]:
        """Take every waiting item that ``matches`` out (in no particular order).

        A lane whose ready item is taken out lets its next remaining item become ready; items
        of a lane whose item is running stay behind it.
        """
        out: list[T] = []
        for lane, behind in self._lanes.items():
            if any(map(matches, behind)):
                out += [item for item in behind if matches(item)]
                self._lanes[lane] = collections.deque(item for item in behind if not matches(item))
        self._blocked -= len(out)
        taken = [item for item in self._ready if matches(item)]
        if taken:
            self._ready = collections.deque(item for item in self._ready if not matches(item))
            for item in taken:
                self.done(item)  # frees its lane, or readies the lane's next item
        return out + taken


def lane_function(ordering: Ordering) -> Callable[[Keyed], Hashable | None]:
    """The lane of a message for ``ordering``."""
    if ordering is Ordering.KEY:
        return _key_lane
    if ordering is Ordering.PARTITION:
        return _partition_lane
    return _no_lane


def _key_lane(message: Keyed) -> Hashable | None:
    key = message.key
    return None if key is None else (message.topic, key)


def _partition_lane(message: Keyed) -> Hashable | None:
    return (message.topic, message.partition)


def _no_lane(message: Keyed) -> Hashable | None:
    return None
