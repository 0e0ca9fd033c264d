"""Scenario 4b: the store's cost per operation with range markers, 10k -> 10M in flight.

Protocol v2 tracks a fetched batch as one row, so ten million messages in flight are twenty
thousand rows of 500 offsets, not ten million rows. This scenario grows the store through
:meth:`Store.apply` with range STARTs of :data:`WIDTH` offsets (1-day leases, nothing falls
due while it runs) and at each size measures, as scenario 4 does for per-message markers:

* **ingest**: ``Store.apply`` of 2 range STARTs of new batches + 2 range SETTLEs of the batches
  the operation before started (1,000 + 1,000 messages covered; the store size stays put), per
  message covered. That is the steady state: consumers settle what they fetched last while the
  backlog stays in flight. Settling the *oldest* batches instead would hit, from the second size
  on, the ranges the previous size's claims had already expanded into per-message entries, and
  compare two different paths rather than two sizes;
* **due-scan**: ``Store.next_due_ms`` over the 8 partitions, and ``Store.claim_due_ranges`` of
  1,000 messages with the claimed ranges expanded into per-message entries (as the committed
  figures were measured; a redelivery round no longer expands them);
* **API**: a tracker replica with its admin API as a subprocess on the store: the message
  listings (key order, in-flight by due) and the topic stats, sequential, median latency, and
  the process's RSS, which must not grow with the messages in flight.
"""

from __future__ import annotations

import logging
from typing import Any

from tracker.clock import SystemClock, to_millis
from tracker.partitioning import markers_partition
from tracker.store import Store
from tracker.store.port import PendingMarker

from . import markers as mk
from .common import (
    Figure,
    Infra,
    ScenarioResult,
    Stopwatch,
    unique,
)
from .scale import DAY_MS, PARTITIONS, analyze, measure, policy_for, replica_on_fresh_store

#: Offsets per range: a fetched batch of a partition (aiokafka's default max_records is 500).
WIDTH = 500
#: Ranges per Store.apply while seeding (1M messages covered).
SEED_RANGES = 2_000
#: Ranges started and settled per measured ingest operation (each way).
OP_RANGES = 2
OP_CLAIM = 1000


