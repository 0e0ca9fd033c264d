"""The values a redelivery round passes from step to step, and what it tells observers.

A round is claimed (:class:`ClaimedRound`), its copies built and queued to the producer
(:class:`QueuedRound`), then, once the broker acknowledged them, recorded in the store. Up to
``ROUNDS_IN_FLIGHT`` rounds overlap (``tracker.engine.redeliver``): these values are what one
round's steps hand each other across that overlap.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tracker.domain.entries import Entry, EntryKey, Plan
from tracker.domain.tracked_range import TrackedRange
from tracker.engine.copies import CopyBatches
from tracker.kafka.original_records import Missing, OriginalRecord


@dataclass(frozen=True, slots=True)
class ClaimedRound:
    """Due entries claimed with one token, not yet produced."""

    token: str
    started: float  #: ``perf_counter`` when the claim began
    epochs: dict[int, int]  #: the owned partitions' epochs the claim was fenced with
    entries: list[Entry]  #: to act on now
    ranges: list[TrackedRange]  #: to act on now, a range at a time (``claimed_ranges``)
    later: list[tuple[EntryKey, int]]  #: markers still in the coalescing window: due again then
    partitions: set[int]  #: markers partitions of every claimed entry and range
    full: bool  #: the claim took a whole batch: more may be due right now


@dataclass(frozen=True, slots=True)
class RangeCopies:
    """The copies of one claimed range queued in a round: each offset with its ticket."""

    tracked_range: TrackedRange
    target: str
    detail: str  #: what a copy is, for observers (``attempt 2 -> orders``)
    offsets: list[int]
    tickets: list[int]


@dataclass(frozen=True, slots=True)
class QueuedRound:
    """A round whose copies are queued to the producer, not yet acknowledged or recorded."""

    claimed: ClaimedRound
    now_ms: int
    payloads: dict[EntryKey, OriginalRecord | Missing | None]
    batches: CopyBatches
    sends: list[tuple[Entry, Plan, str, str, int]]
    range_sends: list[RangeCopies]
    lost: list[tuple[EntryKey, str]]
    lost_entries: list[Entry]
    retry: list[tuple[EntryKey, int]]
    acted: int  #: messages acted on (copied, dead-lettered, lost or failed and retried)


def reap_rounds(tasks: set[asyncio.Task[int]]) -> None:
    """Drop finished tasks from ``tasks``; raise the first failure among them."""
    finished = [task for task in tasks if task.done()]
    tasks.difference_update(finished)
    for task in finished:
        task.result()


@dataclass(frozen=True, slots=True)
class TrackerEvent:
    """Something the tracker did, for observers (the demo, logs)."""

    kind: str  #: redelivered | dead_lettered | lost
    entry: Entry
    detail: str
