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
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from tracker.domain.value_records import value_record
from tracker.errors import InvalidHeader
from tracker.headers import KmqHeaders
from tracker.ids import MessageId
from tracker.protocol import Marker
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .open_ranges import OPEN, OpenRange

log = logging.getLogger(__name__)


class Action(enum.Enum):
    DELIVER = "deliver"
    DEFER = "defer"
    SKIP = "skip"


@value_record
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

    def clear(self) -> None:
        """Forget everything (batches were dropped and will be read again)."""
        self._seen.clear()

    def forget(self, origin: MessageId, attempt: int) -> None:
        """The copy was not taken after all (its batch is read again): not a duplicate then."""
        self._seen.pop((origin, attempt), None)

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
        # Only copies can be duplicates (a first delivery is its own origin, read once).
        if seen is not None and named_origin is not None and seen.check_and_add(origin, attempt):
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


#: One run of messages to hand over, in fetch order: ``(open range, records, None, 1)`` for
#: consecutive first deliveries that one range covers, ``(None, [record], origin, attempt)``
#: for a message settled per message (a copy). Runs, not one entry per record: the common
#: batch is one run, handed over without a loop in Python.
Run = tuple[OpenRange | None, Sequence[Any], MessageId | None, int]

_headers = operator.attrgetter("headers")


@dataclass(slots=True)
class RangePlan:
    """One fetched partition batch planned for protocol v2.

    ``ranges``: the batch's first deliveries as :class:`OpenRange`s (one per
    ``MAX_RANGE_WIDTH`` offsets), whose RANGE_STARTs cover them; ``markers``: the v1 markers
    of the rest (a START naming its origin for each copy, a deferred DELAY for each delayed
    message not due yet); ``deliver``: the runs (:data:`Run`) of messages to hand over.
    """

    ranges: list[OpenRange] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    deliver: list[Run] = field(default_factory=list)
    deferred: int = 0
    skipped: int = 0


def plan_ranges(
    records: Sequence[Any],
    *,
    group: str,
    consumer_id: str,
    timeout_ms: int,
    now: datetime,
    seen: SeenCopies | None = None,
) -> RangePlan:
    """Plan one partition's fetched records (ascending offsets) for range markers.

    A record without headers is a first delivery: it only sets one byte of its range, and a
    batch of them without gaps (the common case: one check for the whole batch) is planned
    without looking at its records one by one. A record with headers goes through
    :func:`plan_batch`'s rules; a first delivery among them joins the range too, anything
    else keeps its v1 marker.
    """
    plan = RangePlan()
    if not records:
        return plan
    first_offset, last_offset = records[0].offset, records[-1].offset
    if last_offset - first_offset + 1 == len(records) and not any(map(_headers, records)):
        _plan_first_deliveries(plan, records, group)
        return plan
    opened: OpenRange | None = None
    current: list[Any] = []  #: the records of the last run, while it is a range's
    for record in records:
        offset = record.offset
        if record.headers:
            [planned] = plan_batch(
                [record],
                group=group,
                consumer_id=consumer_id,
                timeout_ms=timeout_ms,
                now=now,
                seen=seen,
            )
            if planned.action is Action.SKIP:
                plan.skipped += 1
                log.debug("skipped %s: %s", planned.message, planned.why)
                continue
            if planned.action is Action.DEFER:
                plan.markers.append(planned.marker)  # type: ignore[arg-type]
                plan.deferred += 1
                continue
            if planned.attempt != 1 or planned.origin != planned.message:
                plan.markers.append(planned.marker)  # type: ignore[arg-type]
                plan.deliver.append((None, [record], planned.origin, planned.attempt))
                current = []
                continue
        if opened is None or offset - opened.first >= MAX_RANGE_WIDTH:
            width = min(MAX_RANGE_WIDTH, last_offset - offset + 1)
            opened = OpenRange(group, record.topic, record.partition, offset, width)
            plan.ranges.append(opened)
            current = []
        opened.flags[offset - opened.first] = OPEN
        if not current:
            current = [record]
            plan.deliver.append((opened, current, None, 1))
        else:
            current.append(record)
    return plan


def _plan_first_deliveries(plan: RangePlan, records: Sequence[Any], group: str) -> None:
    """Plan consecutive offsets that are all first deliveries: whole ranges, one run each."""
    first, topic, partition = records[0].offset, records[0].topic, records[0].partition
    for at in range(0, len(records), MAX_RANGE_WIDTH):
        run = records if len(records) <= MAX_RANGE_WIDTH else records[at : at + MAX_RANGE_WIDTH]
        opened = OpenRange(group, topic, partition, first + at, len(run), all_open=True)
        plan.ranges.append(opened)
        plan.deliver.append((opened, run, None, 1))
