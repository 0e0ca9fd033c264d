"""Per-topic policies and statistics."""

from __future__ import annotations

from datetime import datetime

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from .common import example_of


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
                    "backoff": example_of(BackoffView),
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


class GroupStats(BaseModel):
    """One consumer group's messages of a topic, by state, and its dead letters."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "group": "billing",
                    "in_flight": 80,
                    "delayed": 8,
                    "rejected": 0,
                    "lost": 1,
                    "dead_lettered": 14,
                    "dead_letters_waiting": 3,
                }
            ]
        }
    )

    group: str
    in_flight: int
    delayed: int
    rejected: int
    lost: int
    dead_lettered: int = Field(description="Dead letters recorded (redriven or not).")
    dead_letters_waiting: int = Field(description="Dead letters not redriven.")


class TopicStats(BaseModel):
    """What the tracker holds for one origin topic: all consumer groups together, then each."""

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
    groups: list[GroupStats] = Field(
        description="The counts of each consumer group with messages tracked or dead letters, "
        "by name (they add up to the topic's). Ages and rates are the topic's."
    )
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
                    "groups": [
                        example_of(GroupStats),
                        {
                            "group": "audit",
                            "in_flight": 40,
                            "delayed": 0,
                            "rejected": 0,
                            "lost": 0,
                            "dead_lettered": 0,
                            "dead_letters_waiting": 0,
                        },
                    ],
                    "policy": example_of(PolicyView),
                }
            ]
        }
    )


class TopicList(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"items": [example_of(TopicStats)]}]})

    items: list[TopicStats]
