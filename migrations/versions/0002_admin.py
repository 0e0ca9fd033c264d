"""Admin API: operator actions on messages (audit + idempotency), redrive jobs and items.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigIntId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "entry_actions",
        sa.Column("id", BigIntId, primary_key=True, autoincrement=True),
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("origin_topic", sa.String(249), nullable=False),
        sa.Column("origin_partition", sa.Integer(), nullable=False),
        sa.Column("origin_offset", sa.BigInteger(), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("params", sa.Text(), nullable=False, server_default=sa.text("'{}'")),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("state_before", sa.String(16), nullable=True),
        sa.Column("state_after", sa.String(16), nullable=True),
        sa.Column("due_at_ms", sa.BigInteger(), nullable=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
    )
    op.create_index(
        "ix_entry_actions_entry",
        "entry_actions",
        ["group_id", "origin_topic", "origin_partition", "origin_offset", "id"],
    )
    op.create_index(
        "ux_entry_actions_idempotency", "entry_actions", ["idempotency_key"], unique=True
    )

    op.create_table(
        "redrive_jobs",
        sa.Column("id", BigIntId, primary_key=True, autoincrement=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("selection", sa.Text(), nullable=False),
        sa.Column("target_topic", sa.String(249), nullable=True),
        sa.Column("rate", sa.Float(), nullable=False),
        sa.Column("dry_run", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("total_count", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("done_count", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("skipped_count", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.Column("started_ms", sa.BigInteger(), nullable=True),
        sa.Column("finished_ms", sa.BigInteger(), nullable=True),
        sa.Column(
            "cancel_requested", sa.Boolean(), nullable=False, server_default=sa.text("false")
        ),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("lease_token", sa.String(64), nullable=True),
        sa.Column("lease_until_ms", sa.BigInteger(), nullable=True),
        sa.Column("scan_offsets", sa.Text(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
    )
    op.create_index("ix_redrive_jobs_state", "redrive_jobs", ["state", "lease_until_ms"])
    op.create_index(
        "ux_redrive_jobs_idempotency", "redrive_jobs", ["idempotency_key"], unique=True
    )

    op.create_table(
        "redrive_items",
        sa.Column("job_id", sa.BigInteger(), primary_key=True),
        sa.Column("dead_letter_id", sa.BigInteger(), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("target_topic", sa.String(249), nullable=True),
        sa.Column("produced_partition", sa.Integer(), nullable=True),
        sa.Column("produced_offset", sa.BigInteger(), nullable=True),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
    )
    op.create_index(
        "ix_redrive_items_state", "redrive_items", ["job_id", "state", "dead_letter_id"]
    )


def downgrade() -> None:
    op.drop_index("ix_redrive_items_state", "redrive_items")
    op.drop_table("redrive_items")
    op.drop_index("ux_redrive_jobs_idempotency", "redrive_jobs")
    op.drop_index("ix_redrive_jobs_state", "redrive_jobs")
    op.drop_table("redrive_jobs")
    op.drop_index("ux_entry_actions_idempotency", "entry_actions")
    op.drop_index("ix_entry_actions_entry", "entry_actions")
    op.drop_table("entry_actions")
