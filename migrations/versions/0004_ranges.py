"""Tracked ranges: in-flight state per fetched batch (protocol v2 range markers).

A v2 RANGE_START puts a whole fetched batch in flight with one marker; the tracker keeps it as
one row of ``tracked_ranges`` (a bitmask of the offsets still in flight, the batch's deadline,
consumer and times) instead of one ``tracked_messages`` row per message. An offset leaves its
range for an ordinary entry only when it diverges (retry, reject, its own extension, an
operator action). See ``tracker/domain/ranges.py`` and docs/architecture.md.

Nothing to migrate: v1 entries stay as they are, and the counters (``tracked_counts``) count
a range's open offsets as in-flight entries from the first range written.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tracked_ranges",
        sa.Column("group_id", sa.String(255), primary_key=True),
        sa.Column("origin_topic", sa.String(249), primary_key=True),
        sa.Column("origin_partition", sa.Integer(), primary_key=True),
        sa.Column("first_offset", sa.BigInteger(), primary_key=True),
        sa.Column("last_offset", sa.BigInteger(), nullable=False),
        sa.Column("markers_partition", sa.Integer(), nullable=False),
        sa.Column("open_bits", sa.LargeBinary(), nullable=False),
        sa.Column("open_count", sa.Integer(), nullable=False),
        sa.Column("due_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("first_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("consumer", sa.String(255), nullable=False, server_default=sa.text("''")),
    )
    op.create_index("ix_ranges_partition_due", "tracked_ranges", ["markers_partition", "due_at_ms"])
    op.create_index(
        "ix_ranges_lane_last",
        "tracked_ranges",
        ["group_id", "origin_topic", "origin_partition", "last_offset"],
    )
    op.create_index("ix_ranges_topic_seen", "tracked_ranges", ["origin_topic", "first_seen_ms"])


def downgrade() -> None:
    op.drop_table("tracked_ranges")
