"""One tracked range: first deliveries of one lane in flight together, as a bitmask.

The representation :mod:`tracker.domain.ranges` folds markers into and the store keeps as one
row (``RANGE_COLUMN_NAMES``): a base offset, the bits of the offsets still open, and the
deadline, consumer and times they share. Kept apart from the fold because every layer that
stores, lists or claims ranges needs the type, and none of them needs the fold's rules.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tracker.domain.entries import Entry, State
from tracker.protocol_v2 import iter_bits

#: group, origin topic, origin partition: the markers of one lane are ordered (one markers
#: partition) and only touch that lane's entries and ranges.
LaneKey = tuple[str, str, int]
#: group, origin topic, origin partition, first (open) offset
RangeKey = tuple[str, str, int, int]


@dataclass(slots=True)
class TrackedRange:
    """First deliveries of one lane in flight together, as a bitmask (bit i: offset base+i)."""

    group_id: str
    origin_topic: str
    origin_partition: int
    markers_partition: int
    base_offset: int
    open_bits: int
    due_at_ms: int
    first_seen_ms: int
    updated_ms: int
    consumer: str
    #: set while a redelivery round republishes the range's offsets (``claim_due_ranges``); kept by
    #: every piece the range is split into, as v1 keeps an entry's token through an EXTEND
    claim_token: str | None = None

    @property
    def key(self) -> RangeKey:
        return (self.group_id, self.origin_topic, self.origin_partition, self.base_offset)

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.open_bits.bit_length() - 1

    @property
    def open_count(self) -> int:
        return self.open_bits.bit_count()

    def holds(self, offset: int) -> bool:
        shift = offset - self.base_offset
        return shift >= 0 and (self.open_bits >> shift) & 1 == 1

    def offsets(self) -> Iterator[int]:
        return iter_bits(self.open_bits, self.base_offset)

    def aligned(self, bits: int, base: int) -> int:
        """``bits`` (bit i: offset ``base + i``) in this range's frame, cut to its open bits."""
        shift = base - self.base_offset
        moved = bits << shift if shift >= 0 else bits >> -shift
        return moved & self.open_bits

    def to_frame(self, bits: int, base: int) -> int:
        """``bits`` of this range's frame moved to a frame starting at ``base``."""
        shift = self.base_offset - base
        return bits << shift if shift >= 0 else bits >> -shift

    def normalize(self) -> None:
        """Make bit 0 the lowest open offset (the key); no-op on an empty range."""
        bits = self.open_bits
        if bits and not bits & 1:
            low = (bits & -bits).bit_length() - 1
            self.open_bits = bits >> low
            self.base_offset += low

    def entry_at(self, offset: int) -> Entry:
        """The per-message entry this range stands for at ``offset``."""
        return Entry(
            self.group_id,
            self.origin_topic,
            self.origin_partition,
            offset,
            self.markers_partition,
            State.IN_FLIGHT,
            1,
            self.origin_topic,
            self.origin_partition,
            offset,
            self.due_at_ms,
            self.first_seen_ms,
            self.updated_ms,
            consumer=self.consumer,
            claim_token=self.claim_token,
        )

    def piece(self, bits: int, **changes: int | str) -> TrackedRange:
        """A range with this one's attributes (``changes`` applied) holding ``bits`` of it."""
        new = TrackedRange(
            self.group_id,
            self.origin_topic,
            self.origin_partition,
            self.markers_partition,
            self.base_offset,
            bits,
            self.due_at_ms,
            self.first_seen_ms,
            self.updated_ms,
            self.consumer,
            self.claim_token,
        )
        for name, value in changes.items():
            setattr(new, name, value)
        new.normalize()
        return new

    def row(self) -> tuple[object, ...]:
        """The values of :data:`RANGE_COLUMN_NAMES`, in that order."""
        size = (self.open_bits.bit_length() + 7) // 8
        return (
            self.group_id,
            self.origin_topic,
            self.origin_partition,
            self.base_offset,
            self.last_offset,
            self.markers_partition,
            self.open_bits.to_bytes(size, "little"),
            self.open_count,
            self.due_at_ms,
            self.first_seen_ms,
            self.updated_ms,
            self.consumer,
            self.claim_token,
        )

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> TrackedRange:
        """A range from a row of :data:`RANGE_COLUMN_NAMES` (as :meth:`row` writes them)."""
        (group, topic, partition, first, _last, markers_partition, bits, _count, due, seen,
         updated, consumer, token) = row  # fmt: skip
        return cls(
            str(group),
            str(topic),
            int(partition),
            int(markers_partition),
            int(first),
            int.from_bytes(bytes(bits), "little"),
            int(due),
            int(seen),
            int(updated),
            str(consumer),
            None if token is None else str(token),
        )


RANGE_COLUMN_NAMES = (
    "group_id",
    "origin_topic",
    "origin_partition",
    "first_offset",
    "last_offset",
    "markers_partition",
    "open_bits",
    "open_count",
    "due_at_ms",
    "first_seen_ms",
    "updated_ms",
    "consumer",
    "claim_token",
)
