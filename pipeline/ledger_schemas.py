"""The ledger's row schemas, declared.

They were derived by planning: ``build_ledger`` on empty frames for the stored rows' schema, and
the Spark SQL fold's plan for the schema the JVM fold is handed. Spark's analysis of those
plans took 0.3-0.9 s of the driver's time on each call (warm and cold, 2026-12-02), and a run
of the ledger job made two or three such calls before any data moved, every reader of the
ledger (audit, report, redrive) one. Declared, they cost nothing;
``tests/spark_pipeline/test_ledger_schemas.py`` holds them equal to what the plans derive, so
a change to a fold that changes its columns fails there.
"""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DateType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

_STRING = StringType()
_INT = IntegerType()
_LONG = LongType()
_BOOLEAN = BooleanType()
_TIMESTAMP = TimestampType()
_NULLABLE = True
_NOT_NULL = False


def _struct(*fields: tuple[str, DataType, bool]) -> StructType:
    return StructType([StructField(name, kind, nullable) for name, kind, nullable in fields])


#: One attempt in a row's ``history``, sorted by attempt.
ATTEMPT_SCHEMA = _struct(
    ("attempt", _INT, _NULLABLE),
    ("topic", _STRING, _NULLABLE),
    ("partition", _INT, _NULLABLE),
    ("offset", _LONG, _NULLABLE),
    ("consumer", _STRING, _NULLABLE),
    ("started_at", _TIMESTAMP, _NULLABLE),
    ("deadline_at", _TIMESTAMP, _NULLABLE),
    ("starts", _INT, _NOT_NULL),
    ("extends", _INT, _NOT_NULL),
    ("outcome", _STRING, _NOT_NULL),
    ("outcome_at", _TIMESTAMP, _NULLABLE),
    ("processing_ms", _LONG, _NULLABLE),
    ("delay_ms", _LONG, _NULLABLE),
    ("policy_delay", _BOOLEAN, _NOT_NULL),
    ("reason", _STRING, _NULLABLE),
    ("deferred_until", _TIMESTAMP, _NULLABLE),
)

_HISTORY = ArrayType(ATTEMPT_SCHEMA, containsNull=False)

#: What a fold makes of one message before it is judged (``ledger_fold._ledger_rows``): its
#: key, first and last times, attempts with their history, the latest attempt's outcome, the
#: sums, and its first dead letter. The JVM fold (pipeline/jvm/LedgerFold.java) is handed it.
FOLDED_SCHEMA = _struct(
    ("group", _STRING, _NULLABLE),
    ("origin_topic", _STRING, _NULLABLE),
    ("origin_partition", _INT, _NULLABLE),
    ("origin_offset", _LONG, _NULLABLE),
    ("markers_partition", _INT, _NULLABLE),
    ("first_seen_ms", _LONG, _NULLABLE),
    ("last_marker_ms", _LONG, _NULLABLE),
    ("first_start_ms", _LONG, _NULLABLE),
    ("attempts", _INT, _NULLABLE),
    ("deliveries", _INT, _NULLABLE),
    ("history", _HISTORY, _NOT_NULL),
    (
        "latest",
        _struct(
            ("kind", _STRING, _NULLABLE),
            ("outcome_ms", _LONG, _NULLABLE),
            ("delay_ms", _LONG, _NULLABLE),
            ("policy_delay", _BOOLEAN, _NULLABLE),
            ("deadline_ms", _LONG, _NULLABLE),
            ("deferred_due_ms", _LONG, _NULLABLE),
            ("started_ms", _LONG, _NULLABLE),
            ("processing_ms", _LONG, _NULLABLE),
        ),
        _NULLABLE,
    ),
    ("total_processing_ms", _LONG, _NULLABLE),
    ("total_delay_ms", _LONG, _NULLABLE),
    ("last_reason", _STRING, _NULLABLE),
    # The SQL fold: null where no dead letter names the message (a left join), 0 when none
    # were read; the JVM fold: 0. The final judgment (ledger_fold._ledger_rows) makes both 0.
    ("dlq_records", _INT, _NULLABLE),
    (
        "dlq",
        _struct(
            ("at_ms", _LONG, _NULLABLE),
            ("dlq_topic", _STRING, _NULLABLE),
            ("dlq_partition", _INT, _NULLABLE),
            ("dlq_offset", _LONG, _NULLABLE),
            ("reason", _STRING, _NULLABLE),
            ("attempts", _INT, _NULLABLE),
        ),
        _NULLABLE,
    ),
)

#: A ledger row as ``build_ledger`` makes it (docs/pipeline.md names the columns).
LEDGER_SCHEMA = _struct(
    ("group", _STRING, _NULLABLE),
    ("topic", _STRING, _NULLABLE),
    ("partition", _INT, _NULLABLE),
    ("offset", _LONG, _NULLABLE),
    ("markers_partition", _INT, _NULLABLE),
    ("first_seen", _TIMESTAMP, _NULLABLE),
    ("first_start", _TIMESTAMP, _NULLABLE),
    ("last_event", _TIMESTAMP, _NULLABLE),
    ("attempts", _INT, _NULLABLE),
    ("deliveries", _INT, _NULLABLE),
    ("final_state", _STRING, _NOT_NULL),
    ("pending", _STRING, _NULLABLE),
    ("expected_by", _TIMESTAMP, _NULLABLE),
    ("settled_at", _TIMESTAMP, _NULLABLE),
    ("end_to_end_ms", _LONG, _NULLABLE),
    ("total_processing_ms", _LONG, _NULLABLE),
    ("final_processing_ms", _LONG, _NULLABLE),
    ("total_delay_ms", _LONG, _NULLABLE),
    ("last_reason", _STRING, _NULLABLE),
    ("dlq_topic", _STRING, _NULLABLE),
    ("dlq_partition", _INT, _NULLABLE),
    ("dlq_offset", _LONG, _NULLABLE),
    ("dlq_reason", _STRING, _NULLABLE),
    ("dlq_attempts", _INT, _NULLABLE),
    ("dead_lettered_at", _TIMESTAMP, _NULLABLE),
    ("dlq_records", _INT, _NOT_NULL),
    ("markers_after_dlq", _BOOLEAN, _NOT_NULL),
    ("history", _HISTORY, _NOT_NULL),
    ("date", DateType(), _NULLABLE),
)

#: The stored column with a row's content fingerprint (``ledger_fold.fingerprint``): the next
#: run compares against it without reading the row's other columns (null in rows written
#: before it existed).
CONTENT_HASH = "content_hash"

#: Ledger rows as stored: the built columns plus the run that wrote them.
STORED_SCHEMA = StructType(
    [
        *LEDGER_SCHEMA.fields,
        StructField("run_seq", _INT, _NULLABLE),
        StructField("run_id", _STRING, _NULLABLE),
        StructField("as_of", _TIMESTAMP, _NULLABLE),
        StructField(CONTENT_HASH, _LONG, _NULLABLE),
    ]
)
