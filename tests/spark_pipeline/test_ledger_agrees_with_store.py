"""The Spark ledger and the tracker's store fold the same marker stream to the same answer.

The ledger (``pipeline.ledger_fold.build_ledger``) is how operators audit what the tracker did;
if the two folds disagreed, the audit would report problems that are not there, or miss real
ones. One stream of v1 markers (many messages interleaved, lifecycles of every kind: acked,
extended, retried with explicit delays, rejected, left in flight or delayed) goes through the
store's fold (the in-memory store: the contract suite holds the SQL stores to the same fold)
and through the ledger; per message, both must say whether it is settled (acked), and for the
others what is pending (processing, a redelivery, a dead letter), at which attempt, due when.
"""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from pyspark.sql import SparkSession

from pipeline.ledger_fold import LedgerParams, build_ledger
from pipeline.marker_batches import markers_batch
from pipeline.record_schemas import arrow_schema, spark_schema
from tracker.domain.entries import Entry, State
from tracker.domain.policy import BackoffPolicy, ResolvedPolicy
from tracker.ids import MessageId
from tracker.protocol import Marker, encode_marker
from tracker.store.memory import InMemoryStore
from tracker.store.port import PartitionProgress, PendingMarker

pytestmark = [pytest.mark.integration]

MARKERS = "kmq-markers"
GROUP, TOPIC = "billing", "orders"
T0 = 1_790_000_000_000
MESSAGES = 300
POLICY = ResolvedPolicy(30_000, BackoffPolicy(), 3_600_000)


def _stream(seed: int) -> list[tuple[int, Marker]]:
    """(timestamp, marker) of every message's life, interleaved in time order."""
    rng = random.Random(seed)
    events: list[tuple[int, int, Marker]] = []  # (time, tie-breaker, marker)

    def add(at: int, marker: Marker) -> None:
        events.append((at, len(events), marker))

    for offset in range(MESSAGES):
        origin = MessageId(TOPIC, 0, offset)
        t = T0 + rng.randrange(0, 60_000)
        for attempt in range(1, 5):
            copy = origin if attempt == 1 else MessageId(TOPIC, 0, 10_000 + offset * 10 + attempt)

            add(t, Marker.start(GROUP, copy, attempt=attempt, origin=origin, timeout_ms=20_000))
            for _ in range(rng.randrange(0, 3)):
                t += rng.randrange(1, 15_000)
                add(
                    t, Marker.extend(GROUP, copy, attempt=attempt, origin=origin, timeout_ms=25_000)
                )
            t += rng.randrange(1, 10_000)
            ending = rng.choice(["ack", "ack", "delay", "reject", "open"])
            if ending == "ack":
                add(t, Marker.ack(GROUP, copy, attempt=attempt, origin=origin))
                break
            if ending == "reject":
                add(t, Marker.reject(GROUP, copy, attempt=attempt, origin=origin, reason="bad"))
                break
            if ending == "open":
                break
            delay = rng.randrange(1_000, 120_000)
            add(t, Marker.delay(GROUP, copy, attempt=attempt, origin=origin, delay_ms=delay))
            if attempt == 4 or rng.random() < 0.3:
                break  # left delayed: the next delivery has not happened yet
            t += delay + rng.randrange(0, 5_000)
    events.sort()
    return [(at, marker) for at, _, marker in events]


async def _store_fold(stream: list[tuple[int, Marker]]) -> dict[int, Entry]:
    store = InMemoryStore()
    epoch = (await store.claim_partitions(MARKERS, [0], "a", T0))[0].epoch
    pending = [PendingMarker(m, at, 0, i) for i, (at, m) in enumerate(stream)]
    for start in range(0, len(pending), 97):  # flushes of any size fold the same
        batch = pending[start : start + 97]
        progress = {0: PartitionProgress(epoch, batch[-1].markers_offset + 1)}
        result = await store.apply(MARKERS, progress, batch, lambda _t: POLICY, batch[-1].ref_ms)
        assert result.anomalies == [], "the stream is well-formed: no marker is refused"
    return {e.origin_offset: e for e in await store.list_entries(10 * MESSAGES)}


def test_the_ledger_and_the_store_fold_a_marker_stream_alike(spark: SparkSession) -> None:
    stream = _stream(seed=20261126)
    entries = asyncio.run(_store_fold(stream))

    schema = spark_schema("markers")
    batch = markers_batch(
        [0] * len(stream),
        list(range(len(stream))),
        [at for at, _ in stream],
        [encode_marker(m) for _, m in stream],
        arrow_schema(schema),
    )
    markers = spark.createDataFrame(pa.Table.from_batches([batch]).to_pandas(), schema)
    as_of = datetime.fromtimestamp((stream[-1][0] + 1) / 1000, tz=UTC)
    # dlq_checked: the DLQ topics count as read (and empty). A rejected message is then not
    # yet dead-lettered, only due to be: what the store's REJECTED entry says too.
    params = LedgerParams(
        as_of=as_of,
        default_timeout_ms=30_000,
        grace_ms=5_000,
        stuck_after_ms=600_000,
        dlq_checked=True,
    )
    rows = {r["offset"]: r for r in build_ledger(markers, None, params).collect()}

    assert set(rows) == set(range(MESSAGES))
    pending = {
        State.IN_FLIGHT: "processing",
        State.DELAYED: "redelivery",
        State.REJECTED: "dead_letter",
    }
    seen = {"acked": 0, State.IN_FLIGHT: 0, State.DELAYED: 0, State.REJECTED: 0}
    for offset, row in sorted(rows.items()):
        entry = entries.get(offset)
        what = f"{TOPIC}/0/{offset}: ledger {row['final_state']}, store {entry}"
        if entry is None:
            assert row["final_state"] == "acked", what
            seen["acked"] += 1
            continue
        assert row["attempts"] == entry.attempt, what
        assert row["final_state"] in ("in_flight", "stuck", "lost"), what
        assert row["pending"] == pending[entry.state], what
        expected_ms = int(row["expected_by"].timestamp() * 1000)
        assert expected_ms == entry.due_at_ms, what
        seen[entry.state] += 1
    assert all(count >= 10 for count in seen.values()), f"every kind of ending occurs: {seen}"
