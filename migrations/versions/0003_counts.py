"""Per-topic counters, and an index for the oldest in-flight message.

The topic statistics (admin API ``/v1/topics``, the Prometheus scrape) counted entries with
``GROUP BY origin_topic, state`` over the whole table: 262 ms (SQLite) to 612 ms (PostgreSQL)
at 1M tracked entries, 22-53x the cost at 10k (docs/benchmarks.md, scenario 4). Now counters
are kept next to the rows they count, in the same transaction:

* ``tracked_counts``: entries per (markers partition, origin topic, state), kept by the
  ``Store`` in every transaction that writes entries, and recounted for a partition whenever
  a replica takes the partition over. Not by triggers: this table is the ingest hot path,
  and a row trigger costs ~10 us per row on SQLite (a quarter of unacked ingest's rate).
  Keyed by markers partition because every writer of an entry holds that partition's row
  lock (fencing): replicas never wait on each other's counters, and a takeover recounts
  exactly what the new owner alone will change.
* ``dead_letter_counts``: dead letters per origin topic, and those not redriven yet, kept by
  triggers (dead letters are written at DLQ rates, by several code paths). SQLite gets
  row-level triggers; PostgreSQL statement-level triggers over transition tables, which add
  up a statement's rows and touch each counter row once.

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

# PostgreSQL: one function per event adds up the statement's transition table(s) into one
# delta per topic, in topic order (two transactions then lock counter rows in the same order).
_PG_DELTA = """
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
_PG_ROWS = (
    "SELECT origin_topic, {sign} AS delta,"
    " CASE WHEN redriven_ms IS NULL THEN {sign} ELSE 0 END AS waiting FROM {table}"
)
_TRIGGER_NAMES = [f"dead_letter_counts_{event}" for event in ("insert", "delete", "update")]


def _pg_statements() -> list[str]:
    added = _PG_ROWS.format(sign="1", table="new_rows")
    removed = _PG_ROWS.format(sign="-1", table="old_rows")
    statements: list[str] = []
    for event, rows, transitions in (
        ("INSERT", added, "NEW TABLE AS new_rows"),
        ("DELETE", removed, "OLD TABLE AS old_rows"),
        ("UPDATE", f"{added} UNION ALL {removed}", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
    ):
        name = f"dead_letter_counts_{event.lower()}"
        statements.append(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            f"BEGIN\n{_PG_DELTA.format(rows=rows)};\nRETURN NULL;\nEND\n$$"
        )
        statements.append(
            f"CREATE TRIGGER {name} AFTER {event} ON dead_letters REFERENCING {transitions}"
            f" FOR EACH STATEMENT EXECUTE FUNCTION {name}()"
        )
    return statements


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
    # between the counting and the triggers (SQLite has a single writer anyway). Entries an
    # old replica writes after this are not counted; the new replicas recount each partition
    # when they take it over from the old ones.
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
    for statement in _SQLITE_TRIGGERS if sqlite else _pg_statements():
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
        if sqlite:
            op.execute(f"DROP TRIGGER {name}")
        else:
            op.execute(f"DROP TRIGGER {name} ON dead_letters")
            op.execute(f"DROP FUNCTION {name}()")
    op.drop_table("dead_letter_counts")
    op.drop_table("tracked_counts")
