"""Tracked messages: listings, one message's record, operator actions."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from tracker.domain.actions import ActionKind, ActionOutcome
from tracker.protocol import MAX_TIMEOUT_MS

from .common import EXAMPLE_TIME, JsonInt, Reason, example_of


class MessageState(enum.StrEnum):
    """State of a tracked message."""

    IN_FLIGHT = "in_flight"
    DELAYED = "delayed"
    REJECTED = "rejected"
    LOST = "lost"


class MessageStatus(enum.StrEnum):
    """Where a message stands: a tracked state, or what became of it."""

    IN_FLIGHT = "in_flight"
    DELAYED = "delayed"
    REJECTED = "rejected"
    LOST = "lost"
    DEAD_LETTERED = "dead_lettered"
    ACKED = "acked"


class Position(BaseModel):
    """Where a record sits in Kafka."""

    topic: str
    partition: int
    offset: int

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"topic": "orders", "partition": 3, "offset": 42}]}
    )


class MessageSummary(BaseModel):
    """A tracked message: one logical message (origin) for one consumer group."""

    id: str = Field(description="`<group>/<topic>/<partition>/<offset>` of the origin.")
    group: str
    origin: Position = Field(description="The first delivery of the logical message.")
    state: MessageState
    attempt: int = Field(description="Delivery attempt of the latest copy (1 = first).")
    latest_copy: Position = Field(description="The record a redelivery would read back.")
    due_at: datetime | None = Field(
        description="Deadline (in flight) or due time (delayed, rejected); null when lost."
    )
    first_seen_at: datetime
    updated_at: datetime
    deferred: bool = Field(description="A delayed message seen before its time.")
    consumer: str = Field(description="The consumer that started the latest attempt.")
    reason: str = Field(description="Last retry reason, rejection reason, or why it was lost.")
    markers_partition: int
    payload_kept: bool = Field(description="The store keeps a copy of the payload.")
    being_republished: bool = Field(description="A redelivery round is republishing it now.")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "billing/orders/3/42",
                    "group": "billing",
                    "origin": {"topic": "orders", "partition": 3, "offset": 42},
                    "state": "in_flight",
                    "attempt": 2,
                    "latest_copy": {"topic": "orders", "partition": 1, "offset": 900},
                    "due_at": EXAMPLE_TIME,
                    "first_seen_at": "2026-11-21T09:20:00Z",
                    "updated_at": "2026-11-21T09:29:30Z",
                    "deferred": False,
                    "consumer": "worker-1",
                    "reason": "timeout talking to the payment service",
                    "markers_partition": 7,
                    "payload_kept": False,
                    "being_republished": False,
                }
            ]
        }
    )


class MessagePage(BaseModel):
    """One page of a listing; pass ``next_cursor`` as ``cursor`` for the next one."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "items": [example_of(MessageSummary)],
                    "next_cursor": "eyJ2IjoxLCJxIjoiOGY1N2ZiNDU0Y2MwIn0",
                    "limit": 100,
                }
            ]
        }
    )

    items: list[MessageSummary]
    next_cursor: str | None = Field(description="Null on the last page.")
    limit: int


class BytesPreview(BaseModel):
    """Bytes shown as text when they are UTF-8 text, else base64; capped in size."""

    encoding: Literal["utf-8", "base64"]
    data: str
    size: int = Field(description="Full size in bytes.")
    truncated: bool = Field(description="Only the first bytes are shown.")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"encoding": "utf-8", "data": '{"id": 1}', "size": 9, "truncated": False}]
        }
    )


class HeaderPreview(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "trace",
                    "value": {"encoding": "utf-8", "data": "abc", "size": 3, "truncated": False},
                }
            ]
        }
    )

    name: str
    value: BytesPreview | None = Field(description="Null for a header with a null value.")


class PayloadPreview(BaseModel):
    """The record as stored in Kafka (or the store's copy of it), size-capped."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "source": "kafka",
                    "position": example_of(Position),
                    "timestamp": EXAMPLE_TIME,
                    "key": {"encoding": "utf-8", "data": "order-42", "size": 8, "truncated": False},
                    "value": example_of(BytesPreview),
                    "headers": [example_of(HeaderPreview)],
                }
            ]
        }
    )

    source: Literal["kafka", "store"] = Field(description="Read from Kafka, or the store's copy.")
    position: Position
    timestamp: datetime | None
    key: BytesPreview | None
    value: BytesPreview | None
    headers: list[HeaderPreview]


class MarkerEvent(BaseModel):
    """One marker about the message, as found on the markers topic."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "kind": "start",
                    "attempt": 1,
                    "record": example_of(Position),
                    "markers_offset": 1187,
                    "timestamp": "2026-11-21T09:20:00Z",
                    "timeout_ms": 30000,
                    "delay_ms": 0,
                    "policy_delay": False,
                    "deferred": False,
                    "consumer": "worker-1",
                    "reason": "",
                }
            ]
        }
    )

    kind: Literal["start", "ack", "delay", "extend", "reject"]
    attempt: int
    record: Position = Field(description="The copy the marker is about.")
    markers_offset: int = Field(description="Offset of the marker in its markers partition.")
    timestamp: datetime | None
    timeout_ms: int
    delay_ms: int
    policy_delay: bool
    deferred: bool
    consumer: str
    reason: str
    range_offsets: tuple[int, int] | None = Field(
        default=None,
        description=(
            "For a v2 range marker (docs/protocol.md), its first and last offset: the marker "
            "covers this message along with the rest of its batch."
        ),
    )


