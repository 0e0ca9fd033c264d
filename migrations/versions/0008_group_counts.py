"""The counters count per consumer group: a topic two groups consume shows each one's.

``tracked_counts`` (0003) kept entries per (markers partition, origin topic, state), so the
topic statistics and the console's overview added up every group reading a topic: a group
with a thousand messages in flight looked the same as two groups with five hundred each, and
an operator could not tell which consumer was behind. The key gains ``group_id``; the store
keeps it in the same transactions as before (``tracker/store/counts.py``), and the API and the
console show the counts of each group next to the topic's total.

``dead_letter_counts`` (0003, kept by triggers) gains ``group_id`` the same way: its triggers
are created again with the group in their key.

The counters are rebuilt from the rows (entries, and the open offsets of tracked ranges, which
count as in flight) in the upgrade's transaction. A tracker of an earlier version writes the
old key and fails against the new table (its transactions roll back, nothing is lost: its
markers are read again): upgrade while the tracker is stopped or quiet, as with every migration
(docs/operations.md); replicas recount a partition's counters when they take it over anyway.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_FILL = """
INSERT INTO tracked_counts ({columns}, entries)
SELECT {columns}, sum(n) FROM (
    SELECT {columns}, count(*) AS n FROM tracked_messages GROUP BY {columns}
    UNION ALL
    SELECT {range_columns}, sum(open_count) AS n FROM tracked_ranges
    GROUP BY {range_group}
) AS counted
GROUP BY {columns}
HAVING sum(n) <> 0
"""


def _rebuild(*key: str) -> None:
    """Drop ``tracked_counts`` and create it keyed by ``key`` (+ state), filled from the rows."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if not sqlite:
        op.execute("LOCK TABLE tracked_messages, tracked_ranges IN SHARE ROW EXCLUSIVE MODE")
    op.drop_table("tracked_counts")
    op.create_table(
        "tracked_counts",
        sa.Column("markers_partition", sa.Integer(), primary_key=True),
        sa.Column("origin_topic", sa.String(249), primary_key=True),
        *(sa.Column("group_id", sa.String(255), primary_key=True) for _ in key[2:]),
        sa.Column("state", sa.String(16), primary_key=True),
        sa.Column("entries", sa.BigInteger(), nullable=False),
    )
    columns = ", ".join((*key, "state"))
    op.execute(
        _FILL.format(
            columns=columns,
            range_columns=", ".join((*key, "'in_flight' AS state")),
            range_group=", ".join(key),
        )
    )


_TRIGGER_NAMES = [f"dead_letter_counts_{event}" for event in ("insert", "delete", "update")]


def _sqlite_triggers(key: tuple[str, ...]) -> list[str]:
    """Row triggers that keep ``dead_letter_counts`` per ``key`` (as 0003 did per topic)."""
    columns = ", ".join(key)
    new = ", ".join(f"NEW.{c}" for c in key)
    add = f"""
        INSERT INTO dead_letter_counts ({columns}, total, waiting)
        VALUES ({new}, 1, NEW.redriven_ms IS NULL)
        ON CONFLICT ({columns}) DO UPDATE SET
            total = total + 1, waiting = waiting + (NEW.redriven_ms IS NULL);"""
    remove = f"""
        UPDATE dead_letter_counts
        SET total = total - 1, waiting = waiting - (OLD.redriven_ms IS NULL)
        WHERE {" AND ".join(f"{c} = OLD.{c}" for c in key)};"""
    moved = " OR ".join(f"OLD.{c} IS NOT NEW.{c}" for c in key)
    return [
        f"CREATE TRIGGER dead_letter_counts_insert AFTER INSERT ON dead_letters BEGIN{add}\nEND",
        f"CREATE TRIGGER dead_letter_counts_delete AFTER DELETE ON dead_letters BEGIN{remove}\nEND",
        f"CREATE TRIGGER dead_letter_counts_update AFTER UPDATE OF {columns}, redriven_ms"
        f" ON dead_letters WHEN {moved} OR (OLD.redriven_ms IS NULL) IS NOT"
        f" (NEW.redriven_ms IS NULL) BEGIN{remove}{add}\nEND",
    ]


def _pg_triggers(key: tuple[str, ...]) -> list[str]:
    """Statement triggers over transition tables: one delta per ``key``, in key order."""
    columns = ", ".join(key)
    delta = f"""
    INSERT INTO dead_letter_counts ({columns}, total, waiting)
    SELECT {columns}, sum(delta), sum(waiting)
    FROM ({{rows}}) AS changed
    GROUP BY {columns}
    HAVING sum(delta) <> 0 OR sum(waiting) <> 0
    ORDER BY {columns}
    ON CONFLICT ({columns}) DO UPDATE SET
        total = dead_letter_counts.total + EXCLUDED.total,
        waiting = dead_letter_counts.waiting + EXCLUDED.waiting"""
    rows = (
        f"SELECT {columns}, {{sign}} AS delta,"
        " CASE WHEN redriven_ms IS NULL THEN {sign} ELSE 0 END AS waiting FROM {table}"
    )
    added = rows.format(sign="1", table="new_rows")
    removed = rows.format(sign="-1", table="old_rows")
    statements: list[str] = []
    for event, changed, transitions in (
        ("INSERT", added, "NEW TABLE AS new_rows"),
        ("DELETE", removed, "OLD TABLE AS old_rows"),
        ("UPDATE", f"{added} UNION ALL {removed}", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
    ):
        name = f"dead_letter_counts_{event.lower()}"
        statements.append(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            f"BEGIN\n{delta.format(rows=changed)};\nRETURN NULL;\nEND\n$$"
        )
        statements.append(
            f"CREATE TRIGGER {name} AFTER {event} ON dead_letters REFERENCING {transitions}"
            f" FOR EACH STATEMENT EXECUTE FUNCTION {name}()"
        )
    return statements


def _rebuild_dead_letter_counts(*key: str) -> None:
    """Drop ``dead_letter_counts`` and its triggers; create them per ``key``, filled."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if not sqlite:
        op.execute("LOCK TABLE dead_letters IN SHARE ROW EXCLUSIVE MODE")
    for name in _TRIGGER_NAMES:
        if sqlite:
            op.execute(f"DROP TRIGGER {name}")
        else:
            op.execute(f"DROP TRIGGER {name} ON dead_letters")
            op.execute(f"DROP FUNCTION {name}()")
    op.drop_table("dead_letter_counts")
    op.create_table(
        "dead_letter_counts",
        sa.Column("origin_topic", sa.String(249), primary_key=True),
        *(sa.Column("group_id", sa.String(255), primary_key=True) for _ in key[1:]),
        sa.Column("total", sa.BigInteger(), nullable=False),
        sa.Column("waiting", sa.BigInteger(), nullable=False),
    )
    columns = ", ".join(key)
    op.execute(
        f"INSERT INTO dead_letter_counts ({columns}, total, waiting)"
        f" SELECT {columns}, count(*), sum(CASE WHEN redriven_ms IS NULL THEN 1 ELSE 0 END)"
        f" FROM dead_letters GROUP BY {columns}"
    )
    for statement in _sqlite_triggers(key) if sqlite else _pg_triggers(key):
        op.execute(statement)


def upgrade() -> None:
    _rebuild("markers_partition", "origin_topic", "group_id")
    _rebuild_dead_letter_counts("origin_topic", "group_id")


def downgrade() -> None:
    _rebuild("markers_partition", "origin_topic")
    _rebuild_dead_letter_counts("origin_topic")
