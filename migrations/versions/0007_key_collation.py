"""Message keys (group, topic) compare as bytes on PostgreSQL, whatever the database's collation.

The admin listings (``GET /v1/messages``, the console) merge two tables in one page: entry
rows of ``tracked_messages`` and the open offsets of ``tracked_ranges``, each read in key order
from its index, merged in Python, and the next page starts after the last key with a keyset
condition in SQL. Python orders text by code point, as SQLite does and as PostgreSQL's "C"
collation does; a database created with another collation (``en_US.UTF-8``, ICU) puts
``ab`` before ``aB`` before ``Ac``, the reverse. Then the merge and the keyset condition
disagree, and a page skips or repeats the messages of some topics
(``tests/integration/test_range_store.py``). The key columns of both tables collate as
"C" now: one order everywhere. For identifiers that is also the natural order.

PostgreSQL only (SQLite's default collation is already byte order). Changing the collation of
a ``varchar`` does not rewrite the table, but the indexes on these columns are rebuilt under an
exclusive lock: a few seconds per million tracked entries, reads and writes waiting
meanwhile. Upgrade while the tracker is stopped or quiet (docs/operations.md).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COLUMNS = {
    "tracked_messages": {"group_id": 255, "origin_topic": 249},
    "tracked_ranges": {"group_id": 255, "origin_topic": 249},
}


def _collate(collation: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, columns in COLUMNS.items():
        for column, length in columns.items():
            op.alter_column(
                table,
                column,
                type_=sa.String(length, collation=collation),
                existing_type=sa.String(length),
                existing_nullable=False,
            )


def upgrade() -> None:
    _collate("C")


def downgrade() -> None:
    _collate("default")
