"""The schema, as SQLAlchemy models. Alembic migrations (``migrations/``) must match it; a test
compares ``upgrade head`` with these models on SQLite and PostgreSQL.

Times are integer milliseconds since the Unix epoch (UTC): identical on both databases, cheap
to index and compare, and the unit of the marker protocol.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")


def key_text(length: int) -> String:
    """Text in a message's key (group, topic): ordered as bytes on PostgreSQL too (0007).

    The admin listings merge entry rows and the offsets of tracked ranges in Python, and page
    on with a keyset condition in SQL: the two must agree on the order. Python, SQLite and
    PostgreSQL's "C" collation order UTF-8 text by code point; a database created with another
    collation (en_US, ICU) would not, and pages would skip or repeat messages.
    """
    return String(length).with_variant(String(length, collation="C"), "postgresql")


class Base(DeclarativeBase):
    pass


class TrackedMessage(Base):
    """One logical message per consumer group that is not yet done (see domain.entries)."""

    __tablename__ = "tracked_messages"

    group_id: Mapped[str] = mapped_column(key_text(255), primary_key=True)
    origin_topic: Mapped[str] = mapped_column(key_text(249), primary_key=True)
    origin_partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    origin_offset: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    markers_partition: Mapped[int] = mapped_column(Integer, nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    copy_topic: Mapped[str] = mapped_column(String(249), nullable=False)
    copy_partition: Mapped[int] = mapped_column(Integer, nullable=False)
    copy_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    #: deadline or due time; NULL exactly when the entry is lost (so due scans skip it)
    due_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    first_seen_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    updated_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    deferred: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    consumer: Mapped[str] = mapped_column(String(255), nullable=False, server_default=text("''"))
    reason: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    keep_payload: Mapped[bool] = mapped_column(
        Boolean, nullable=False, server_default=text("false")
    )
    claim_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    payload_stored: Mapped[bool] = mapped_column(
        Boolean, nullable=False, server_default=text("false")
    )
    payload_key: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    payload_value: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    payload_headers: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    payload_timestamp_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (
        # The redelivery loop: "what is due next in my partitions".
        Index("ix_tracked_partition_due", "markers_partition", "due_at_ms"),
        # The admin API: filter by state, order by due time, then id (0006: equal due times
        # need no sort); its prefix: what is due now, a topic's next delayed entry.
        Index(
            "ix_tracked_state_due_key",
            "state",
            "due_at_ms",
            "group_id",
            "origin_topic",
            "origin_partition",
            "origin_offset",
        ),
        # Topic statistics: the oldest in-flight message of a topic is one probe (0003).
        Index("ix_tracked_topic_state", "origin_topic", "state", "first_seen_ms"),
        # A topic's messages in id order, and in due order (0005): the admin API's
        # ``?topic=`` listings and the console's topic page read one page of index.
        Index(
            "ix_tracked_topic_key", "origin_topic", "group_id", "origin_partition", "origin_offset"
        ),
        Index(
            "ix_tracked_topic_due",
            "origin_topic",
            "due_at_ms",
            "group_id",
            "origin_partition",
            "origin_offset",
        ),
        # The payload keeper: the entries whose payload is still to be copied (0012; few).
        Index(
            "ix_tracked_payload_wanted",
            "markers_partition",
            sqlite_where=text("keep_payload IS 1 AND payload_stored IS 0"),
            postgresql_where=text("keep_payload IS true AND payload_stored IS false"),
        ),
    )


class TrackedRangeRow(Base):
    """First deliveries in flight together, one row per range (migration 0004).

    Written for v2 RANGE_START markers (see ``tracker/domain/ranges.py``): bit ``i`` of
    ``open_bits`` (little-endian bytes) stands for the in-flight entry of offset
    ``first_offset + i``, with this row's deadline, consumer and times. ``first_offset`` is
    always the lowest open offset and ``last_offset`` the highest; the ranges of a lane
    never share an open offset, and an offset with a row in ``tracked_messages`` is in no
    range.
    """

    __tablename__ = "tracked_ranges"

    group_id: Mapped[str] = mapped_column(key_text(255), primary_key=True)
    origin_topic: Mapped[str] = mapped_column(key_text(249), primary_key=True)
    origin_partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_offset: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    markers_partition: Mapped[int] = mapped_column(Integer, nullable=False)
    open_bits: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    #: how many offsets are open (the bits set): the counters and statistics add it up
    open_count: Mapped[int] = mapped_column(Integer, nullable=False)
    due_at_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    first_seen_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    updated_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    consumer: Mapped[str] = mapped_column(String(255), nullable=False, server_default=text("''"))
    #: the redelivery round republishing the range's offsets (migration 0011): a range is
    #: claimed and recorded as one row, not turned into an entry per offset
    claim_token: Mapped[str | None] = mapped_column(String(64), nullable=True)

    __table_args__ = (
        # The redelivery loop: "which ranges are due in my partitions".
        Index("ix_ranges_partition_due", "markers_partition", "due_at_ms"),
        # Recording a round: "the ranges this round claimed" (few rows are ever claimed).
        Index(
            "ix_ranges_claim_token",
            "claim_token",
            sqlite_where=text("claim_token IS NOT NULL"),
            postgresql_where=text("claim_token IS NOT NULL"),
        ),
        # Ingest: the ranges of a lane that reach a span of offsets.
        Index("ix_ranges_lane_last", "group_id", "origin_topic", "origin_partition", "last_offset"),
        # Topic statistics: the oldest in-flight range of a topic.
        Index("ix_ranges_topic_seen", "origin_topic", "first_seen_ms"),
    )


# -- counters (migration 0003) ---------------------------------------------------------------


class TrackedCount(Base):
    """How many tracked entries there are per markers partition, origin topic, group and state.

    Kept by the ``Store`` in every transaction that writes entries, and recounted for a
    partition when a replica takes it over from an owner that may not have kept them
    (``counted_epoch``, ``tracker/store/counts.py``): the topic
    statistics read these few rows instead of counting a table of millions. Keyed by markers
    partition because every writer of an entry holds that partition's row lock already, so
    replicas never wait on each other's counters. Rows that reach zero stay.
    """

    __tablename__ = "tracked_counts"

    markers_partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    origin_topic: Mapped[str] = mapped_column(String(249), primary_key=True)
    group_id: Mapped[str] = mapped_column(String(255), primary_key=True)  # 0008
    state: Mapped[str] = mapped_column(String(16), primary_key=True)
    entries: Mapped[int] = mapped_column(BigInteger, nullable=False)


class DeadLetterCount(Base):
    """Dead letters per origin topic and group, and how many are not redriven yet (triggers,
    0003; the group since 0008)."""

    __tablename__ = "dead_letter_counts"

    origin_topic: Mapped[str] = mapped_column(String(249), primary_key=True)
    group_id: Mapped[str] = mapped_column(String(255), primary_key=True)  # 0008
    total: Mapped[int] = mapped_column(BigInteger, nullable=False)
    waiting: Mapped[int] = mapped_column(BigInteger, nullable=False)


class MarkersPartition(Base):
    """Per markers partition: who owns it (epoch) and how far its markers are applied."""

    __tablename__ = "markers_partitions"

    markers_topic: Mapped[str] = mapped_column(String(249), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: bumped by every replica that takes the partition over; writes check it (fencing)
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)
    owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    #: the first markers offset not yet applied to this store
    next_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    updated_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    #: the epoch of the last owner that kept ``tracked_counts`` exact from its takeover on
    #: (0010); a takeover at the next epoch need not recount (``tracker/store/counts.py``)
    counted_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class DeadLetter(Base):
    """A message the tracker published to a dead-letter topic."""

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    group_id: Mapped[str] = mapped_column(String(255), nullable=False)
    origin_topic: Mapped[str] = mapped_column(String(249), nullable=False)
    origin_partition: Mapped[int] = mapped_column(Integer, nullable=False)
    origin_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    source_topic: Mapped[str] = mapped_column(String(249), nullable=False)
    source_partition: Mapped[int] = mapped_column(Integer, nullable=False)
    source_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    dlq_topic: Mapped[str] = mapped_column(String(249), nullable=False)
    dlq_partition: Mapped[int] = mapped_column(Integer, nullable=False)
    dlq_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    last_error: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    attempts: Mapped[int] = mapped_column(Integer, nullable=False)
    first_seen_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    dead_lettered_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    message_key: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    redriven_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (
        Index("ix_dead_letters_topic_time", "origin_topic", "dead_lettered_ms"),
        Index(
            "ix_dead_letters_origin",
            "group_id",
            "origin_topic",
            "origin_partition",
            "origin_offset",
        ),
    )


# -- the admin API (migration 0002) ----------------------------------------------------------


class EntryAction(Base):
    """An operator action on one tracked message (audit trail and idempotency record).

    Every request is recorded, including refused ones, with who asked, why, and what came of
    it; a request carrying an ``Idempotency-Key`` is answered from its row when repeated.
    """

    __tablename__ = "entry_actions"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    group_id: Mapped[str] = mapped_column(String(255), nullable=False)
    origin_topic: Mapped[str] = mapped_column(String(249), nullable=False)
    origin_partition: Mapped[int] = mapped_column(Integer, nullable=False)
    origin_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    #: redeliver | ack | extend | dead_letter
    action: Mapped[str] = mapped_column(String(16), nullable=False)
    actor: Mapped[str] = mapped_column(String(255), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    #: the action's parameters as JSON (e.g. the extension), to compare repeated requests
    params: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'{}'"))
    #: applied | unchanged | conflict | not_found
    outcome: Mapped[str] = mapped_column(String(16), nullable=False)
    detail: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    state_before: Mapped[str | None] = mapped_column(String(16), nullable=True)
    state_after: Mapped[str | None] = mapped_column(String(16), nullable=True)
    due_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)

    __table_args__ = (
        Index(
            "ix_entry_actions_entry",
            "group_id",
            "origin_topic",
            "origin_partition",
            "origin_offset",
            "id",
        ),
        # NULLs are distinct on both databases: only keyed requests are unique.
        Index("ux_entry_actions_idempotency", "idempotency_key", unique=True),
    )


class RedriveJob(Base):
    """A request to republish dead letters, and its progress.

    ``owner``/``lease_token``/``lease_until_ms``: the replica running it holds a lease and
    renews it; after a crash another replica takes the job over once the lease ran out.
    ``scan_offsets``: the target partitions' end offsets (JSON) when the current lease began;
    a replica taking over scans from there for records this job produced but did not record.
    """

    __tablename__ = "redrive_jobs"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    #: pending | running | done | cancelled | failed
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    #: the selection as JSON: {"filter": {...}} or {"ids": [...]}
    selection: Mapped[str] = mapped_column(Text, nullable=False)
    #: NULL: each message goes back to its origin topic
    target_topic: Mapped[str | None] = mapped_column(String(249), nullable=True)
    rate: Mapped[float] = mapped_column(Float, nullable=False)
    dry_run: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    total_count: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    done_count: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    skipped_count: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    created_by: Mapped[str] = mapped_column(String(255), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    created_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    updated_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    started_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(
        Boolean, nullable=False, server_default=text("false")
    )
    owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_until_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    scan_offsets: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_error: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)

    __table_args__ = (
        Index("ix_redrive_jobs_state", "state", "lease_until_ms"),
        Index("ux_redrive_jobs_idempotency", "idempotency_key", unique=True),
    )


class RedriveItem(Base):
    """One dead letter of a redrive job.

    States: ``pending`` (not yet taken), ``sending`` (the dead letter is reserved for this job:
    its ``redriven_ms`` is set, the record may be on its way), ``done`` (produced, with where),
    ``skipped`` (already redriven by another job, or its DLQ record is gone: see ``detail``),
    ``cancelled``.
    """

    __tablename__ = "redrive_items"

    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    dead_letter_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    detail: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    target_topic: Mapped[str | None] = mapped_column(String(249), nullable=True)
    produced_partition: Mapped[int | None] = mapped_column(Integer, nullable=True)
    produced_offset: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    updated_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)

    __table_args__ = (Index("ix_redrive_items_state", "job_id", "state", "dead_letter_id"),)


class ConsoleLogout(Base):
    """A console session its operator logged out of: refused until it would have expired
    (see ``tracker/store/console_logouts.py``)."""

    __tablename__ = "console_logouts"

    #: the session's random nonce (in its signed cookie)
    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: when the session would have expired (Unix seconds): the row may go then
    expires_s: Mapped[int] = mapped_column(BigInteger, nullable=False)

    __table_args__ = (Index("ix_console_logouts_expires", "expires_s"),)


class MarkersTopicBinding(Base):
    """The one markers topic this database serves (see ``tracker/store/topic_binding.py``).

    One row at most: ``slot`` is always 1, so two processes that bind a fresh database at
    once cannot both succeed with different topics.
    """

    __tablename__ = "markers_topic_binding"

    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    markers_topic: Mapped[str] = mapped_column(String(249), nullable=False)
    #: when it was bound (Unix ms), and by which tracker replica or API process
    bound_ms: Mapped[int] = mapped_column(BigInteger, nullable=False)
    bound_by: Mapped[str] = mapped_column(String(255), nullable=False)

    __table_args__ = (CheckConstraint("slot = 1", name="ck_markers_topic_binding_one_row"),)
