"""Request and response models of the admin API (the OpenAPI schema is generated from them).

Times are ISO 8601 UTC datetimes on the wire (the store keeps milliseconds since the epoch);
a time given to the API must carry a timezone (``AwareDatetime``: a naive one is ambiguous, 422).
Every model carries an example, so ``/docs`` shows realistic payloads. Free-text inputs refuse
NUL characters and lone surrogates: neither can be stored (PostgreSQL text, UTF-8). Numbers and
flags of request bodies must be JSON numbers and booleans: ``"10"`` for a number is a client's
mistake, refused (422) rather than guessed.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tracker.domain.actions import ActionKind, ActionOutcome
from tracker.domain.jobs import ItemState, JobState
from tracker.protocol import MAX_DELAY_MS, MAX_TIMEOUT_MS
from tracker.protocol_v2 import MAX_RANGE_WIDTH

MAX_PARTITION = 2**31 - 1
MAX_OFFSET = 2**63 - 1
TOPIC_PATTERN = r"^[a-zA-Z0-9._-]{1,249}$"
#: Any text without NUL (the pattern also tells the schema's consumers).
TEXT_PATTERN = r"^[^\x00]*$"
EXAMPLE_TIME = "2026-11-21T09:30:00Z"


def _storable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


def _ex(model: type[BaseModel]) -> dict[str, Any]:
    """The first example of ``model`` (to compose the examples of the models that hold it)."""
    extra = model.model_config.get("json_schema_extra")
    assert isinstance(extra, dict)  # noqa: S101 - every model here has examples
    examples = extra["examples"]
    assert isinstance(examples, list)  # noqa: S101
    first = examples[0]
    assert isinstance(first, dict)  # noqa: S101
    return dict(first)


def text(max_length: int, description: str, *, min_length: int = 0) -> Any:
    """A free-text field: bounded, storable.

    Put it before ``AfterValidator(_storable)`` in an ``Annotated``: constraints given after a
    validator are checked on its result as on any value ("at most 1000 items"), not as string
    constraints ("at most 1000 characters"), and the pattern drops out of the schema.
    """
    return Field(
        min_length=min_length, max_length=max_length, pattern=TEXT_PATTERN, description=description
    )


def _json_type(kind: Literal["int", "float", "bool"]) -> BeforeValidator:
    """Refuses a JSON string (or, for a number, a boolean) where a request body wants a number
    or a boolean: pydantic's lax mode would read ``"10"`` as 10 and ``"false"`` as False, and
    such a body is surely a client's mistake. Query parameters are strings on the wire and stay
    lax; a JSON number with a zero fraction (``10.0``) is still an integer."""
    wanted = "a JSON boolean (true or false)" if kind == "bool" else "a JSON number"
    refused: tuple[type, ...] = (str, bytes, bytearray) if kind == "bool" else (str, bytes, bool)

    def check(value: Any) -> Any:
        if isinstance(value, refused):
            raise PydanticCustomError(
                f"{kind}_type",
                "Input should be {wanted}, not {given}",
                {"wanted": wanted, "given": "a boolean" if isinstance(value, bool) else "a string"},
            )
        return value

    return BeforeValidator(check)


JsonInt = _json_type("int")
JsonFloat = _json_type("float")
JsonBool = _json_type("bool")


def _int64_text(value: Any) -> Any:
    """A Kafka position may come as a JSON string of digits: int64 offsets are strings in many
    JSON stacks (kafkajs' ``message.offset``, protobuf's JSON mapping), and the sidecar serves
    exactly those clients. Anything else that is not a JSON number is refused as by JsonInt."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return value


Reason = Annotated[str, text(1000, "Why (kept in the audit trail)."), AfterValidator(_storable)]
TopicName = Annotated[str, Field(pattern=TOPIC_PATTERN, description="A Kafka topic name.")]
GroupId = Annotated[
    str,
    text(255, "A consumer group id.", min_length=1),
    AfterValidator(_storable),
]
# Before-validators run last to first: digits become a number (_int64_text), then the JSON
# type is checked (JsonInt), then the constraints, which stay number constraints (in the
# schema too) because they come first.
Partition = Annotated[int, Field(ge=0, le=MAX_PARTITION), JsonInt, BeforeValidator(_int64_text)]
Offset = Annotated[int, Field(ge=0, le=MAX_OFFSET), JsonInt, BeforeValidator(_int64_text)]


