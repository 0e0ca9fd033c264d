"""The tracker's health as the console's overview shows it: per markers partition, who owns
it and how far behind the end of the markers topic it is applied, plus the parked records.

Apart from the overview page because it is the one part of it that reads Kafka (the markers
and invalid topics' ends), shared by every viewer for a few seconds, and the engine's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka import TopicPartition

from tracker.kafka.original_records import OriginalsUnavailable
from tracker.store.overview import MarkersPartitionState

from ..context import ApiContext

#: How old the tracker health's Kafka figures (markers topic ends, parked records) may be:
#: the overview refreshes every 5 s, and every viewer within this window shares one read.
HEALTH_MAX_AGE_SECONDS = 3.0


@dataclass(frozen=True, slots=True)
class PartitionHealth:
    partition: int
    owner: str | None
    epoch: int
    applied: int
    end: int | None
    updated_ms: int

    @property
    def lag(self) -> int | None:
        return None if self.end is None else max(0, self.end - self.applied)


@dataclass(frozen=True, slots=True)
class TrackerHealth:
    partitions: list[PartitionHealth]
    markers_partitions: int | None  #: on Kafka (None: Kafka did not answer)
    parked: int | None  #: parked records the invalid topic keeps
    kafka_error: str | None
    engine: str | None  #: this process's engine, if it runs one


async def read_health(context: ApiContext, rows: list[MarkersPartitionState]) -> TrackerHealth:
    """The health of the markers partitions in ``rows`` (the store's), with what Kafka says."""
    settings = context.settings
    markers, invalid = settings.markers_topic, settings.invalid_topic
    reads = context.reads
    scanner = reads.scanner

    async def read() -> tuple[dict[str, int | None], dict[TopicPartition, tuple[int, int]]]:
        counts = await scanner.partition_counts([markers, invalid])
        tps = [
            TopicPartition(topic, p)
            for topic in (markers, invalid)
            for p in range(counts[topic] or 0)
        ]
        return counts, await scanner.bounds(tps)

    kafka_error = None
    counts: dict[str, int | None] = {}
    bounds: dict[TopicPartition, tuple[int, int]] = {}
    try:
        counts, bounds = await reads.history.run(
            ("console", "health"), read, reads.deadline(), max_age=HEALTH_MAX_AGE_SECONDS
        )
    except OriginalsUnavailable as exc:
        kafka_error = str(exc)
    partitions = [
        PartitionHealth(
            row.partition,
            row.owner,
            row.epoch,
            row.next_offset,
            bounds[TopicPartition(markers, row.partition)][1]
            if TopicPartition(markers, row.partition) in bounds
            else None,
            row.updated_ms,
        )
        for row in rows
    ]
    parked = (
        sum(end - begin for tp, (begin, end) in bounds.items() if tp.topic == invalid)
        if kafka_error is None
        else None
    )
    engine = None
    if context.engine is not None:
        # Not tracker.health(): its store ping waits behind ingest's writes on SQLite.
        running, last_error = context.engine.engine_state()
        engine = "running" if running else "not running"
        if last_error:
            engine += f" (last error: {last_error})"
    return TrackerHealth(partitions, counts.get(markers), parked, kafka_error, engine)
