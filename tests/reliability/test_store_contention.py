"""Contention inside one replica: ingest and redelivery write the same entries at once.

In a tracker, the ingest task applies markers while the redelivery task records the outcome of
a round, each in its own transaction. They touch the same rows whenever an entry is claimed
while markers for it are still in the coalescing window: the round sets such an entry aside
("retry shortly") while the flush applies those markers (an EXTEND, an ACK). Found by the
backlog test on PostgreSQL: the two transactions lock the rows in different orders and
PostgreSQL aborts one with ``deadlock detected``; when the victim is the round's record, its
copies are already out, the entries stay claimed, and they are republished once more after the
claim lease: duplicate copies with no crash at all (739 of 4021 in one backlog run).

The test runs the real pieces: a :class:`Redeliverer` round on entries whose lease ran out and
that all have markers pending (as its ingest reports them), and, the moment the round has
claimed them, the ingest flush of those pending markers (``Store.apply``: EXTENDs update
rows, ACKs delete them). Several rounds; neither side may fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence

import pytest
from support.broker import unique_topic
from support.engine_parts import FixedProgress

from tracker.clock import SystemClock
from tracker.domain.entries import EntryKey
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy, TopicPolicy
from tracker.engine.redeliver import Redeliverer
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord
from tracker.metrics import Metrics
from tracker.protocol import Marker
from tracker.store import Store, StoreUnavailable
from tracker.store.migrate import upgrade
from tracker.store.port import PartitionProgress, PendingMarker

from .harness import Figures, report

pytestmark = [pytest.mark.integration]

ENTRIES = 300
ROUNDS = 8
POLICY = ResolvedPolicy(
    processing_timeout_ms=30_000, backoff=BackoffPolicy(), keep_payload_after_ms=3_600_000
)


def policy_for(topic: str) -> ResolvedPolicy:
    return POLICY


class NoOriginals:
    """Never asked: every claimed entry has markers pending, so none is republished."""

    async def fetch(
        self, positions: Sequence[MessageId]
    ) -> dict[MessageId, OriginalRecord | Missing]:
        raise AssertionError(f"asked for originals {positions[:3]}")


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    store = Store.from_url(database_url)
    try:
        await upgrade(store.engine)
        yield store
    finally:
        await store.close()


async def test_ingest_and_redelivery_on_the_same_entries_never_deadlock(
    store: Store, database_url: str
) -> None:
    markers = unique_topic("contention-markers")
    topic = unique_topic("contention-queue")
    group = "contention"
    now = int(time.time() * 1000)
    [claim] = (await store.claim_partitions(markers, [0], "replica", now)).values()
    epoch = claim.epoch
    offset = 0
    failures: list[str] = []
    flushes: list[asyncio.Task[object]] = []
    pending_flush: list[PendingMarker] = []

    def pending_keys(keys: Iterable[EntryKey]) -> set[EntryKey]:
        """The ingest's answer (all pending), and the moment its flush starts."""
        flushes.append(
            asyncio.create_task(
                store.apply(
                    markers,
                    {0: PartitionProgress(epoch, pending_flush[-1].markers_offset + 1)},
                    pending_flush,
                    policy_for,
                    now,
                )
            )
        )
        return set(keys)

    redeliverer = Redeliverer(
        store=store,
        producer=None,
        originals=NoOriginals(),
        markers_topic=markers,
        progress=FixedProgress(
            owned=lambda: {0: epoch},
            safe=lambda: {0: int(time.time() * 1000)},
            pending=pending_keys,
        ),
        policy_for=lambda _topic: TopicPolicy(),
        clock=SystemClock(),
        metrics=Metrics(),
        batch=ENTRIES,
        claim_lease_ms=60_000,
        max_idle=1.0,
    )
    for round_ in range(ROUNDS):
        messages = [MessageId(topic, 0, round_ * ENTRIES + i) for i in range(ENTRIES)]
        # Entries whose lease ran out a minute ago...
        starts = [
            PendingMarker(Marker.start(group, m, timeout_ms=1000), now - 60_000, 0, offset + i)
            for i, m in enumerate(messages)
        ]
        offset += len(starts)
        await store.apply(markers, {0: PartitionProgress(epoch, offset)}, starts, policy_for, now)
        # ...and markers for each, read but not applied yet (newest message first): an
        # EXTEND (the flush updates the row) for the newer half, an ACK (it deletes the row)
        # for the older half. Whatever order the flush writes rows in, the round's record
        # meets some of them the other way round.
        pending_flush[:] = [
            PendingMarker(
                Marker.extend(group, m, timeout_ms=30_000)
                if i < ENTRIES // 2
                else Marker.ack(group, m),
                now,
                0,
                offset + i,
            )
            for i, m in enumerate(reversed(messages))
        ]
        offset += len(pending_flush)
        try:
            acted = await redeliverer.run_round()
        except StoreUnavailable as exc:
            failures.append(f"round {round_}: redelivery round failed: {str(exc)[:160]}")
        else:
            assert acted == 0
        flush = flushes.pop()
        try:
            await flush
        except StoreUnavailable as exc:
            failures.append(f"round {round_}: ingest flush failed: {str(exc)[:160]}")
    backend = "sqlite" if database_url.startswith("sqlite") else "postgres"
    report(
        Figures(
            test=f"store contention (ingest flush vs redelivery record), {backend}",
            lost=0,
            acked_then_redelivered=0,
            duplicates=0,
            duplicate_bound=0,
            recovery_s=None,
            detail={"rounds": ROUNDS, "entries_per_round": ENTRIES, "failed": len(failures)},
        )
    )
    assert failures == [], "\n".join(failures)
