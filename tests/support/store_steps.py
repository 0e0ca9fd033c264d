"""Steps and fixed values of the store tests: claim partitions, apply markers, claim due
entries, on any :class:`~tracker.store.port.TrackerStore` (the contract suite and the SQL
store's own tests share them). All times are explicit milliseconds."""

from __future__ import annotations

from collections.abc import Sequence

from tracker.domain.entries import Entry, EntryKey
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker
from tracker.store.port import ApplyResult, PartitionProgress, PendingMarker, TrackerStore

MARKERS = "kmq-markers"
GROUP = "billing"
TOPIC = "orders"
FIXED_TOPIC = "fixed-backoff"  # a topic whose backoff has no jitter
T0 = 1_700_000_000_000  # a reference time (ms)
TIMEOUT_MS = 30_000
KEEP_PAYLOAD_AFTER_MS = 3_600_000

DEFAULT_POLICY = ResolvedPolicy(
    processing_timeout_ms=TIMEOUT_MS,
    backoff=BackoffPolicy(),
    keep_payload_after_ms=KEEP_PAYLOAD_AFTER_MS,
)
FIXED_POLICY = ResolvedPolicy(
    processing_timeout_ms=TIMEOUT_MS,
    backoff=BackoffPolicy.model_validate({"initial": 2.0, "multiplier": 3.0, "jitter": 0.0}),
    keep_payload_after_ms=KEEP_PAYLOAD_AFTER_MS,
)


def policy_for(topic: str) -> ResolvedPolicy:
    return FIXED_POLICY if topic == FIXED_TOPIC else DEFAULT_POLICY


def msg(offset: int, topic: str = TOPIC, partition: int = 0) -> MessageId:
    return MessageId(topic, partition, offset)


def key(offset: int, topic: str = TOPIC, partition: int = 0) -> EntryKey:
    return (GROUP, topic, partition, offset)


def pending(
    marker: AnyMarker, ref_ms: int, offset: int, markers_partition: int = 0
) -> PendingMarker:
    return PendingMarker(marker, ref_ms, markers_partition, offset)


async def claim(
    store: TrackerStore, partitions: Sequence[int] = (0,), owner: str = "a"
) -> dict[int, int]:
    """Claim partitions; return ``{partition: epoch}``."""
    claims = await store.claim_partitions(MARKERS, partitions, owner, T0)
    return {p: c.epoch for p, c in claims.items()}


async def apply(
    store: TrackerStore,
    epochs: dict[int, int],
    markers: Sequence[PendingMarker],
    now_ms: int = T0,
) -> ApplyResult:
    """Apply ``markers`` recording progress "one past the last marker" of each partition."""
    next_offsets: dict[int, int] = {}
    for p in markers:
        next_offsets[p.markers_partition] = max(
            next_offsets.get(p.markers_partition, 0), p.markers_offset + 1
        )
    progress = {
        partition: PartitionProgress(epoch, next_offsets.get(partition, 0))
        for partition, epoch in epochs.items()
    }
    return await store.apply(MARKERS, progress, markers, policy_for, now_ms)


async def start(
    store: TrackerStore,
    epochs: dict[int, int],
    offset: int,
    *,
    ref_ms: int = T0,
    timeout_ms: int = 5_000,
    markers_partition: int = 0,
    topic: str = TOPIC,
) -> Entry:
    marker = Marker.start(GROUP, msg(offset, topic), timeout_ms=timeout_ms, consumer="c-1")
    await apply(store, epochs, [pending(marker, ref_ms, offset, markers_partition)])
    entry = await store.get_entry(key(offset, topic))
    assert entry is not None
    return entry


async def claim_due(
    store: TrackerStore,
    epochs: dict[int, int],
    now_ms: int,
    claim_id: str,
    *,
    due_by: dict[int, int] | None = None,
    limit: int = 10,
    lease_ms: int = 5_000,
) -> tuple[list[Entry], set[int]]:
    """``store.claim_due_ranges`` with the claim token ``claim_id``, every claimed message as
    an entry (ranges' offsets first); by default every partition of ``epochs`` is searched up
    to ``now_ms``."""
    claim = await store.claim_due_ranges(
        MARKERS,
        epochs=epochs,
        due_by=dict.fromkeys(epochs, now_ms) if due_by is None else due_by,
        now_ms=now_ms,
        limit=limit,
        lease_ms=lease_ms,
        token=claim_id,
    )
    return claim.expanded(), claim.fenced
