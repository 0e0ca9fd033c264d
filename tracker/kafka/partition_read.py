"""The reading state of one partition during one originals fetch.

Split from :mod:`tracker.kafka.originals` because it is the part with the rules (what counts
as a gap, when an offset is beyond the end, where to seek near the end), and those are tested
without a broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, retention_reason


@dataclass(slots=True)
class PartitionRead:
    """Reading state of one partition during one ``OriginalsReader.fetch`` call.

    ``listed_end`` is ``end_offsets()``'s answer: exact on Kafka, possibly too low on tansu,
    never too high; offsets below it certainly exist (or existed). ``high_watermark`` is the
    end as seen in a fetch response during this call (None until one arrived); offsets at or
    above it are certainly beyond the end.
    """

    tp: Any  # aiokafka TopicPartition
    plan: list[int]  # sorted, distinct wanted offsets at or above the log start
    begin: int
    listed_end: int
    high_watermark: int | None = None
    next_index: int = 0
    wanted: set[int] = field(default_factory=set)  # planned offsets not yet resolved
    gaps: list[int] = field(default_factory=list)  # in range, passed, never returned

    @property
    def done(self) -> bool:
        return self.next_index >= len(self.plan)

    def collect(
        self, records: list[Any], results: dict[MessageId, OriginalRecord | Missing]
    ) -> None:
        """Keep the wanted ones among fetched ``records`` (others are read through a gap).

        aiokafka's headers are a sequence of ``(key, value)`` tuples (a tuple already, from
        its fetcher): kept as they are (a generator rebuilding each pair cost a third of
        this loop)."""
        topic, partition, wanted = self.tp.topic, self.tp.partition, self.wanted
        for record in records:
            offset = record.offset
            if offset in wanted:
                wanted.discard(offset)
                results[MessageId(topic, partition, offset)] = OriginalRecord(
                    record.key, record.value, tuple(record.headers), record.timestamp
                )

    def advance(
        self, position: int, results: dict[MessageId, OriginalRecord | Missing]
    ) -> int | None:
        """The consumer is at ``position``: the next wanted offset, or None when done.

        Wanted offsets below the position that were not returned are gaps: the broker has no
        record there (or no longer has: see the final log-start check). Wanted offsets at or
        above a high watermark seen in this call are beyond the end.
        """
        plan, wanted = self.plan, self.wanted
        while self.next_index < len(plan) and plan[self.next_index] < position:
            offset = plan[self.next_index]
            if offset in wanted:
                wanted.discard(offset)
                self.gaps.append(offset)
            self.next_index += 1
        end = self.high_watermark
        if end is not None and not self.done and plan[self.next_index] >= end:
            for offset in plan[self.next_index :]:
                if offset in wanted:
                    wanted.discard(offset)
                    results[MessageId(self.tp.topic, self.tp.partition, offset)] = Missing(
                        f"offset {offset} is beyond the end of the partition (end offset {end})"
                    )
            self.next_index = len(plan)
        return None if self.done else plan[self.next_index]

    def seek_target(self, target: int) -> int:
        """Where to seek to read ``target``: there, unless it may lie beyond the end.

        An offset at or above ``listed_end`` whose existence no fetch has confirmed yet is
        approached from the last listed record: that fetch returns records (so it answers
        quickly) and a high watermark, which settles the question on both brokers; seeking
        right past the end would get an error from Kafka and silence from tansu.
        """
        if target < self.listed_end or self.high_watermark is not None:
            return target
        return max(self.listed_end - 1, self.begin)

    def rebound(
        self, begin: int, listed_end: int, results: dict[MessageId, OriginalRecord | Missing]
    ) -> bool:
        """The broker refused an offset and the bounds were read again: wanted offsets now
        below the log start are gone. Returns whether any was settled so; the read goes on at
        the first offset still wanted."""
        self.begin, self.listed_end = begin, listed_end
        settled = False
        for offset in self.plan[self.next_index :]:
            if offset < begin and offset in self.wanted:
                settled = True
                self.wanted.discard(offset)
                results[MessageId(self.tp.topic, self.tp.partition, offset)] = Missing(
                    retention_reason(begin)
                )
        while self.next_index < len(self.plan) and self.plan[self.next_index] not in self.wanted:
            self.next_index += 1
        return settled

    def settle_gaps(self, begin: int, results: dict[MessageId, OriginalRecord | Missing]) -> None:
        """Offsets in range but never returned: deleted by retention if now below the log start
        ``begin`` (it moved while reading), else compacted or a transaction marker."""
        for offset in self.gaps:
            position = MessageId(self.tp.topic, self.tp.partition, offset)
            if offset < begin:
                results[position] = Missing(retention_reason(begin))
            else:
                results[position] = Missing(
                    f"no record at offset {offset} (compacted or a transaction marker)"
                )


def existing_partitions(
    cluster: Any,
    by_partition: Mapping[tuple[str, int], set[int]],
    results: dict[MessageId, OriginalRecord | Missing],
) -> dict[Any, set[int]]:
    """The wanted offsets of partitions that exist in ``cluster`` (aiokafka metadata), per
    ``TopicPartition``; positions in a topic or partition that does not exist, and negative
    offsets, are settled as :class:`Missing` in ``results``."""
    existing: dict[Any, set[int]] = {}
    for (topic, partition), offsets in by_partition.items():
        partitions = cluster.partitions_for_topic(topic)
        reason: str | None = None
        if partitions is None:
            reason = f"topic {topic!r} does not exist"
        elif partition not in partitions:
            reason = f"partition {partition} of topic {topic!r} does not exist"
        if reason is not None:
            for offset in offsets:
                results[MessageId(topic, partition, offset)] = Missing(reason)
            continue
        negative = {offset for offset in offsets if offset < 0}
        for offset in negative:
            results[MessageId(topic, partition, offset)] = Missing(
                f"offset {offset} is not a valid offset"
            )
        if offsets - negative:
            existing[TopicPartition(topic, partition)] = offsets - negative
    return existing


def plan_reads(
    existing: Mapping[Any, set[int]],
    begins: Mapping[Any, int],
    ends: Mapping[Any, int],
    results: dict[MessageId, OriginalRecord | Missing],
) -> list[PartitionRead]:
    """One read per partition with offsets at or above its log start (those below are gone:
    settled as deleted by retention); the end is settled by fetch responses while reading."""
    reads: list[PartitionRead] = []
    for tp, offsets in existing.items():
        read = PartitionRead(tp, [], begins[tp], ends[tp])
        for offset in sorted(offsets):
            if offset < read.begin:
                results[MessageId(tp.topic, tp.partition, offset)] = Missing(
                    retention_reason(read.begin)
                )
            else:
                read.plan.append(offset)
        if read.plan:
            read.wanted = set(read.plan)
            reads.append(read)
    return reads
