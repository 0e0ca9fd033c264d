"""The state/due index carries the listing's whole order, so equal due times need no sort.

``GET /v1/messages?state=in_flight&order=due`` (and the console's due listings) order by due
time, then by id (``group_id, origin_topic, origin_partition, origin_offset``). The index
``ix_tracked_state_due`` (state, due_at_ms) served the first part only: the planners then
sorted every entry sharing a due time with the page's rows. Entries STARTed together share
one: a v1 client writes a fetched batch's STARTs with one timestamp, and the bench seeds
20,000 at a time, where a page took 18-21 ms on SQLite in the sort alone (docs/benchmarks.md,
change 30). ``ix_tracked_state_due_key`` (state, due_at_ms, group_id, origin_topic,
origin_partition, origin_offset) replaces it: a page reads ``limit`` index entries (0.5 ms),
and the next page's keyset condition is a range of the same index. The queries that used the
old index (what is due now, a topic's next delayed entry) use its prefix.

The index has as many entries as before, each a few dozen bytes longer; writes keep one
index up to date as before. Building it reads the table once (about a second per million
tracked entries on SQLite): upgrade while the tracker is stopped or quiet, as with every
migration (docs/operations.md).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = ["state", "due_at_ms", "group_id", "origin_topic", "origin_partition", "origin_offset"]


def upgrade() -> None:
    op.create_index("ix_tracked_state_due_key", "tracked_messages", COLUMNS)
    op.drop_index("ix_tracked_state_due", "tracked_messages")


def downgrade() -> None:
    op.create_index("ix_tracked_state_due", "tracked_messages", ["state", "due_at_ms"])
    op.drop_index("ix_tracked_state_due_key", "tracked_messages")
