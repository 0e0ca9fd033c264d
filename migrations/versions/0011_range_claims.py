"""Tracked ranges are claimed by redelivery rounds as ranges.

A round used to turn every due range into one entry row per open offset, claim those rows
and delete them one by one once their copies were out: per-message work for a whole batch of
first deliveries that expired together. ``claim_token`` lets a round claim the range row
itself (one row for up to 65,536 offsets) and delete it when the round is recorded; only
offsets that diverge from the round (lost, retried later) become entries. A new, nullable
column and a partial index on the rows that carry one (a round's own, few at any time); no
table is rewritten.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tracked_ranges", sa.Column("claim_token", sa.String(64), nullable=True))
    op.create_index(
        "ix_ranges_claim_token",
        "tracked_ranges",
        ["claim_token"],
        sqlite_where=sa.text("claim_token IS NOT NULL"),
        postgresql_where=sa.text("claim_token IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_ranges_claim_token", table_name="tracked_ranges")
    with op.batch_alter_table("tracked_ranges") as batch:
        batch.drop_column("claim_token")
