"""The store as the engine sees it: one port, two adapters.

:class:`TrackerStore` is everything ingest, redelivery and the payload keeper ask of the
store, with the value types that cross it. Two adapters implement it:

* :class:`tracker.store.manager.Store`: SQL through SQLAlchemy, SQLite and PostgreSQL (the
  product; the differences between the two are in :mod:`tracker.store.dialects`);
* :class:`tracker.store.memory.InMemoryStore`: plain dictionaries, for fast tests of engine
  logic (ours and users': it ships in the package, as procrastinate's in-memory connector
  does).

The contract suite (``tests/contract/test_store_contract.py``) runs the same tests against
all three backends: what it asserts is what any store must do.

The rules every adapter keeps: each call is atomic (all of it or nothing); a call for markers
partitions whose epoch moved on raises :class:`~tracker.store.store_errors.Fenced` (``apply``) or
reports them (``claim_due_ranges``) and changes nothing there; a backend that is unreachable raises
:class:`~tracker.store.store_errors.StoreUnavailable`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from tracker.domain.entries import Entry, EntryKey, State
from tracker.domain.policy import PolicyLookup
from tracker.domain.range_claims import DueClaim
from tracker.domain.tracked_range import TrackedRange
from tracker.ids import MessageId
from tracker.protocol import AnyMarker


class PendingMarker(NamedTuple):
    """A decoded marker waiting to be applied, with where it came from.

    A named tuple, not a dataclass: ingest makes one per fetched marker, and the C pass over
    a batch (``tracker.engine.record_decoding``) builds a tuple without calling Python.
    """

    marker: AnyMarker  #: a v1 marker or a v2 range marker
    ref_ms: int  #: the reference time of its durations (record timestamp, clamped)
    markers_partition: int
    markers_offset: int


@dataclass(frozen=True, slots=True)
class PartitionProgress:
    epoch: int
    next_offset: int  #: the first markers offset not applied after this flush


@dataclass(slots=True)
class ApplyResult:
    anomalies: list[tuple[PendingMarker, str]] = field(default_factory=list)
    upserted: int = 0
    deleted: int = 0
    earliest_due_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    epoch: int
    next_offset: int | None  #: None: nothing applied yet, start from the committed offset


@dataclass(frozen=True, slots=True)
class StoredPayload:
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class DeadLetterRecord:
    entry: Entry
    dlq_topic: str
    dlq_partition: int
    dlq_offset: int
    reason: str
    dead_lettered_ms: int
    message_key: bytes | None


class TrackerStore(Protocol):
    """What the engine needs of a store."""

    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` unless the store answers."""
        ...

    async def close(self) -> None: ...

    # -- ownership
    async def claim_partitions(
        self, markers_topic: str, partitions: Iterable[int], owner: str, now_ms: int
    ) -> dict[int, Claim]:
        """Take these markers partitions over: bump their epochs, return where to resume."""
        ...

    async def release_partitions(self, markers_topic: str, epochs: dict[int, int]) -> None:
        """Give partitions up (on revoke or shutdown) if they are still ours."""
        ...

    # -- ingest
    async def apply(
        self,
        markers_topic: str,
        progress: dict[int, PartitionProgress],
        markers: Sequence[PendingMarker],
        policy_for: PolicyLookup,
        now_ms: int,
    ) -> ApplyResult:
        """Apply markers (in order) and record how far each partition is applied, atomically;
        ``Fenced`` (and nothing applied) if any partition is no longer ours."""
        ...

    # -- redelivery
    async def next_due_by_partition(self, partitions: Iterable[int]) -> dict[int, int]:
        """Per markers partition with anything due, the earliest due time."""
        ...

    async def next_due_ms(self, partitions: Iterable[int]) -> int | None:
        """The earliest due time among these partitions' entries and ranges."""
        ...

    async def copies_falling_due(
        self, partitions: Iterable[int], after_ms: int, until_ms: int, limit: int
    ) -> list[tuple[int, MessageId]]:
        """``(due time, position)`` of the records that entries and ranges of these markers
        partitions due in ``(after_ms, until_ms]`` would copy from Kafka (not those whose
        payload the store keeps), earliest first, ``limit`` at most: what redelivery reads
        ahead while ``ack_grace`` runs (``tracker.engine.read_ahead``). Reads only."""
        ...

    async def claim_due_ranges(
        self,
        markers_topic: str,
        *,
        epochs: dict[int, int],
        due_by: dict[int, int],
        now_ms: int,
        limit: int,
        lease_ms: int,
        token: str,
    ) -> DueClaim:
        """Claim up to ``limit`` messages due by ``due_by[partition]`` (earliest first), each
        pushed to ``now_ms + lease_ms``: due entries, and due tracked ranges as ranges (in due
        order, about ``limit`` offsets of them; which of equally due ranges is the store's
        choice; the one that would cross ``limit`` is split). Returns them as they were, with
        ``token``, and the partitions fenced."""
        ...

    async def finish_redelivery(
        self,
        token: str,
        *,
        markers_topic: str,
        partitions: Iterable[int],
        done: Sequence[EntryKey],
        dead: Sequence[DeadLetterRecord],
        lost: Sequence[tuple[EntryKey, str]],
        retry: Sequence[tuple[EntryKey, int]],
        now_ms: int,
    ) -> None:
        """Record a round's outcome: ``done`` and dead-lettered entries go, ``lost`` ones are
        kept as lost, ``retry`` ones are due again then, each only if still claimed with
        ``token``; every dead letter is recorded (its DLQ record was produced). The ranges
        claimed with ``token`` go; their offsets named in none of these (nor settled by
        markers since) become entries of their own, due when the claim's lease ends."""
        ...

    async def mark_lost(self, items: Sequence[tuple[EntryKey, str]], now_ms: int) -> None:
        """Record entries as lost (their original is gone), whoever claimed them."""
        ...

    # -- payload copies for long delays
    async def entries_needing_payload(self, partitions: Iterable[int], limit: int) -> list[Entry]:
        """Entries of these partitions that must keep their payload and have none yet."""
        ...

    async def store_payloads(self, payloads: Sequence[tuple[EntryKey, StoredPayload]]) -> None:
        """Keep these payloads with their entries (an entry gone meanwhile keeps none)."""
        ...

    async def load_payloads(self, keys: Sequence[EntryKey]) -> dict[EntryKey, StoredPayload]:
        """The payloads kept for these entries (those that have one)."""
        ...

    # -- inspection (tests, tools)
    async def get_entry(self, key: EntryKey) -> Entry | None:
        """The entry of ``key``: its own, or what the tracked range holding it stands for."""
        ...

    async def count_entries(self, state: State | None = None) -> int:
        """Entries, counting every open offset of a tracked range as one in flight."""
        ...

    async def list_entries(self, limit: int = 1000, *, group: str | None = None) -> list[Entry]:
        """Entries in key order, with the open offsets of tracked ranges as entries."""
        ...

    async def list_ranges(self) -> list[TrackedRange]:
        """Every tracked range, in key order."""
        ...

    async def list_dead_letters(
        self, limit: int = 1000, *, topic: str | None = None
    ) -> list[dict[str, Any]]:
        """Dead letters in the order they were recorded (the ``dead_letters`` row's columns)."""
        ...

    async def partition_offsets(self, markers_topic: str) -> dict[int, tuple[int, int]]:
        """``{partition: (epoch, next_offset)}`` for a markers topic."""
        ...
