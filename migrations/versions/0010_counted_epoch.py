"""Markers partitions remember whether their counters were kept, so a takeover need not recount.

A replica that takes markers partitions over used to recount their entries (a GROUP BY of
every row of theirs) inside the takeover transaction, because an earlier owner may have been
a version that did not keep ``tracked_counts``. That scan is linear in the rows: ~0.35 us per
row, 10 s of a rebalance at 10M tracked. ``counted_epoch`` is the epoch of the last owner that
kept the counters exact from its takeover on; a replica taking over at epoch ``n`` trusts the
counters when ``counted_epoch`` is ``n - 1`` and recounts otherwise (an owner of an older
version bumps the epoch without setting it). A new, nullable column: every partition recounts
once, at its first takeover after the upgrade; no table is rewritten.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("markers_partitions", sa.Column("counted_epoch", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("markers_partitions") as batch:
        batch.drop_column("counted_epoch")
