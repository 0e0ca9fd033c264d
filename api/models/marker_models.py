"""The sidecar's marker input (v1 markers and v2 range markers)."""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from tracker.protocol import MAX_DELAY_MS, MAX_TIMEOUT_MS
from tracker.protocol_v2 import MAX_RANGE_WIDTH

from .common import (
    TEXT_PATTERN,
    GroupId,
    JsonBool,
    JsonInt,
    Offset,
    Partition,
    TopicName,
    storable,
    text,
)


class MarkerKindName(enum.StrEnum):
    START = "start"
    ACK = "ack"
    DELAY = "delay"
    EXTEND = "extend"
    REJECT = "reject"


class MarkerIn(BaseModel):
    """One marker, as the consumer client would write it (docs/protocol.md)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "kind": "start",
                    "group": "billing",
                    "topic": "orders",
                    "partition": 3,
                    "offset": 42,
                    "timeout_ms": 30000,
                    "consumer": "worker-1",
                },
                {
                    "kind": "delay",
                    "group": "billing",
                    "topic": "orders",
                    "partition": 1,
                    "offset": 900,
                    "attempt": 2,
                    "origin": "orders/3/42",
                    "delay_ms": 60000,
                    "reason": "timeout",
                },
            ]
        },
    )

    kind: MarkerKindName
    group: GroupId
    topic: TopicName = Field(description="Topic of the record the marker is about.")
    partition: Partition
    offset: Offset
    attempt: Annotated[int, Field(ge=1, le=0xFFFF), JsonInt] = Field(
        1, description="The record's `kmq-attempt` (1 if none)."
    )
    origin: Annotated[str, Field(max_length=300, pattern=TEXT_PATTERN)] | None = Field(
        None,
        description="The record's `kmq-origin` header (`topic/partition/offset`); null for a "
        "first delivery.",
    )
    timeout_ms: Annotated[int, Field(ge=0, le=MAX_TIMEOUT_MS), JsonInt] | None = Field(
        None,
        description="start: the lease (0 or null: the topic's policy); extend: the new lease.",
    )
    delay_ms: Annotated[int, Field(ge=0, le=MAX_DELAY_MS), JsonInt] | None = Field(
        None,
        description="delay: redeliver after this long; null: the topic's backoff policy.",
    )
    reason: Annotated[str, text(4096, "delay/reject reason."), AfterValidator(storable)] | None = (
        None
    )
    consumer: Annotated[str, text(255, "start: consumer id."), AfterValidator(storable)] | None = (
        None
    )
    deferred: Annotated[bool, JsonBool] = Field(
        False, description="delay: a delayed message read before its time (not a failure)."
    )

    @model_validator(mode="after")
    def _fields_fit_the_kind(self) -> MarkerIn:
        kind = self.kind
        if self.timeout_ms is not None and kind not in (
            MarkerKindName.START,
            MarkerKindName.EXTEND,
        ):
            raise ValueError("timeout_ms applies to start and extend markers only")
        if kind is MarkerKindName.EXTEND and not self.timeout_ms:
            raise ValueError("an extend marker needs timeout_ms >= 1")
        if (self.delay_ms is not None or self.deferred) and kind is not MarkerKindName.DELAY:
            raise ValueError("delay_ms and deferred apply to delay markers only")
        if self.deferred and self.delay_ms is None:
            raise ValueError("a deferred delay marker needs delay_ms")
        if self.reason is not None and kind not in (MarkerKindName.DELAY, MarkerKindName.REJECT):
            raise ValueError("reason applies to delay and reject markers only")
        if self.consumer is not None and kind is not MarkerKindName.START:
            raise ValueError("consumer applies to start markers only")
        return self


class RangeKindName(enum.StrEnum):
    RANGE_START = "range_start"
    RANGE_SETTLE = "range_settle"
    RANGE_EXTEND = "range_extend"


class RangeMarkerIn(BaseModel):
    """One range marker (protocol version 2): a whole fetched batch of one partition at once."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "kind": "range_start",
                    "group": "billing",
                    "topic": "orders",
                    "partition": 3,
                    "first_offset": 42,
                    "last_offset": 541,
                    "timeout_ms": 30000,
                    "consumer": "worker-1",
                },
                {
                    "kind": "range_settle",
                    "group": "billing",
                    "topic": "orders",
                    "partition": 3,
                    "first_offset": 42,
                    "last_offset": 541,
                    "except_offsets": [97],
                },
            ]
        },
    )

    kind: RangeKindName
    group: GroupId
    topic: TopicName = Field(description="Topic of the fetched records.")
    partition: Partition
    first_offset: Offset
    last_offset: Offset
    except_offsets: list[Annotated[int, Field(ge=0), JsonInt]] = Field(
        default_factory=list,
        max_length=MAX_RANGE_WIDTH,
        description="Offsets in the range the marker does not speak for: range_start, not "
        "this group's / tracked per message; range_settle, not acked; range_extend, not "
        "extended.",
    )
    timeout_ms: Annotated[int, Field(ge=0, le=MAX_TIMEOUT_MS), JsonInt] | None = Field(
        None,
        description="range_start: the lease (0 or null: the topic's policy); range_extend: "
        "the new lease.",
    )
    consumer: Annotated[str, text(255, "range_start: consumer id."), AfterValidator(storable)] | (
        None
    ) = None

    @model_validator(mode="after")
    def _fields_fit_the_kind(self) -> RangeMarkerIn:
        kind = self.kind
        if self.last_offset < self.first_offset:
            raise ValueError("last_offset must not be below first_offset")
        if self.timeout_ms is not None and kind is RangeKindName.RANGE_SETTLE:
            raise ValueError("timeout_ms applies to range_start and range_extend markers only")
        if kind is RangeKindName.RANGE_EXTEND and not self.timeout_ms:
            raise ValueError("a range_extend marker needs timeout_ms >= 1")
        if self.consumer is not None and kind is not RangeKindName.RANGE_START:
            raise ValueError("consumer applies to range_start markers only")
        return self


