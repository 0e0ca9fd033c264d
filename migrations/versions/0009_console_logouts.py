"""Console sessions ended by a logout, refused by every replica until they would have expired.

A console session is a signed cookie that any replica with the same tokens accepts; until now a
logout only dropped the browser's copy, and a copy kept elsewhere stayed valid until it expired.
``console_logouts`` holds the nonce of each session logged out, until its expiry
(``tracker/store/console_logouts.py``). A new, empty table: nothing to rewrite, no lock on
the tables the tracker writes.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_logouts",
        sa.Column("nonce", sa.String(64), primary_key=True),
        sa.Column("expires_s", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_console_logouts_expires", "console_logouts", ["expires_s"])


def downgrade() -> None:
    op.drop_index("ix_console_logouts_expires", "console_logouts")
    op.drop_table("console_logouts")
