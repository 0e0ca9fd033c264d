"""Per-topic counters kept by the database, and an index for the oldest in-flight message.

The topic statistics (admin API ``/v1/topics``, the Prometheus scrape) counted entries with
``GROUP BY origin_topic, state`` over the whole table: 262 ms (SQLite) to 612 ms (PostgreSQL)
at 1M tracked entries, 22-53x the cost at 10k (docs/benchmarks.md, scenario 4). Now triggers
keep the counts next to the rows they count, in the same transaction, whichever code path
writes them (ingest, claims, redelivery rounds, operator actions, redrives):

* ``tracked_counts``: entries per (markers partition, origin topic, state). Keyed by markers
  partition because every writer of an entry already holds its markers partition's row
  lock (fencing), so on PostgreSQL replicas never wait on each other's counter rows.
* ``dead_letter_counts``: dead letters per origin topic, and those not redriven yet.

SQLite gets row-level triggers (cheap there: they run inside the writing statement).
PostgreSQL gets statement-level triggers over transition tables, which add up a whole
statement's rows and touch each counter row once: a row-level trigger would update the same
counter row thousands of times in one ingest transaction, and every update of a row that the
same transaction already updated walks a longer version chain. The writers on the hot paths
(ingest's upsert and delete, claims, round records) therefore write many rows per statement
on PostgreSQL (``tracker/store/dialects.py``).

``ix_tracked_topic_state`` gains ``first_seen_ms``: the oldest in-flight message of a topic
is then one index probe, where it read every in-flight row of the topic.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_SQLITE_TRIGGERS = [
    # -- tracked_messages -> tracked_counts
    """
    CREATE TRIGGER tracked_counts_insert AFTER INSERT ON tracked_messages
    BEGIN
        INSERT INTO tracked_counts (markers_partition, origin_topic, state, entries)
        VALUES (NEW.markers_partition, NEW.origin_topic, NEW.state, 1)
        ON CONFLICT (markers_partition, origin_topic, state)
        DO UPDATE SET entries = entries + 1;
    END
    """,
    """
    CREATE TRIGGER tracked_counts_delete AFTER DELETE ON tracked_messages
    BEGIN
        UPDATE tracked_counts SET entries = entries - 1
        WHERE markers_partition = OLD.markers_partition
          AND origin_topic = OLD.origin_topic AND state = OLD.state;
    END
    """,
    """
    CREATE TRIGGER tracked_counts_update
    AFTER UPDATE OF markers_partition, origin_topic, state ON tracked_messages
    WHEN OLD.markers_partition IS NOT NEW.markers_partition
      OR OLD.origin_topic IS NOT NEW.origin_topic OR OLD.state IS NOT NEW.state
    BEGIN
        UPDATE tracked_counts SET entries = entries - 1
        WHERE markers_partition = OLD.markers_partition
          AND origin_topic = OLD.origin_topic AND state = OLD.state;
        INSERT INTO tracked_counts (markers_partition, origin_topic, state, entries)
        VALUES (NEW.markers_partition, NEW.origin_topic, NEW.state, 1)
        ON CONFLICT (markers_partition, origin_topic, state)
        DO UPDATE SET entries = entries + 1;
    END
    """,
    # -- dead_letters -> dead_letter_counts
    """
    CREATE TRIGGER dead_letter_counts_insert AFTER INSERT ON dead_letters
    BEGIN
        INSERT INTO dead_letter_counts (origin_topic, total, waiting)
        VALUES (NEW.origin_topic, 1, NEW.redriven_ms IS NULL)
        ON CONFLICT (origin_topic) DO UPDATE SET
            total = total + 1, waiting = waiting + (NEW.redriven_ms IS NULL);
    END
    """,
    """
    CREATE TRIGGER dead_letter_counts_delete AFTER DELETE ON dead_letters
    BEGIN
        UPDATE dead_letter_counts
        SET total = total - 1, waiting = waiting - (OLD.redriven_ms IS NULL)
        WHERE origin_topic = OLD.origin_topic;
    END
    """,
    """
    CREATE TRIGGER dead_letter_counts_update
    AFTER UPDATE OF origin_topic, redriven_ms ON dead_letters
    WHEN OLD.origin_topic IS NOT NEW.origin_topic
      OR (OLD.redriven_ms IS NULL) IS NOT (NEW.redriven_ms IS NULL)
    BEGIN
        UPDATE dead_letter_counts
        SET total = total - 1, waiting = waiting - (OLD.redriven_ms IS NULL)
        WHERE origin_topic = OLD.origin_topic;
        INSERT INTO dead_letter_counts (origin_topic, total, waiting)
        VALUES (NEW.origin_topic, 1, NEW.redriven_ms IS NULL)
        ON CONFLICT (origin_topic) DO UPDATE SET
            total = total + 1, waiting = waiting + (NEW.redriven_ms IS NULL);
    END
    """,
]

# Each PostgreSQL function adds up the statement's transition table(s) into one delta per
# counter row, in key order (two transactions then lock counter rows in the same order).
_PG_TRACKED_DELTA = """
    INSERT INTO tracked_counts (markers_partition, origin_topic, state, entries)
    SELECT markers_partition, origin_topic, state, sum(delta)
    FROM ({rows}) AS changed
    GROUP BY markers_partition, origin_topic, state
    HAVING sum(delta) <> 0
    ORDER BY markers_partition, origin_topic, state
    ON CONFLICT (markers_partition, origin_topic, state)
    DO UPDATE SET entries = tracked_counts.entries + EXCLUDED.entries