def _marker_item_kind(value: Any) -> str | None:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    if isinstance(value, RangeMarkerIn) or (isinstance(kind, str) and kind.startswith("range_")):
        return "range"
    return "marker"


#: One marker of either protocol version; ``kind`` picks the model (``range_*``: version 2).
MarkerItem = Annotated[
    Annotated[MarkerIn, Tag("marker")] | Annotated[RangeMarkerIn, Tag("range")],
    Discriminator(_marker_item_kind),
]


class MarkerBatch(BaseModel):
    """Several markers, written together (in order)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "markers": [
                        {
                            "kind": "ack",
                            "group": "billing",
                            "topic": "orders",
                            "partition": 3,
                            "offset": 42,
                        },
                        {
                            "kind": "reject",
                            "group": "billing",
                            "topic": "orders",
                            "partition": 3,
                            "offset": 43,
                            "reason": "bad json",
                        },
                    ]
                }
            ]
        },
    )

    markers: list[MarkerItem] = Field(min_length=1, max_length=1000)


def _marker_body_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        if "markers" in value:
            return "batch"
        return _marker_item_kind(value)
    if isinstance(value, MarkerBatch):
        return "batch"
    if isinstance(value, MarkerIn | RangeMarkerIn):
        return _marker_item_kind(value)
    return None


#: The sidecar endpoint's body: one marker, or ``{"markers": [...]}``. The discriminator picks
#: the branch first, so a validation error speaks of that branch only.
MarkerBody = Annotated[
    Annotated[MarkerIn, Tag("marker")]
    | Annotated[RangeMarkerIn, Tag("range")]
    | Annotated[MarkerBatch, Tag("batch")],
    Discriminator(
        _marker_body_kind,
        custom_error_type="marker_body",
        custom_error_message='the body must be a marker object or {"markers": [...]}',
    ),
]


class MarkersAccepted(BaseModel):
    """The markers are on the markers topic: the broker acknowledged every one."""

    accepted: int
    markers_topic: str

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"accepted": 2, "markers_topic": "kmq-markers"}]}
    )
