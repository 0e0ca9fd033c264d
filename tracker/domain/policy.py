"""Topic policies: how long a lease lasts, how often and how late a message is retried, where
it goes when it is dead.

These are the rules every layer applies to a topic's messages: settings hold them per topic
(``default_policy`` and ``topics``), the state machine resolves them into milliseconds
(:class:`ResolvedPolicy`), redelivery reads the attempts and output topics, the API shows them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tracker.domain.durations import Duration
from tracker.ids import is_valid_topic


def topic_name(value: str | None) -> str | None:
    if value is not None and not is_valid_topic(value):
        raise ValueError(f"{value!r} is not a legal Kafka topic name")
    return value


class BackoffPolicy(BaseModel):
    """Exponential backoff with a cap and jitter, for retries that do not name a delay."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    initial: Duration = Field(timedelta(seconds=1), description="Delay before the 2nd attempt.")
    multiplier: float = Field(2.0, ge=1.0, le=100.0, description="Growth per attempt.")
    max: Duration = Field(timedelta(minutes=15), description="Upper bound of the delay.")
    jitter: float = Field(
        0.2, ge=0.0, le=1.0, description="Random spread, as a fraction of the delay (+/-)."
    )

    @model_validator(mode="after")
    def _check(self) -> BackoffPolicy:
        if self.initial <= timedelta(0) or self.max < self.initial:
            raise ValueError("backoff needs 0 < initial <= max")
        return self

    def delay_ms(self, attempt: int, seed: bytes) -> int:
        """The delay after failed attempt ``attempt`` (1-based).

        Jitter is derived from ``seed`` (the message identity), not from a random generator,
        so replaying the same markers yields the same due time.
        """
        base = self.initial.total_seconds() * self.multiplier ** max(0, attempt - 1)
        base = min(base, self.max.total_seconds())
        if self.jitter:
            unit = int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "big") / 2**64
            base *= 1 + self.jitter * (2 * unit - 1)
        return max(1, round(base * 1000))


class TopicPolicyOverride(BaseModel):
    """Per-topic overrides; unset fields fall back to ``default_policy``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    processing_timeout: Duration | None = None
    max_attempts: int | None = Field(None, ge=1, le=0xFFFF)
    backoff: BackoffPolicy | None = None
    dlq_topic: str | None = None
    retry_topic: str | None = None
    keep_payload_after: Duration | None = None

    _dlq = field_validator("dlq_topic", "retry_topic")(topic_name)


class TopicPolicy(BaseModel):
    """How the tracker treats messages of one topic."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    processing_timeout: Duration = Field(
        timedelta(seconds=30),
        description="Lease of a START that does not name one; redelivered when it expires.",
    )
    max_attempts: int = Field(
        5, ge=1, le=0xFFFF, description="Deliveries before a message goes to the DLQ."
    )
    backoff: BackoffPolicy = Field(default_factory=BackoffPolicy)
    dlq_topic: str | None = Field(None, description="Dead-letter topic; default `<topic>.dlq`.")
    retry_topic: str | None = Field(
        None, description="Where redelivered copies go; default the message's own topic."
    )
    keep_payload_after: Duration | None = Field(
        None,
        description=(
            "Delays longer than this keep a copy of the payload in the store, so that a "
            "message outliving the topic's retention is not lost. Default: half the topic's "
            "retention.ms (7 days assumed when the broker does not say)."
        ),
    )

    _dlq = field_validator("dlq_topic", "retry_topic")(topic_name)

    @model_validator(mode="after")
    def _check(self) -> TopicPolicy:
        if self.processing_timeout <= timedelta(0):
            raise ValueError("processing_timeout must be positive")
        return self

    def merged(self, override: TopicPolicyOverride | None) -> TopicPolicy:
        if override is None:
            return self
        changes = override.model_dump(exclude_none=True)
        return self.model_validate({**self.model_dump(), **changes})

    def dlq_for(self, topic: str) -> str:
        return self.dlq_topic or f"{topic}.dlq"

    def retry_for(self, topic: str) -> str:
        return self.retry_topic or topic


@dataclass(frozen=True, slots=True)
class ResolvedPolicy:
    """The parts of a topic's policy the state machine needs, in milliseconds."""

    processing_timeout_ms: int
    backoff: BackoffPolicy
    keep_payload_after_ms: int


PolicyLookup = Callable[[str], ResolvedPolicy]
