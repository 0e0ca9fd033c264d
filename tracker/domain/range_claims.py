"""Which due ranges a redelivery round claims, and how (shared by the SQL and memory stores).

A round claims a due range as the range: one row takes the round's token and lease, whatever
its width, and the round redelivers its open offsets. The claim is bounded by the round's
batch, which due ranges and due entries share in due order (:func:`share_of_batch`): ranges
are taken in due order until their share is full, and the range that would overflow it is
split, its lowest open offsets claimed and the rest left due as they were.
Per-offset work is left to what diverges (see ``DueClaims.finish_redelivery``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from tracker.domain.entries import Entry
from tracker.domain.tracked_range import TrackedRange
from tracker.ids import MessageId


@dataclass(slots=True)
class TakenRanges:
    """The outcome of :func:`take_due_ranges`."""

    #: ranges to write back: the claimed ones (token, lease) and the unclaimed rest of a split
    written: list[TrackedRange] = field(default_factory=list)
    #: the claimed pieces as they were before the claim (due time), with the token: what the
    #: round redelivers, a range each (see :class:`DueClaim`)
    claimed: list[TrackedRange] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DueClaim:
    """What one claim took: due entries, and due ranges kept as ranges.

    A redelivery round works on a claimed range as a range (one plan, one tally, per-offset
    work only for the records it copies and the offsets that diverge), so the claim does not
    expand it into an :class:`Entry` per offset (1-2 us each, most of a claim's CPU in a mass
    expiry). Ranges and entries are as they were before the claim (due time), with the token.
    """

    entries: list[Entry]
    ranges: list[TrackedRange]
    fenced: set[int]

    def expanded(self) -> list[Entry]:
        """Every claimed message as an entry: the ranges' offsets first, then the entries."""
        out = [t.entry_at(offset) for t in self.ranges for offset in t.offsets()]
        return out + self.entries


def lowest_bits(bits: int, count: int) -> int:
    """The ``count`` lowest set bits of ``bits`` (all of them if it has fewer)."""
    if count >= bits.bit_count():
        return bits
    out = 0
    for _ in range(count):
        low = bits & -bits
        out |= low
        bits ^= low
    return out


def share_of_batch(
    ranges: Iterable[TrackedRange], entry_dues: Iterable[int], limit: int
) -> tuple[int, int]:
    """How a batch of ``limit`` is shared by due ranges and due entries, in due order.

    ``entry_dues``: the due times of the earliest due entries (any order). Returns
    ``(offsets of ranges, entries)``: what :func:`take_due_ranges` and the entries' claim may
    take so that together they claim the ``limit`` earliest due messages (an entry before a
    range due at the same moment). Neither kind waits behind the other: a mass expiry of
    ranges does not hold back retries due before it, nor the reverse.
    """
    dues = sorted(entry_dues)
    room, offsets, entries = limit, 0, 0
    for tracked_range in sorted(ranges, key=lambda t: (t.due_at_ms, t.key)):
        while room > 0 and entries < len(dues) and dues[entries] <= tracked_range.due_at_ms:
            entries += 1
            room -= 1
        if room <= 0:
            break
        taken = min(room, tracked_range.open_count)
        offsets += taken
        room -= taken
    entries += min(room, len(dues) - entries)
    return offsets, entries


def take_due_ranges(
    candidates: Iterable[TrackedRange], limit: int, *, token: str, claimed_due: int
) -> TakenRanges:
    """Claim due ``candidates`` in due order (then key order) up to ``limit`` offsets."""
    taken = TakenRanges()
    room = limit
    for tracked_range in sorted(candidates, key=lambda t: (t.due_at_ms, t.key)):
        if room <= 0:
            break
        claimed_bits = lowest_bits(tracked_range.open_bits, room)
        rest = tracked_range.open_bits & ~claimed_bits
        as_was = replace(tracked_range, open_bits=claimed_bits, claim_token=token)
        taken.claimed.append(as_was)
        taken.written.append(replace(as_was, due_at_ms=claimed_due))
        if rest:
            taken.written.append(tracked_range.piece(rest))
        room -= claimed_bits.bit_count()
    return taken


def range_copies(ranges: Iterable[TrackedRange], limit: int) -> list[tuple[int, MessageId]]:
    """``(due time, position)`` of the records that due ranges (in due order) copy when
    redelivered, ``limit`` at most: a range stands for first deliveries, so each offset
    copies its origin. Expands only as far as ``limit`` reaches, not every range in full (a
    range may hold 65,536 offsets)."""
    out: list[tuple[int, MessageId]] = []
    for tracked in ranges:
        if len(out) >= limit:
            break
        due, topic, partition = tracked.due_at_ms, tracked.origin_topic, tracked.origin_partition
        out += [
            (due, MessageId(topic, partition, offset))
            for offset in itertools.islice(tracked.offsets(), limit - len(out))
        ]
    return out


__all__ = [
    "DueClaim",
    "TakenRanges",
    "lowest_bits",
    "range_copies",
    "share_of_batch",
    "take_due_ranges",
]
