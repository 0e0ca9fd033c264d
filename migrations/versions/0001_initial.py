"""Initial schema: tracked messages, markers partitions (ownership + applied offsets),
dead letters.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigIntId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "tracked_messages",
        sa.Column("group_id", sa.String(255), primary_key=True),
        sa.Column("origin_topic", sa.String(249), primary_key=True),
        sa.Column("origin_partition", sa.Integer(), primary_key=True),
        sa.Column("origin_offset", sa.BigInteger(), primary_key=True),
        sa.Column("markers_partition", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("copy_topic", sa.String(249), nullable=False),
        sa.Column("copy_partition", sa.Integer(), nullable=False),
        sa.Column("copy_offset", sa.BigInteger(), nullable=False),
        sa.Column("due_at_ms", sa.BigInteger(), nullable=True),
        sa.Column("first_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("deferred", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("consumer", sa.String(255), nullable=False, server_default=sa.text("''")),
        sa.Column("reason", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("keep_payload", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("claim_token", sa.String(64), nullable=True),
        sa.Column("payload_stored", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("payload_key", sa.LargeBinary(), nullable=True),
        sa.Column("payload_value", sa.LargeBinary(), nullable=True),
        sa.Column("payload_headers", sa.LargeBinary(), nullable=True),
        sa.Column("payload_timestamp_ms", sa.BigInteger(), nullable=True),
    )
    op.create_index(
        "ix_tracked_partition_due", "tracked_messages", ["markers_partition", "due_at_ms"]
    )
    op.create_index("ix_tracked_state_due", "tracked_messages", ["state", "due_at_ms"])
    op.create_index("ix_tracked_topic_state", "tracked_messages", ["origin_topic", "state"])

    op.create_table(
        "markers_partitions",
        sa.Column("markers_topic", sa.String(249), primary_key=True),
        sa.Column("partition", sa.Integer(), primary_key=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
    )

    op.create_table(
        "dead_letters",
        sa.Column("id", BigIntId, primary_key=True, autoincrement=True),
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("origin_topic", sa.String(249), nullable=False),
        sa.Column("origin_partition", sa.Integer(), nullable=False),
        sa.Column("origin_offset", sa.BigInteger(), nullable=False),
        sa.Column("source_topic", sa.String(249), nullable=False),
        sa.Column("source_partition", sa.Integer(), nullable=False),
        sa.Column("source_offset", sa.BigInteger(), nullable=False),
        sa.Column("dlq_topic", sa.String(249), nullable=False),
        sa.Column("dlq_partition", sa.Integer(), nullable=False),
        sa.Column("dlq_offset", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("first_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("dead_lettered_ms", sa.BigInteger(), nullable=False),
        sa.Column("message_key", sa.LargeBinary(), nullable=True),
        sa.Column("redriven_ms", sa.BigInteger(), nullable=True),
    )
    op.create_index(
        "ix_dead_letters_topic_time", "dead_letters", ["origin_topic", "dead_lettered_ms"]
    )
    op.create_index(
        "ix_dead_letters_origin",
        "dead_letters",
        ["group_id", "origin_topic", "origin_partition", "origin_offset"],
    )


def downgrade() -> None:
    op.drop_table("dead_letters")
    op.drop_table("markers_partitions")
    op.drop_index("ix_tracked_topic_state", "tracked_messages")
    op.drop_index("ix_tracked_state_due", "tracked_messages")
    op.drop_index("ix_tracked_partition_due", "tracked_messages")
    op.drop_table("tracked_messages")
