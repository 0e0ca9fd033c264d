"""Indexes for listing one topic's messages, in id order and in due order.

``GET /v1/messages?topic=...`` and the console's topic page ask for one page of a topic's
tracked messages, in id order (``group_id, origin_topic, origin_partition, origin_offset``)
or in due order (then id order among equal due times). No index served that: the planners took ``ix_tracked_topic_state`` for the
equality and sorted every row of the topic for each page, 1.3 s (SQLite) to 3 s
(PostgreSQL) at 1M tracked (docs/benchmarks.md, scenario 5). With the topic leading, the
rest of each index is the listing's order, so a page reads ``limit`` index entries; the
keyset condition of the next page (``tracker/store/inspection.py``) leaves the topic out, so it
is a range of the same index.

Every write of a tracked entry now keeps two more indexes up to date. An A/B of
``Store.apply`` (1,000 new STARTs + 1,000 ACKs per flush, 200k tracked, same machine, with and
without these two indexes; docs/benchmarks.md, "Topic listings"): SQLite +1-4 % per marker,
PostgreSQL about +25 %, and bulk inserts 15-25 % slower. Only per-message entries pay it:
tracked ranges (protocol v2) are another table. Building them reads the table once
(a few seconds per million tracked entries), and writes to it wait meanwhile: upgrade while
the tracker is stopped or quiet, as with every migration (docs/operations.md).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_tracked_topic_key",
        "tracked_messages",
        ["origin_topic", "group_id", "origin_partition", "origin_offset"],
    )
    op.create_index(
        "ix_tracked_topic_due",
        "tracked_messages",
        ["origin_topic", "due_at_ms", "group_id", "origin_partition", "origin_offset"],
    )


def downgrade() -> None:
    op.drop_index("ix_tracked_topic_due", "tracked_messages")
    op.drop_index("ix_tracked_topic_key", "tracked_messages")
