"""Tracker settings: environment variables (``KMQ_*``), an optional TOML file, validation.

Every setting has a default that works for the embedded mode (local broker + SQLite file).
Durations accept seconds (``30``, ``0.5``) or ISO 8601 (``PT30S``, ``P7D``). Nested settings
use ``__`` in environment variables, e.g. ``KMQ_DEFAULT_POLICY__MAX_ATTEMPTS=8``; per-topic
policy overrides are easiest in the TOML file::

    [topics.orders]
    processing_timeout = 120
    max_attempts = 10

Settings are built once, in the process's factory
(:func:`~tracker.settings_loading.load_settings`), never at import.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from tracker.domain.durations import Duration
from tracker.domain.policy import TopicPolicy, TopicPolicyOverride, topic_name
from tracker.gc_policy import DEFAULT_GEN0_THRESHOLD
from tracker.settings_checks import check_kafka_security

CONFIG_FILE_ENV = "KMQ_CONFIG_FILE"


def _default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class TrackerSettings(BaseSettings):
    """All settings of the tracker process. Environment variables are ``KMQ_<NAME>``."""

    model_config = SettingsConfigDict(
        env_prefix="KMQ_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    kafka_bootstrap_servers: str = Field(
        "localhost:9092", description="Kafka bootstrap servers, comma-separated host:port."
    )
    kafka_client_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra aiokafka client settings (e.g. security_protocol) for every client.",
    )
    kafka_consumer_config: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra aiokafka settings for the tracker's markers consumer only "
            "(e.g. session_timeout_ms, heartbeat_interval_ms, fetch_max_bytes). "
            "fetch_max_wait_ms is 25 unless set here: the tracker acts on a deadline only "
            "once a fetch response shows it has read every marker written before it."
        ),
    )
    kafka_producer_batch_bytes: int = Field(
        256 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description=(
            "Largest record batch the tracker's producer builds (copies, dead letters, parked "
            "markers). A producer sends one batch per partition per request and waits for it, "
            "so a burst to few partitions moves one batch per round trip; keep it below the "
            "topics' max.message.bytes (1 MiB by default)."
        ),
    )
    markers_topic: str = Field("kmq-markers", description="The markers topic consumers write.")
    markers_partitions: int = Field(
        12,
        ge=1,
        le=10_000,
        description="Partitions of the markers topic when the tracker creates it.",
    )
    markers_replication_factor: int | None = Field(
        None,
        ge=1,
        le=16,
        description=(
            "Replication factor of the topics the tracker creates (markers, invalid markers, "
            "dead-letter and retry topics); unset: 3, or the number of brokers if fewer."
        ),
    )
    output_topic_configs: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Topic configs (e.g. retention.ms) of the dead-letter and retry topics the tracker "
            "creates; an existing topic keeps its own."
        ),
    )
    invalid_markers_topic: str | None = Field(
        None, description="Where refused markers are parked; default `<markers_topic>.invalid`."
    )
    tracker_group: str = Field(
        "kmq-tracker", description="Consumer group of the tracker replicas on the markers topic."
    )
    replica_id: str = Field(
        default_factory=_default_replica_id, description="This replica's name (host:pid)."
    )
    database_url: str = Field(
        "sqlite+aiosqlite:///kmq-tracker.db",
        description=(
            "SQLAlchemy async URL: sqlite+aiosqlite:///path or postgresql+asyncpg://... "
            "One database per markers topic: entries are filed by markers partition, so two "
            "deployments with different markers topics must not share one; a tracker or API "
            "refuses a database that serves another markers topic (docs/operations.md)."
        ),
    )
    migrate_on_start: bool = Field(
        False, description="Run the database migrations when the process starts."
    )
    create_topics: bool = Field(
        True,
        description=(
            "Create missing topics: the markers and invalid-markers topics at start, and each "
            "dead-letter or retry topic when first written, with as many partitions as the "
            "topic whose messages it receives."
        ),
    )
    coalesce_window: Duration = Field(
        timedelta(seconds=2),
        description="How long markers wait in memory so that a START and its ACK cancel out.",
    )
    ack_grace: Duration = Field(
        timedelta(milliseconds=500),
        description=(
            "An ACK or EXTEND written before a deadline but reaching the tracker up to this "
            "much later still counts: entries are redelivered no sooner than deadline + grace."
        ),
    )
    ingest_max_records: int = Field(
        5000, ge=1, le=1_000_000, description="Markers fetched per poll."
    )
    max_pending_markers: int = Field(
        200_000, ge=1, description="Markers held in memory before a flush is forced."
    )
    redelivery_batch: int = Field(
        1000, ge=1, le=100_000, description="Due entries republished per round."
    )
    gc_gen0_threshold: int = Field(
        DEFAULT_GEN0_THRESHOLD,
        ge=0,
        le=10_000_000,
        description=(
            "Allocations between two collections of Python's youngest garbage-collector "
            "generation in the tracker process (CPython's default is 700, which made ingest "
            "1.4x slower); 0 leaves Python's setting."
        ),
    )
    read_ahead_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description=(
            "Record data (keys, values, headers) redelivery may hold in memory, read from "
            "Kafka while ack_grace runs after a deadline, so that the copy leaves without "
            "waiting for the read; 0 reads each original when its round runs."
        ),
    )
    claim_lease: Duration = Field(
        timedelta(seconds=60),
        description="How long a replica holds due entries it is republishing before others may.",
    )
    max_idle_sleep: Duration = Field(
        timedelta(seconds=30),
        description="Longest sleep of the redelivery loop when nothing is due (a safety net).",
    )
    allowed_topics: list[str] | None = Field(
        None, description="If set, markers for other topics are refused as invalid."
    )
    default_policy: TopicPolicy = Field(default_factory=TopicPolicy)
    topics: dict[str, TopicPolicyOverride] = Field(
        default_factory=dict, description="Per-topic policy overrides, by topic name."
    )
    http_host: str = Field("127.0.0.1", description="Address the HTTP API listens on.")
    http_port: int = Field(8080, ge=0, le=65535, description="Port of the HTTP API.")
    api_enabled: bool = Field(
        True, description="Serve the admin API and the sidecar marker endpoint from `run`."
    )
    api_token: SecretStr | None = Field(
        None,
        description=(
            "Bearer token of the admin API: required for every mutation (actions, redrive "
            "jobs, sidecar markers) and accepted for reads. Unset: mutations are refused."
        ),
    )
    api_read_token: SecretStr | None = Field(
        None, description="Optional bearer token that may only read (GET endpoints)."
    )
    api_max_body_bytes: int = Field(
        1_048_576,
        ge=1024,
        le=64 * 1_048_576,
        description="Largest request body the API accepts; larger requests get 413.",
    )
    api_cors_origins: list[str] = Field(
        default_factory=list,
        description="Origins allowed to call the API from a browser (CORS); empty: CORS off.",
    )
    api_payload_preview_bytes: int = Field(
        4096,
        ge=0,
        le=1_048_576,
        description="Default size cap of payload previews in the message and DLQ views.",
    )
    api_marker_history_scan: int = Field(
        5000,
        ge=0,
        le=1_000_000,
        description=(
            "How many records back from the end of a markers partition the message view "
            "searches for that message's markers (0: no marker history). The API keeps this "
            "many records of each of the 16 most recently viewed markers partitions in memory "
            "between views."
        ),
    )
    api_kafka_read_timeout: Duration = Field(
        timedelta(seconds=2),
        description=(
            "How long the message and dead-letter views wait for Kafka (payload preview, "
            "marker history) before answering with what the database has; `payload_error` / "
            "`markers_error` then say what could not be read. A read that takes longer is not "
            "cut short: it finishes in the background, and until it does, reads of other "
            "records answer at once (reloading the same view waits for it)."
        ),
    )
    console_enabled: bool = Field(
        True,
        description=(
            "Serve the web console under `/console/` from the API process (same port, same "
            "tokens: operators log in with the admin or the read token)."
        ),
    )
    console_session: Duration = Field(
        timedelta(hours=8),
        description=(
            "How long a console login lasts. The session cookie holds no token: it is signed "
            "with a key derived from the token it was opened with, so rotating that token "
            "ends every session opened with it."
        ),
    )
    redrive_lease: Duration = Field(
        timedelta(seconds=60),
        description=(
            "How long a replica holds a redrive job without renewing before another replica "
            "may take it over (after a crash). Keep it above the Kafka producer's request "
            "timeout (40 s by default), so that no produce of the old owner is still in flight."
        ),
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Least severe log level written."
    )
    log_format: Literal["json", "text"] = Field("text", description="Log line format.")

    # -- Kafka security (every Kafka client the tracker creates; tracker/kafka/client_security.py)
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT",
        description=(
            "How the tracker's Kafka clients connect: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or "
            "SASL_SSL (SASL over TLS)."
        ),
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="SASL mechanism; required with the SASL_* protocols."
    )
    kafka_sasl_username: str | None = Field(
        None, description="SASL user name; required with the SASL_* protocols."
    )
    kafka_sasl_password: SecretStr | None = Field(
        None, description="SASL password (secret); required with the SASL_* protocols."
    )
    kafka_ssl_cafile: str | None = Field(
        None,
        description=(
            "PEM file of the CA(s) that signed the brokers' certificates (SSL, SASL_SSL); "
            "default: the system's trusted CAs."
        ),
    )
    kafka_ssl_certfile: str | None = Field(
        None, description="PEM client certificate (chain) for mutual TLS."
    )
    kafka_ssl_keyfile: str | None = Field(
        None, description="PEM private key of the client certificate; needs kafka_ssl_certfile."
    )
    kafka_ssl_key_password: SecretStr | None = Field(
        None, description="Password of an encrypted kafka_ssl_keyfile (secret)."
    )
    kafka_ssl_check_hostname: bool = Field(
        True,
        description=(
            "Check that a broker's certificate names the host connected to. Turn off only for "
            "brokers addressed by IP with certificates that do not list it."
        ),
    )

    _topics = field_validator("markers_topic", "invalid_markers_topic")(topic_name)

    @field_validator("allowed_topics")
    @classmethod
    def _allowed(cls, value: list[str] | None) -> list[str] | None:
        for topic in value or []:
            topic_name(topic)
        return value

    @field_validator("topics")
    @classmethod
    def _topic_keys(cls, value: dict[str, TopicPolicyOverride]) -> dict[str, TopicPolicyOverride]:
        for topic in value:
            topic_name(topic)
        return value

    @field_validator("database_url")
    @classmethod
    def _database(cls, value: str) -> str:
        if not value.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError(
                "database_url must start with sqlite+aiosqlite:// or postgresql+asyncpg://"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> TrackerSettings:
        if self.coalesce_window < timedelta(0):
            raise ValueError("coalesce_window must not be negative")
        if self.claim_lease <= timedelta(seconds=1):
            raise ValueError("claim_lease must be longer than 1 s")
        if self.invalid_markers_topic == self.markers_topic:
            raise ValueError("invalid_markers_topic must differ from markers_topic")
        for name in ("api_token", "api_read_token"):
            secret = getattr(self, name)
            if secret is not None and len(secret.get_secret_value()) < 8:
                raise ValueError(f"{name} must be at least 8 characters long")
        if (
            self.api_token is not None
            and self.api_read_token is not None
            and self.api_token.get_secret_value() == self.api_read_token.get_secret_value()
        ):
            raise ValueError("api_read_token must differ from api_token")
        if self.redrive_lease <= timedelta(seconds=1):
            raise ValueError("redrive_lease must be longer than 1 s")
        if self.api_kafka_read_timeout <= timedelta(0):
            raise ValueError("api_kafka_read_timeout must be positive")
        if not timedelta(minutes=1) <= self.console_session <= timedelta(days=7):
            raise ValueError("console_session must be between 1 minute and 7 days")
        return self

    @model_validator(mode="after")
    def _check_kafka_security(self) -> TrackerSettings:
        """Kafka security settings that only make sense together (tracker/kafka/client_security)."""
        check_kafka_security(self)
        return self

    @property
    def invalid_topic(self) -> str:
        return self.invalid_markers_topic or f"{self.markers_topic}.invalid"

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    def policy_for(self, topic: str) -> TopicPolicy:
        return self.default_policy.merged(self.topics.get(topic))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: explicit arguments > environment > TOML file (``KMQ_CONFIG_FILE``)."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get(CONFIG_FILE_ENV)
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)
