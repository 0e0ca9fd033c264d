"""What Kafka serves of one message's view: its payload preview and its marker history.

Apart from the message route because these reads are bounded and may fail on their own: each
is read within the request's deadline (see :class:`~api.context.KafkaReads`) and, past it or
when Kafka does not serve it, answers ``(None, why)`` so that the view still shows what the
database has.
"""

from __future__ import annotations

from typing import Any

from tracker.domain.entries import EntryKey
from tracker.ids import MessageId
from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.partitioning import markers_partition
from tracker.store.admin_reads import EntryView

from .context import ApiContext, not_served
from .marker_tail import MarkerTail
from .models import MarkerHistory, PayloadPreview
from .previews import marker_history, payload_preview
from .views import position


async def fetch_preview(
    context: ApiContext,
    view: EntryView | None,
    dead: list[dict[str, Any]],
    cap: int,
    deadline: float,
) -> tuple[PayloadPreview | None, str | None]:
    """The current copy's payload (or the store's copy), else the latest DLQ record's.

    Kafka is read within ``deadline`` (see :class:`~api.context.KafkaReads`); past it, the
    preview is missing and the error says so.
    """
    if view is not None:
        e = view.entry
        if view.payload_stored:
            stored = await context.queries.stored_payload(e.key)
            if stored is not None:
                record = OriginalRecord(
                    stored.key, stored.value, stored.headers, stored.timestamp_ms
                )
                where = position(e.copy_topic, e.copy_partition, e.copy_offset)
                return payload_preview(where, record, cap, source="store"), None
        target = MessageId(e.copy_topic, e.copy_partition, e.copy_offset)
    elif dead:
        row = dead[-1]
        target = MessageId(row["dlq_topic"], row["dlq_partition"], row["dlq_offset"])
    else:
        return None, "no record to show"
    try:
        result = await context.reads.fetch(target, deadline)
    except OriginalsUnavailable as exc:
        return None, not_served(exc)
    if isinstance(result, OriginalRecord):
        return payload_preview(position(*target), result, cap), None
    if isinstance(result, Missing):
        return None, f"record {target} is gone: {result.reason}"
    return None, f"record {target} could not be read"


async def not_asked() -> tuple[None, None]:
    """A Kafka read the request did not ask for: nothing, and no error."""
    return None, None


async def fetch_history(
    context: ApiContext, tail: MarkerTail, key: EntryKey, view: EntryView | None, deadline: float
) -> tuple[MarkerHistory | None, str | None]:
    """The message's marker history, read within ``deadline``; else why not."""
    settings = context.settings
    scanner = context.reads.scanner
    # Known from the entry, or computed (from the partition count) like a writer does.
    known = view.entry.markers_partition if view is not None else None

    async def read() -> MarkerHistory:
        partition = known
        if partition is None:
            topic = settings.markers_topic
            total = (await scanner.partition_counts([topic])).get(topic)
            if not total:
                raise OriginalsUnavailable(f"the markers topic {topic!r} does not exist")
            partition = markers_partition(key[1], key[2], total)
        return await marker_history(tail, partition, key)

    try:
        return await context.reads.history.run(key, read, deadline), None
    except OriginalsUnavailable as exc:
        return None, f"marker history unavailable: {exc}"