class ErrorItem(BaseModel):
    """One invalid input."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "loc": ["query", "limit"],
                    "msg": "Input should be less than or equal to 1000",
                    "type": "less_than_equal",
                }
            ]
        }
    )

    loc: list[str | int] = Field(description="Where: e.g. ['query', 'limit'].")
    msg: str
    type: str


class ErrorResponse(BaseModel):
    """Every error: a short machine-readable code and a sentence for people."""

    error: str = Field(description="Error code, e.g. not_found, conflict, validation_error.")
    detail: str = Field(description="What went wrong and, where it helps, what to do.")
    errors: list[ErrorItem] | None = Field(
        None, description="For validation errors: each invalid input."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": "conflict",
                    "detail": "only an in-flight message's lease can be extended; this one is "
                    "delayed",
                    "errors": None,
                }
            ]
        }
    )


# -- messages -------------------------------------------------------------------------------------


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
                    "items": [_ex(MessageSummary)],
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
                    "position": _ex(Position),
                    "timestamp": EXAMPLE_TIME,
                    "key": {"encoding": "utf-8", "data": "order-42", "size": 8, "truncated": False},
                    "value": _ex(BytesPreview),
                    "headers": [_ex(HeaderPreview)],
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
                    "record": _ex(Position),
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
                    "events": [_ex(MarkerEvent)],
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
                    "origin": _ex(Position),
                    "status": "in_flight",
                    "entry": _ex(MessageSummary),
                    "actions": [_ex(ActionView)],
                    "dead_letters": [],
                    "markers": _ex(MarkerHistory),
                    "markers_error": None,
                    "payload": _ex(PayloadPreview),
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
                {"action": _ex(ActionView), "message": _ex(MessageSummary), "replayed": False}
            ]
        }
    )

    action: ActionView
    message: MessageSummary | None
    replayed: bool = Field(description="Answered from an earlier request (Idempotency-Key).")


# -- topics ---------------------------------------------------------------------------------------


class BackoffView(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"initial_seconds": 1.0, "multiplier": 2.0, "max_seconds": 900.0, "jitter": 0.2}
            ]
        }
    )

    initial_seconds: float
    multiplier: float
    max_seconds: float
    jitter: float


class PolicyView(BaseModel):
    """The policy in force for a topic (defaults merged with the topic's overrides)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "processing_timeout_seconds": 30.0,
                    "max_attempts": 5,
                    "backoff": _ex(BackoffView),
                    "dlq_topic": "orders.dlq",
                    "retry_topic": "orders",
                    "keep_payload_after_seconds": None,
                }
            ]
        }
    )

    processing_timeout_seconds: float
    max_attempts: int
    backoff: BackoffView
    dlq_topic: str
    retry_topic: str
    keep_payload_after_seconds: float | None = Field(
        description="Null: half the topic's retention."
    )


class TopicStats(BaseModel):
    """What the tracker holds for one origin topic (all consumer groups together)."""

    topic: str
    in_flight: int
    delayed: int
    rejected: int = Field(description="Waiting to be published to the DLQ.")
    lost: int
    dead_lettered: int = Field(description="Dead letters recorded (redriven or not).")
    dead_letters_waiting: int = Field(description="Dead letters not redriven.")
    oldest_in_flight_first_seen: datetime | None
    oldest_in_flight_age_seconds: float | None
    next_delayed_due: datetime | None = Field(description="Earliest due time of a delayed one.")
    window_minutes: int
    redeliveries: float | None = Field(
        description="Copies republished by this process in the window; null if unknown yet."
    )
    redeliveries_per_minute: float | None
    redeliveries_window_seconds: float = Field(
        description="Seconds of history the redelivery figures cover (at most the window)."
    )
    dead_lettered_in_window: int = Field(description="Dead-lettered in the window (all replicas).")
    dead_lettered_per_minute: float
    policy: PolicyView

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "topic": "orders",
                    "in_flight": 120,
                    "delayed": 8,
                    "rejected": 0,
                    "lost": 1,
                    "dead_lettered": 14,
                    "dead_letters_waiting": 3,
                    "oldest_in_flight_first_seen": "2026-11-21T09:28:00Z",
                    "oldest_in_flight_age_seconds": 120.0,
                    "next_delayed_due": "2026-11-21T09:31:00Z",
                    "window_minutes": 5,
                    "redeliveries": 12,
                    "redeliveries_per_minute": 2.4,
                    "redeliveries_window_seconds": 300.0,
                    "dead_lettered_in_window": 1,
                    "dead_lettered_per_minute": 0.2,
                    "policy": _ex(PolicyView),
                }
            ]
        }
    )


class TopicList(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"items": [_ex(TopicStats)]}]})

    items: list[TopicStats]


# -- dead letters and redrive -----------------------------------------------------------------


class DeadLetterPage(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"items": [_ex(DeadLetterView)], "next_cursor": None, "limit": 100}]
        }
    )

    items: list[DeadLetterView]
    next_cursor: str | None
    limit: int


class DeadLetterDetail(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "dead_letter": _ex(DeadLetterView),
                    "payload": _ex(PayloadPreview),
                    "payload_error": None,
                }
            ]
        }
    )

    dead_letter: DeadLetterView
    payload: PayloadPreview | None = Field(description="The record on the dead-letter topic.")
    payload_error: str | None


