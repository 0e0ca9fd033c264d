"""What reading an original record back can answer: the record, a reason it is gone, or "later".

These three outcomes are what the redelivery loop, the redrive runner and the API act on, so
they live apart from the reader that produces them (:mod:`tracker.kafka.originals`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tracker.errors import KmqError


class OriginalsUnavailable(KmqError):
    """The broker did not serve the original records in time: try again later (not lost)."""


class OriginalRecord(NamedTuple):
    """An original record as stored in Kafka: what a republished copy is built from.

    ``headers`` keeps Kafka's order and duplicates. A header whose value is null on the wire
    comes back as ``None`` (kept as is, so a copy reproduces it exactly).

    A named tuple, not a frozen dataclass: a redelivery round builds one per record it reads
    back, and a tuple is built in half the time (0.7 against 1.5 us).
    """

    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class Missing:
    """The record at this position is gone or never existed; ``reason`` says which, for people.

    Examples: ``deleted by retention: log start offset is 120``; ``offset 57 is beyond the end
    of the partition (end offset 40)``; ``no record at offset 12 (compacted or a transaction
    marker)``; ``topic 'x' does not exist``; ``partition 9 of topic 'x' does not exist``.
    """

    reason: str


def retention_reason(begin: int) -> str:
    """The :class:`Missing` reason of an offset below the partition's log start."""
    return f"deleted by retention: log start offset is {begin}"