class RangeSeeder:
    """Grows the store with range STARTs; batch ``b`` is offsets of partition ``b % 8``."""

    def __init__(self, store: Store, markers_topic: str, queue: str) -> None:
        self.store = store
        self.markers_topic = markers_topic
        self.queue = queue
        self.size = 0  #: messages in flight
        self.next_batch = 0
        self.last_started: list[int] = []  #: batches the last ingest operation started
        self.epochs: dict[int, int] = {}

    async def load_epochs(self) -> None:
        offsets = await self.store.partition_offsets(self.markers_topic)
        self.epochs = {p: epoch for p, (epoch, _) in offsets.items()}

    def _batch(self, b: int, *, settle: bool, now: int) -> PendingMarker:
        p, first = b % PARTITIONS, (b // PARTITIONS) * WIDTH
        last = first + WIDTH - 1
        if settle:
            marker = mk.range_settle(self.queue, p, first, last)
        else:
            marker = mk.range_start(self.queue, p, first, last, DAY_MS)
        return PendingMarker(marker, now, markers_partition(self.queue, p, PARTITIONS), 0)

    def _starts(self, n: int) -> list[PendingMarker]:
        now = to_millis(SystemClock().now())
        first = self.next_batch
        self.next_batch += n
        return [self._batch(b, settle=False, now=now) for b in range(first, first + n)]

    def _settles(self, batches: list[int]) -> list[PendingMarker]:
        now = to_millis(SystemClock().now())
        return [self._batch(b, settle=True, now=now) for b in batches]

    async def apply(self, markers: list[PendingMarker]) -> None:
        now = to_millis(SystemClock().now())
        await self.store.apply(self.markers_topic, {}, markers, policy_for, now)

    async def grow_to(self, size: int) -> float:
        """Seed range STARTs until ``size`` messages are in flight; returns messages/s."""
        watch = Stopwatch()
        added = 0
        while self.size < size:
            n = max(1, min(SEED_RANGES, (size - self.size) // WIDTH))
            await self.apply(self._starts(n))
            self.size += n * WIDTH
            added += n * WIDTH
        rate = added / watch.seconds if added else float("nan")
        # As scenario 4 does and autovacuum would within a minute of the load: without
        # statistics PostgreSQL takes the 20,000 rows for a few dozen and deletes a settled
        # range by walking every range of the topic (20,000 index entries) instead of
        # probing its key.
        await analyze(self.store)
        return rate

    async def ingest_op(self) -> float:
        """Seconds per message covered: 2 range STARTs of new batches + 2 SETTLEs of the
        batches started last (by the operation before, or the newest seeded ones)."""
        settle = self.last_started or list(range(self.next_batch - OP_RANGES, self.next_batch))
        self.last_started = list(range(self.next_batch, self.next_batch + OP_RANGES))
        batch = self._starts(OP_RANGES) + self._settles(settle)
        watch = Stopwatch()
        await self.apply(batch)
        return watch.seconds / (2 * OP_RANGES * WIDTH)

    async def due_scan_op(self, far: int) -> tuple[float, float, int]:
        """(next_due_ms seconds, claim_due seconds for up to 1,000, messages claimed)."""
        watch = Stopwatch()
        await self.store.next_due_ms(range(PARTITIONS))
        next_due = watch.seconds
        watch = Stopwatch()
        claim = await self.store.claim_due_ranges(
            self.markers_topic,
            epochs=self.epochs,
            due_by=dict.fromkeys(range(PARTITIONS), far),
            now_ms=far,
            limit=OP_CLAIM,
            lease_ms=DAY_MS * 365,
            token=unique("bench"),
        )
        return next_due, watch.seconds, len(claim.expanded())


async def run(
    infra: Infra,
    *,
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000, 10_000_000),
    stores: tuple[str, ...] = ("sqlite", "postgres"),
    reps: int = 7,
    api_requests: int = 20,
) -> ScenarioResult:
    result = ScenarioResult(
        "scale_ranges", "4b. Scale with range markers: messages in flight, 10k to 10M"
    )
    logging.getLogger("tracker").setLevel(logging.ERROR)
    for store_name in stores:
        series: list[dict[str, Any]] = []
        async with replica_on_fresh_store(infra, store_name, "s4b") as replica:
            seeder = RangeSeeder(replica.store, replica.markers, replica.queue)
            await seeder.load_epochs()
            for size in sizes:
                point = await measure(
                    seeder, replica, size, reps, api_requests, "ingest_us_per_message"
                )
                series.append(point)
                print(
                    f"  {store_name} {size:>11,} in flight: ingest "
                    f"{point['ingest_us_per_message']:.2f} us/message, claim "
                    f"{point['claim_due_ms']:.1f} ms, list {point['api_list_ms']:.1f} ms, "
                    f"stats {point['api_stats_ms']:.1f} ms, RSS {point['rss_mb']:.0f} MB",
                    flush=True,
                )
        result.data[store_name] = series
        _figures(result, store_name, series)
    return result


def _figures(result: ScenarioResult, store: str, series: list[dict[str, Any]]) -> None:
    first, last = series[0], series[-1]
    span = f"{first['size']:,} -> {last['size']:,} in flight"
    for key, label in (
        ("ingest_us_per_message", "ingest per message covered"),
        ("next_due_ms", "due-scan: next_due_ms"),
        ("claim_due_ms", "due-scan: claim_due of 1,000"),
        ("api_list_ms", "API list (key order)"),
        ("api_list_due_ms", "API list (in_flight by due)"),
        ("api_stats_ms", "API topic stats"),
    ):
        ratio = last[key] / first[key] if first[key] else float("nan")
        result.add(
            Figure(
                f"{store} ranges: {label}, largest/smallest",
                ratio,
                "x",
                1.5,
                "<=",
                note=f"{span}: {first[key]:.3g} -> {last[key]:.3g}",
            )
        )
    peak = max(p["rss_peak_mb"] for p in series)
    result.add(
        Figure(
            f"{store} ranges: tracker peak RSS at {last['size']:,} in flight",
            peak,
            "MB",
            256,
            "<=",
            note=f"VmHWM of the tracker+API process; {last['size'] // WIDTH:,} ranges",
        )
    )
