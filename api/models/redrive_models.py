"""Dead letters and redrive jobs."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from tracker.domain.jobs import ItemState, JobState

from .common import (
    EXAMPLE_TIME,
    MAX_OFFSET,
    GroupId,
    JsonBool,
    JsonFloat,
    JsonInt,
    Reason,
    TopicName,
    example_of,
    storable,
    text,
)
from .message_models import DeadLetterView, PayloadPreview, Position


class DeadLetterPage(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"items": [example_of(DeadLetterView)], "next_cursor": None, "limit": 100}]
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
                    "dead_letter": example_of(DeadLetterView),
                    "payload": example_of(PayloadPreview),
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
        Annotated[str, text(1000, "Substring of the reason."), AfterValidator(storable)] | None
    ) = Field(None, description="Substring of the reason, case-insensitive.")
    key: (
        Annotated[str, text(4096, "The record key.", min_length=1), AfterValidator(storable)] | None
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
            "examples": [{"items": [example_of(RedriveJobView)], "next_cursor": None, "limit": 100}]
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
            "examples": [
                {"items": [example_of(RedriveItemView)], "next_cursor": None, "limit": 100}
            ]
        }
    )

    items: list[RedriveItemView]
    next_cursor: str | None
    limit: int
