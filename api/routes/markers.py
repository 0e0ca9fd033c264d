"""The sidecar endpoint: write markers over HTTP, for consumers without a Kafka producer.

Markers are validated exactly as the client validates them (``encode_marker``), routed to the
markers partition of their origin, and the answer comes only once the broker acknowledged
every one (``acks=all``): the same guarantee as the client's ``send_all``. A consumer may
therefore commit its offsets / hand the message over after a 200, exactly as after the
client's flush.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Body

from tracker.errors import MarkerError, MarkerWriteFailed
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker, MarkerKind, encode_any
from tracker.protocol_v2 import RangeKind, RangeMarker

from ..deps import Admin, Context
from ..http_errors import ApiError
from ..models import (
    MarkerBatch,
    MarkerBody,
    MarkerIn,
    MarkerKindName,
    MarkersAccepted,
    RangeKindName,
    RangeMarkerIn,
)
from . import WRITE_ERRORS, errors

router = APIRouter(prefix="/v1/markers", tags=["sidecar"])

#: How long to wait for the broker's acknowledgement before answering 503.
SEND_TIMEOUT = 30.0


def to_marker(item: MarkerIn) -> Marker:
    """The protocol marker for ``item``; raises MarkerError like the client would."""
    origin = MessageId(item.topic, item.partition, item.offset)
    if item.origin is not None:
        try:
            origin = MessageId.parse(item.origin)
        except ValueError as exc:
            raise MarkerError(f"origin: {exc}") from None
    kind = MarkerKind[item.kind.value.upper()]
    policy_delay = kind is MarkerKind.DELAY and item.delay_ms is None
    return Marker(
        kind=kind,
        group=item.group,
        topic=item.topic,
        partition=item.partition,
        offset=item.offset,
        attempt=item.attempt,
        origin_topic=origin.topic,
        origin_partition=origin.partition,
        origin_offset=origin.offset,
        timeout_ms=item.timeout_ms or 0,
        delay_ms=item.delay_ms or 0,
        policy_delay=policy_delay,
        consumer=item.consumer or "",
        reason=item.reason or "",
        deferred=item.deferred,
    )


def to_range_marker(item: RangeMarkerIn) -> RangeMarker:
    """The protocol v2 range marker for ``item``; raises MarkerError for offsets outside it."""
    exceptions = 0
    for offset in item.except_offsets:
        if not item.first_offset <= offset <= item.last_offset:
            raise MarkerError(
                f"except_offsets: {offset} is outside {item.first_offset}..{item.last_offset}"
            )
        exceptions |= 1 << (offset - item.first_offset)
    return RangeMarker(
        kind=RangeKind[item.kind.value.upper()],
        group=item.group,
        topic=item.topic,
        partition=item.partition,
        first_offset=item.first_offset,
        last_offset=item.last_offset,
        exceptions=exceptions,
        timeout_ms=item.timeout_ms or 0,
        consumer=item.consumer or "",
    )


def kind_label(marker: AnyMarker) -> str:
    """The ``kind`` label of ``kmq_sidecar_markers_total`` for ``marker``."""
    if isinstance(marker, RangeMarker):
        return RangeKindName[marker.kind.name].value
    return MarkerKindName[marker.kind.name].value


@router.post(
    "",
    response_model=MarkersAccepted,
    summary="Write markers (one, or a batch)",
    responses=errors(*WRITE_ERRORS),
)
async def post_markers(
    body: Annotated[MarkerBody, Body()],
    context: Context,
    _: Admin,
) -> MarkersAccepted:
    """Write one marker (a marker object) or several (``{"markers": [...]}``, in order).

    A marker is a per-message marker (``start``, ``ack``, ``delay``, ``extend``, ``reject``)
    or a range marker of protocol version 2 (``range_start``, ``range_settle``,
    ``range_extend``) covering a whole fetched batch of one partition.

    Answers 200 once the broker has acknowledged all of them; 422 names the first invalid
    marker (nothing is written then); 503 if the broker did not acknowledge them (some may
    have been written: markers are idempotent, so retrying the whole request is safe).
    """
    items = body.markers if isinstance(body, MarkerBatch) else [body]
    markers: list[AnyMarker] = []
    allowed = context.settings.allowed_topics
    for index, item in enumerate(items):
        where = f"markers[{index}]" if isinstance(body, MarkerBatch) else "marker"
        try:
            marker = to_marker(item) if isinstance(item, MarkerIn) else to_range_marker(item)
            encode_any(marker)
        except MarkerError as exc:
            raise ApiError(422, f"{where}: {exc}") from None
        if allowed is not None:
            for topic in {marker.topic, marker.origin_topic}:
                if topic not in allowed:
                    raise ApiError(422, f"{where}: topic {topic!r} is not in allowed_topics")
        markers.append(marker)
    try:
        async with asyncio.timeout(SEND_TIMEOUT):
            await context.markers.send_all(markers)
    except (MarkerWriteFailed, TimeoutError) as exc:
        detail = str(exc) or f"no acknowledgement within {SEND_TIMEOUT:g}s"
        raise ApiError(503, f"markers not acknowledged by the broker: {detail}") from None
    for marker in markers:
        context.metrics.sidecar_markers.labels(kind_label(marker)).inc()
    return MarkersAccepted(accepted=len(markers), markers_topic=context.settings.markers_topic)
