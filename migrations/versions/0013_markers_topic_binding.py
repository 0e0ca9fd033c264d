"""A database records the one markers topic it serves, and refuses a tracker of another.

The tracked entries are keyed by their markers *partition*, not by the markers topic: two
trackers of different markers topics on one database would each claim and redeliver the other's
due entries, and count them in their metrics. ``markers_topic_binding`` holds the topic this
database serves (``tracker/store/topic_binding.py``); a tracker or API process of another
topic refuses to start. A database that has served exactly one markers topic so far is bound to
it here; one that has served several (already misconfigured) or none is bound by the first
process that starts on it. A new, small table: nothing to rewrite.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    binding = op.create_table(
        "markers_topic_binding",
        sa.Column("slot", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("markers_topic", sa.String(249), nullable=False),
        sa.Column("bound_ms", sa.BigInteger(), nullable=False),
        sa.Column("bound_by", sa.String(255), nullable=False),
        sa.CheckConstraint("slot = 1", name="ck_markers_topic_binding_one_row"),
    )
    served = [
        row[0]
        for row in op.get_bind().execute(
            sa.text("SELECT DISTINCT markers_topic FROM markers_partitions")
        )
    ]
    if len(served) == 1:
        row = {
            "slot": 1,
            "markers_topic": served[0],
            "bound_ms": int(time.time() * 1000),
            "bound_by": "migration 0013",
        }
        op.bulk_insert(binding, [row])


def downgrade() -> None:
    op.drop_table("markers_topic_binding")