class DeadLetterFilterBody(BaseModel):
    """Which dead letters: all conditions must hold. Already redriven ones never match."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"topic": "orders", "reason": "timeout"}]},
    )

    topic: TopicName | None = None
    group: GroupId | None = None
    reason: (
        Annotated[str, text(1000, "Substring of the reason."), AfterValidator(_storable)] | None
    ) = Field(None, description="Substring of the reason, case-insensitive.")
    key: (
        Annotated[str, text(4096, "The record key.", min_length=1), AfterValidator(_storable)]
        | None
    ) = Field(None, description="The record key, exactly (as UTF-8 text).")
    # Aware only: a time without a zone is ambiguous, and is refused (422) as GET /v1/dlq does.
    since: AwareDatetime | None = Field(None, description="Dead-lettered at or after.")
    until: AwareDatetime | None = Field(None, description="Dead-lettered before.")


class RedriveCreate(BaseModel):
    """A redrive job: by filter or explicit ids (exactly one), rate-limited."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "filter": {"topic": "orders", "reason": "timeout"},
                    "target_topic": None,
                    "rate": 200,
                    "dry_run": True,
                    "reason": "payment service fixed",
                },
                {"ids": [17, 18, 21], "target_topic": "orders-replay", "rate": 50},
            ]
        },
    )

    filter: DeadLetterFilterBody | None = None
    ids: (
        Annotated[
            list[Annotated[int, Field(ge=1, le=MAX_OFFSET), JsonInt]],
            Field(min_length=1, max_length=10_000),
        ]
        | None
    ) = Field(None, description="Dead letter ids (1 to 10000).")
    target_topic: TopicName | None = Field(
        None, description="Where to republish; null: each message's original topic."
    )
    rate: Annotated[float, Field(gt=0, le=100_000), JsonFloat] = Field(
        100.0, description="Messages per second, at most."
    )
    dry_run: Annotated[bool, JsonBool] = Field(
        False, description="Only count what would be republished."
    )
    reason: Reason = ""

    @model_validator(mode="after")
    def _one_selection(self) -> RedriveCreate:
        if (self.filter is None) == (self.ids is None):
            raise ValueError("give exactly one of `filter` and `ids`")
        return self


class RedriveJobView(BaseModel):
    """A redrive job and its progress."""

    id: int
    state: JobState
    selection: dict[str, Any] = Field(description="The filter or ids it was created with.")
    target_topic: str | None
    rate: float
    dry_run: bool
    total: int = Field(description="Dead letters covered (dry run: that would be republished).")
    done: int = Field(description="Republished.")
    skipped: int = Field(description="Already redriven, or their DLQ record is gone.")
    pending: int
    progress: float = Field(ge=0, le=1)
    eta_seconds: float | None = Field(description="At the job's rate, while it runs.")
    created_by: str
    reason: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested: bool
    owner: str | None = Field(description="The replica running it.")
    last_error: str
    replayed: bool = Field(description="Answered from an earlier request (Idempotency-Key).")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": 3,
                    "state": "running",
                    "selection": {"filter": {"topic": "orders"}},
                    "target_topic": None,
                    "rate": 200.0,
                    "dry_run": False,
                    "total": 2000,
                    "done": 800,
                    "skipped": 0,
                    "pending": 1200,
                    "progress": 0.4,
                    "eta_seconds": 6.0,
                    "created_by": "admin",
                    "reason": "payment service fixed",
                    "created_at": "2026-11-21T09:29:50Z",
                    "updated_at": EXAMPLE_TIME,
                    "started_at": "2026-11-21T09:29:51Z",
                    "finished_at": None,
                    "cancel_requested": False,
                    "owner": "tracker-0:1",
                    "last_error": "",
                    "replayed": False,
                }
            ]
        }
    )


class RedriveJobPage(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"items": [_ex(RedriveJobView)], "next_cursor": None, "limit": 100}]
        }
    )

    items: list[RedriveJobView]
    next_cursor: str | None
    limit: int


class RedriveItemView(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "dead_letter_id": 17,
                    "state": "done",
                    "detail": "",
                    "produced": {"topic": "orders", "partition": 3, "offset": 1204},
                    "updated_at": EXAMPLE_TIME,
                }
            ]
        }
    )

    dead_letter_id: int
    state: ItemState
    detail: str
    produced: Position | None = Field(description="Where it was republished.")
    updated_at: datetime


class RedriveItemPage(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"items": [_ex(RedriveItemView)], "next_cursor": None, "limit": 100}]
        }
    )

    items: list[RedriveItemView]
    next_cursor: str | None
    limit: int


# -- sidecar markers --------------------------------------------------------------------------


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
    reason: Annotated[str, text(4096, "delay/reject reason."), AfterValidator(_storable)] | None = (
        None
    )
    consumer: Annotated[str, text(255, "start: consumer id."), AfterValidator(_storable)] | None = (
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
    consumer: Annotated[str, text(255, "range_start: consumer id."), AfterValidator(_storable)] | (
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


# -- ops --------------------------------------------------------------------------------------


class Health(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"]


class Check(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"ok": True, "detail": "database answers"}]}
    )

    ok: bool
    detail: str


class Readiness(BaseModel):
    """Ready: the database and the broker answer, and (with the engine) partitions are owned."""

    ready: bool
    checks: dict[str, Check]

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "ready": True,
                    "checks": {
                        "store": {"ok": True, "detail": "database answers"},
                        "broker": {"ok": True, "detail": "Kafka answers"},
                        "partitions": {"ok": True, "detail": "owns markers partitions [0, 1]"},
                    },
                }
            ]
        }
    )