"""
_PG_TRACKED_ROWS = "SELECT markers_partition, origin_topic, state, {sign} AS delta FROM {table}"

_PG_DEAD_DELTA = """
    INSERT INTO dead_letter_counts (origin_topic, total, waiting)
    SELECT origin_topic, sum(delta), sum(waiting)
    FROM ({rows}) AS changed
    GROUP BY origin_topic
    HAVING sum(delta) <> 0 OR sum(waiting) <> 0
    ORDER BY origin_topic
    ON CONFLICT (origin_topic) DO UPDATE SET
        total = dead_letter_counts.total + EXCLUDED.total,
        waiting = dead_letter_counts.waiting + EXCLUDED.waiting
"""
_PG_DEAD_ROWS = (
    "SELECT origin_topic, {sign} AS delta,"
    " CASE WHEN redriven_ms IS NULL THEN {sign} ELSE 0 END AS waiting FROM {table}"
)


def _pg_function(name: str, body: str) -> str:
    return (
        f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        f"BEGIN\n{body};\nRETURN NULL;\nEND\n$$"
    )


def _pg_trigger(name: str, table: str, event: str, transitions: str) -> str:
    return (
        f"CREATE TRIGGER {name} AFTER {event} ON {table} REFERENCING {transitions}"
        f" FOR EACH STATEMENT EXECUTE FUNCTION {name}()"
    )


def _pg_statements() -> list[str]:
    statements: list[str] = []
    for table, counts, delta, rows in (
        ("tracked_messages", "tracked_counts", _PG_TRACKED_DELTA, _PG_TRACKED_ROWS),
        ("dead_letters", "dead_letter_counts", _PG_DEAD_DELTA, _PG_DEAD_ROWS),
    ):
        added = rows.format(sign="1", table="new_rows")
        removed = rows.format(sign="-1", table="old_rows")
        for event, union, transitions in (
            ("INSERT", added, "NEW TABLE AS new_rows"),
            ("DELETE", removed, "OLD TABLE AS old_rows"),
            ("UPDATE", f"{added} UNION ALL {removed}", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
        ):
            name = f"{counts}_{event.lower()}"
            statements.append(_pg_function(name, delta.format(rows=union)))
            statements.append(_pg_trigger(name, table, event, transitions))
    return statements


_TRIGGER_NAMES = [
    f"{counts}_{event}"
    for counts in ("tracked_counts", "dead_letter_counts")
    for event in ("insert", "delete", "update")
]


def upgrade() -> None:
    op.create_table(
        "tracked_counts",
        sa.Column("markers_partition", sa.Integer(), primary_key=True),
        sa.Column("origin_topic", sa.String(249), primary_key=True),
        sa.Column("state", sa.String(16), primary_key=True),
        sa.Column("entries", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "dead_letter_counts",
        sa.Column("origin_topic", sa.String(249), primary_key=True),
        sa.Column("total", sa.BigInteger(), nullable=False),
        sa.Column("waiting", sa.BigInteger(), nullable=False),
    )
    # The counts of the rows already there, then the triggers, in one transaction (Alembic
    # runs the upgrade in one on both databases). On PostgreSQL, replicas of the previous
    # version may still be writing: the tables are locked first, so that no row is written
    # between the counting and the triggers (SQLite has a single writer anyway).
    sqlite = op.get_bind().dialect.name == "sqlite"
    if not sqlite:
        op.execute("LOCK TABLE tracked_messages, dead_letters IN SHARE ROW EXCLUSIVE MODE")
    op.execute(
        "INSERT INTO tracked_counts (markers_partition, origin_topic, state, entries)"
        " SELECT markers_partition, origin_topic, state, count(*) FROM tracked_messages"
        " GROUP BY markers_partition, origin_topic, state"
    )
    op.execute(
        "INSERT INTO dead_letter_counts (origin_topic, total, waiting)"
        " SELECT origin_topic, count(*),"
        " sum(CASE WHEN redriven_ms IS NULL THEN 1 ELSE 0 END) FROM dead_letters"
        " GROUP BY origin_topic"
    )
    statements = _SQLITE_TRIGGERS if sqlite else _pg_statements()
    for statement in statements:
        op.execute(statement)

    op.drop_index("ix_tracked_topic_state", "tracked_messages")
    op.create_index(
        "ix_tracked_topic_state", "tracked_messages", ["origin_topic", "state", "first_seen_ms"]
    )


def downgrade() -> None:
    op.drop_index("ix_tracked_topic_state", "tracked_messages")
    op.create_index("ix_tracked_topic_state", "tracked_messages", ["origin_topic", "state"])
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name in _TRIGGER_NAMES:
        table = "tracked_messages" if name.startswith("tracked") else "dead_letters"
        if sqlite:
            op.execute(f"DROP TRIGGER {name}")
        else:
            op.execute(f"DROP TRIGGER {name} ON {table}")
            op.execute(f"DROP FUNCTION {name}()")
    op.drop_table("dead_letter_counts")
    op.drop_table("tracked_counts")
