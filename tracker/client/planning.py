"""What to do with each record of a fetched batch: pure logic, no I/O.

For every record the consumer client fetched it decides one of:

* **deliver**: write START, then hand it to the application;
* **defer**: it carries a ``kmq-deliver-at`` in the future: write DELAY until then, do not hand
  it over (the tracker republishes it when due);
* **skip**: a redelivered copy addressed to another consumer group, or (with deduplication on)
  an exact duplicate of a copy this consumer already took: no marker, just move past it.

Keeping this apart from the aiokafka glue makes the rules unit-testable with a fake clock.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from tracker.errors import InvalidHeader
from tracker.headers import KmqHeaders
from tracker.ids import MessageId
from tracker.protocol import Marker

log = logging.getLogger(__name__)


class Action(enum.Enum):
    DELIVER = "deliver"
    DEFER = "defer"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Planned:
    """One record and what the client does with it."""

    record: Any  # aiokafka ConsumerRecord (or anything with its attributes)
    action: Action
    message: MessageId
    origin: MessageId
    attempt: int
    marker: Marker | None  # START for DELIVER, DELAY for DEFER, None for SKIP
    why: str = ""


class SeenCopies:
    """Remembers which (origin, attempt) copies this consumer took, for a time window.

    A tracker that crashed between producing a copy and recording it produces the same copy
    again; both carry the same origin and attempt. With deduplication on, the second is skipped.
    """

    def __init__(
        self,
        window: timedelta,
        capacity: int = 100_000,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if window <= timedelta(0) or capacity <= 0:
            raise ValueError("the deduplication window and capacity must be positive")
        self._window = window.total_seconds()
        self._capacity = capacity
        self._monotonic = monotonic
        self._seen: OrderedDict[tuple[MessageId, int], float] = OrderedDict()

    def _expire(self, now: float) -> None:
        seen = self._seen
        while seen:
            key, expires = next(iter(seen.items()))
            if expires > now and len(seen) < self._capacity:
                break
            del seen[key]

    def check_and_add(self, origin: MessageId, attempt: int) -> bool:
        """True when this copy was already taken (a duplicate); records it otherwise."""
        now = self._monotonic()
        self._expire(now)
        key = (origin, attempt)
        if key in self._seen:
            return True
        self._seen[key] = now + self._window
        return False

    def __len__(self) -> int:
        return len(self._seen)


def plan_batch(
    records: Sequence[Any],
    *,
    group: str,
    consumer_id: str,
    timeout_ms: int,
    now: datetime,
    seen: SeenCopies | None = None,
) -> list[Planned]:
    """Decide, for each record in fetch order, what the client does with it."""
    planned: list[Planned] = []
    for record in records:
        message = MessageId(record.topic, record.partition, record.offset)
        try:
            kmq = KmqHeaders.parse(record.headers)
        except InvalidHeader as exc:
            # Unreadable kmq headers: treat it as a first delivery, so it is still tracked.
            log.warning("record %s has invalid kmq headers (%s); tracking it as new", message, exc)
            kmq = KmqHeaders()
        if kmq.origin is None or kmq.origin == message:
            # A first delivery (a record naming itself as origin is one too).
            origin, attempt, named_origin = message, 1, None
        else:
            origin, attempt, named_origin = kmq.origin, kmq.attempt, kmq.origin
        if kmq.group is not None and kmq.group != group:
            planned.append(
                Planned(record, Action.SKIP, message, origin, attempt, None, "other group")
            )
            continue
        if seen is not None and seen.check_and_add(origin, attempt):
            planned.append(
                Planned(record, Action.SKIP, message, origin, attempt, None, "duplicate copy")
            )
            continue
        if kmq.deliver_at is not None and kmq.deliver_at > now:
            delay_ms = math.ceil((kmq.deliver_at - now).total_seconds() * 1000)
            marker = Marker.delay(
                group,
                message,
                attempt=attempt,
                origin=named_origin,
                delay_ms=delay_ms,
                reason="deliver-at",
                deferred=True,
            )
            planned.append(Planned(record, Action.DEFER, message, origin, attempt, marker))
            continue
        marker = Marker.start(
            group,
            message,
            attempt=attempt,
            origin=named_origin,
            timeout_ms=timeout_ms,
            consumer=consumer_id,
        )
        planned.append(Planned(record, Action.DELIVER, message, origin, attempt, marker))
    return planned