class MarkerHistory(BaseModel):
    """Markers of this message found in the last records of its markers partition."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "markers_partition": 7,
                    "events": [example_of(MarkerEvent)],
                    "scanned_from": 0,
                    "scanned_to": 1200,
                    "complete": True,
                }
            ]
        }
    )

    markers_partition: int
    events: list[MarkerEvent]
    scanned_from: int = Field(description="First markers offset searched.")
    scanned_to: int = Field(description="End of the markers partition when searched.")
    complete: bool = Field(
        description="The search covered the whole partition as Kafka keeps it; otherwise "
        "older markers may exist before `scanned_from`."
    )


class ActionView(BaseModel):
    """An operator action as recorded in the audit trail."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": 12,
                    "action": "redeliver",
                    "actor": "admin",
                    "reason": "payment service back",
                    "at": EXAMPLE_TIME,
                    "outcome": "applied",
                    "detail": "in_flight message due now",
                    "state_before": "in_flight",
                    "state_after": "in_flight",
                    "due_at": EXAMPLE_TIME,
                    "params": {},
                    "idempotency_key": "incident-17-redeliver",
                }
            ]
        }
    )

    id: int
    action: ActionKind
    actor: str = Field(description="Who: the name of the token used.")
    reason: str
    at: datetime
    outcome: ActionOutcome
    detail: str
    state_before: str | None
    state_after: str | None
    due_at: datetime | None = Field(description="Due time after the action.")
    params: dict[str, int]
    idempotency_key: str | None


class DeadLetterView(BaseModel):
    """A message the tracker published to a dead-letter topic."""

    id: int
    message_id: str = Field(description="`<group>/<topic>/<partition>/<offset>` of the origin.")
    group: str
    origin: Position
    source: Position = Field(description="The copy that was dead-lettered.")
    dlq: Position = Field(description="The record on the dead-letter topic.")
    reason: str
    last_error: str
    attempts: int
    first_seen_at: datetime
    dead_lettered_at: datetime
    redriven_at: datetime | None
    key: BytesPreview | None

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": 17,
                    "message_id": "billing/orders/3/42",
                    "group": "billing",
                    "origin": {"topic": "orders", "partition": 3, "offset": 42},
                    "source": {"topic": "orders", "partition": 1, "offset": 977},
                    "dlq": {"topic": "orders.dlq", "partition": 3, "offset": 5},
                    "reason": "max attempts reached (5 of 5; last: processing timeout)",
                    "last_error": "",
                    "attempts": 5,
                    "first_seen_at": "2026-11-21T09:20:00Z",
                    "dead_lettered_at": EXAMPLE_TIME,
                    "redriven_at": None,
                    "key": {"encoding": "utf-8", "data": "order-42", "size": 8, "truncated": False},
                }
            ]
        }
    )


class MessageDetail(BaseModel):
    """Everything known about one message."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "billing/orders/3/42",
                    "group": "billing",
                    "origin": example_of(Position),
                    "status": "in_flight",
                    "entry": example_of(MessageSummary),
                    "actions": [example_of(ActionView)],
                    "dead_letters": [],
                    "markers": example_of(MarkerHistory),
                    "markers_error": None,
                    "payload": example_of(PayloadPreview),
                    "payload_error": None,
                }
            ]
        }
    )

    id: str
    group: str
    origin: Position
    status: MessageStatus
    entry: MessageSummary | None = Field(description="The tracked entry, while it is tracked.")
    actions: list[ActionView] = Field(description="Operator actions, oldest first.")
    dead_letters: list[DeadLetterView] = Field(description="Its dead letters, oldest first.")
    markers: MarkerHistory | None = Field(description="Null when not asked for or unavailable.")
    markers_error: str | None
    payload: PayloadPreview | None
    payload_error: str | None = Field(description="Why there is no payload preview.")


class ActionBody(BaseModel):
    """An operator action's parameters."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"reason": "customer called, retry now"}]}
    )

    reason: Reason = ""


class ExtendBody(ActionBody):
    """Extend an in-flight message's lease: the new deadline is now + ``by_ms``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"by_ms": 600000, "reason": "slow batch, give it time"}]},
    )

    by_ms: Annotated[int, Field(ge=1, le=MAX_TIMEOUT_MS), JsonInt] = Field(
        description="The new lease, in milliseconds."
    )


class ActionResponse(BaseModel):
    """The recorded action and the message after it (null when it is gone)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "action": example_of(ActionView),
                    "message": example_of(MessageSummary),
                    "replayed": False,
                }
            ]
        }
    )

    action: ActionView
    message: MessageSummary | None
    replayed: bool = Field(description="Answered from an earlier request (Idempotency-Key).")
