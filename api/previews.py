"""Payload previews and marker histories for the message and dead-letter views.

A preview shows bytes as text when they are UTF-8 text (no control characters other than tab
and line breaks), else as base64, capped at a size so that a large record cannot blow up a
response. Marker history is read from the message's markers partition: only its last records
(``api_marker_history_scan``, kept between views by :class:`~api.marker_tail.MarkerTail`),
since the markers topic is the history and SQL keeps none.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime

from tracker.clock import from_millis
from tracker.domain.entries import EntryKey
from tracker.errors import MarkerError
from tracker.kafka.original_records import OriginalRecord
from tracker.partitioning import marker_key
from tracker.protocol import Marker, RangeMarker, decode_marker
from tracker.protocol_v2 import RangeKind

from .marker_tail import MarkerTail
from .models import (
    BytesPreview,
    HeaderPreview,
    MarkerEvent,
    MarkerHistory,
    PayloadPreview,
    Position,
)

_ALLOWED_CONTROLS = {"\t", "\n", "\r"}


def _is_text(data: bytes) -> bool:
    try:
        decoded = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(ch < " " and ch not in _ALLOWED_CONTROLS for ch in decoded)


def bytes_preview(data: bytes | None, cap: int) -> BytesPreview | None:
    if data is None:
        return None
    shown = data[:cap]
    truncated = len(data) > cap
    if _is_text(data):
        # The cut may split a character: drop the partial tail.
        return BytesPreview(
            encoding="utf-8",
            data=shown.decode("utf-8", "ignore"),
            size=len(data),
            truncated=truncated,
        )
    return BytesPreview(
        encoding="base64",
        data=base64.b64encode(shown).decode("ascii"),
        size=len(data),
        truncated=truncated,
    )


def _time(ms: int | None) -> datetime | None:
    if ms is None or ms < 0:
        return None
    return from_millis(ms).astimezone(UTC)


def payload_preview(
    position: Position, record: OriginalRecord, cap: int, *, source: str = "kafka"
) -> PayloadPreview:
    return PayloadPreview(
        source="store" if source == "store" else "kafka",
        position=position,
        timestamp=_time(record.timestamp_ms),
        key=bytes_preview(record.key, cap),
        value=bytes_preview(record.value, cap),
        headers=[
            HeaderPreview(name=name, value=bytes_preview(value, cap))
            for name, value in record.headers
        ],
    )


_RANGE_EVENT_KINDS = {
    RangeKind.RANGE_START: "start",
    RangeKind.RANGE_SETTLE: "ack",
    RangeKind.RANGE_EXTEND: "extend",
}


def _range_event(
    marker: RangeMarker, message_offset: int, offset: int, timestamp: int | None
) -> MarkerEvent:
    """A v2 range marker as the event it is for one message it covers."""
    return MarkerEvent(
        kind=_RANGE_EVENT_KINDS[marker.kind],
        attempt=1,
        record=Position(topic=marker.topic, partition=marker.partition, offset=message_offset),
        markers_offset=offset,
        timestamp=_time(timestamp),
        timeout_ms=marker.timeout_ms,
        delay_ms=0,
        policy_delay=False,
        deferred=False,
        consumer=marker.consumer,
        reason="",
        range_offsets=(marker.first_offset, marker.last_offset),
    )


def _event(marker: Marker, offset: int, timestamp: int | None) -> MarkerEvent:
    return MarkerEvent(
        kind=marker.kind.name.lower(),
        attempt=marker.attempt,
        record=Position(topic=marker.topic, partition=marker.partition, offset=marker.offset),
        markers_offset=offset,
        timestamp=_time(timestamp),
        timeout_ms=marker.timeout_ms,
        delay_ms=marker.delay_ms,
        policy_delay=marker.policy_delay,
        deferred=marker.deferred,
        consumer=marker.consumer,
        reason=marker.reason,
    )


async def marker_history(tail: MarkerTail, markers_partition: int, key: EntryKey) -> MarkerHistory:
    """The markers about ``key`` among the last records of its markers partition."""
    group, topic, partition, offset = key
    window = await tail.search(markers_partition, marker_key(topic, partition))
    events: list[MarkerEvent] = []
    for record_offset, timestamp, _, value in window.records:
        try:
            marker = decode_marker(value)
        except MarkerError:
            continue
        if isinstance(marker, RangeMarker):
            shift = offset - marker.first_offset
            if (
                (marker.group, marker.topic, marker.partition) == (group, topic, partition)
                and 0 <= shift < marker.width
                and (marker.covered >> shift) & 1
            ):
                events.append(_range_event(marker, offset, record_offset, timestamp))
        elif (
            marker.group,
            marker.origin_topic,
            marker.origin_partition,
            marker.origin_offset,
        ) == (group, topic, partition, offset):
            events.append(_event(marker, record_offset, timestamp))
    return MarkerHistory(
        markers_partition=markers_partition,
        events=events,
        scanned_from=window.first,
        scanned_to=window.end,
        complete=window.complete,
    )
