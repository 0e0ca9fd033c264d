"""The entries whose payload the store must still copy are found by an index, not a scan.

The payload keeper (``tracker/engine/payloads.py``) asks every few seconds, and after every
flush that flagged one, for the entries of its partitions that keep their payload and have
not had it copied yet. Nothing indexed that question: at 1M tracked entries each ask read
the whole table (200 ms on SQLite), and it was asked ~90 times a minute under a steady load.
A partial index on exactly those rows (a handful at any time: a payload is copied within
seconds) answers it in one probe. Writes touch the index only for rows in it.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_tracked_payload_wanted",
        "tracked_messages",
        ["markers_partition"],
        sqlite_where=sa.text("keep_payload IS 1 AND payload_stored IS 0"),
        postgresql_where=sa.text("keep_payload IS true AND payload_stored IS false"),
    )


def downgrade() -> None:
    op.drop_index("ix_tracked_payload_wanted", table_name="tracked_messages")
