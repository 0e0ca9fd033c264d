"""How the ledger is folded: the marker history (and the dead letters) of each logical message
into one row, with its attempts and its final state.

A logical message is ``(group, origin topic, origin partition, origin offset)``, the key the
tracker itself uses. Its row says when it was first seen and first started, every attempt
(which copy, which consumer, started, deadline, lease renewals, outcome, processing time,
requested delay, reason), how it ended, and the dead-letter record if there is one.

Final states (``docs/pipeline.md`` has the precise rules):

* ``acked``: the latest attempt was acknowledged;
* ``dead_lettered``: a DLQ record names the message (``kmq-origin`` + ``kmq-group``), or the
  latest attempt was rejected and no DLQ topic was read to confirm it;
* otherwise the message is open and *something* is due at ``expected_by``: the deadline of the
  latest START/EXTEND (``timeout_ms`` 0 means the topic policy: ``default_timeout``), the due
  time of a retry or deferred delivery (policy delays: ``policy_delay`` bound), or the reject
  time (the DLQ record is due). At the ledger's ``as_of`` it is ``in_flight`` while
  ``as_of < expected_by + grace``, ``stuck`` until ``expected_by + stuck_after``, then
  ``lost``. The audit (:mod:`pipeline.audit`) re-evaluates open rows at its own time.

Reading and writing the ledger directory, run by run, is :mod:`pipeline.ledger`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from pipeline.ledger_schemas import FOLDED_SCHEMA
from tracker.clock import to_millis

#: The key of a logical message in marker / DLQ columns.
KEY = ["group", "origin_topic", "origin_partition", "origin_offset"]
#: The same key in the ledger's columns.
LEDGER_KEY = ["group", "topic", "partition", "offset"]

FINAL_STATES = ("acked", "dead_lettered", "in_flight", "stuck", "lost")
OPEN_STATES = ("in_flight", "stuck", "lost")
#: Open states that time still moves (``lost`` is where they end): a run judges these again.
STATES_TIME_MOVES = ("in_flight", "stuck")
BROKEN_STATES = ("stuck", "lost")


class LedgerError(Exception):
    """The ledger job cannot run as asked (bad parameters, a broken ledger directory)."""


@dataclass(frozen=True, slots=True)
class LedgerParams:
    """How open messages are judged. Durations in milliseconds."""

    as_of: datetime
    default_timeout_ms: int = 30_000  #: the lease a START with timeout 0 gets (topic policy)
    grace_ms: int = 300_000  #: tracker + consumer latency allowed after a deadline
    stuck_after_ms: int = 86_400_000  #: past deadline + this, an open message is lost
    policy_delay_ms: int = 3_600_000  #: upper bound of a backoff the consumer left to policy
    dlq_checked: bool = True  #: DLQ topics were read, so a REJECT needs its DLQ record

    def __post_init__(self) -> None:
        if self.as_of.tzinfo is None or self.as_of.utcoffset() is None:
            raise LedgerError("as_of must be timezone-aware")
        if min(self.default_timeout_ms, self.policy_delay_ms) <= 0 or self.grace_ms < 0:
            raise LedgerError("timeouts and delays must be positive, the grace not negative")
        if self.stuck_after_ms < self.grace_ms:
            raise LedgerError("stuck_after must be at least the grace")

    @property
    def as_of_ms(self) -> int:
        return to_millis(self.as_of)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["as_of"] = self.as_of.isoformat()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LedgerParams:
        values = dict(data)
        values["as_of"] = datetime.fromisoformat(values["as_of"])
        return cls(**values)


def as_utc(value: datetime) -> datetime:
    """A timestamp collected from Spark, as an aware UTC datetime.

    PySpark hands ``TimestampType`` values back as naive datetimes in the Python process's
    local time zone; everything the pipeline prints or writes is UTC with an offset.
    """
    if value.tzinfo is None:
        return datetime.fromtimestamp(value.timestamp(), UTC)
    return value.astimezone(UTC)


# --------------------------------------------------------------------------------------------
# Building rows


def open_state(expected_ms: Column, as_of_ms: int, grace_ms: int, stuck_after_ms: int) -> Column:
    """``in_flight`` / ``stuck`` / ``lost`` of an open message due at ``expected_ms``."""
    as_of = F.lit(as_of_ms)
    return (
        F.when(as_of < expected_ms + F.lit(grace_ms), F.lit("in_flight"))
        .when(as_of < expected_ms + F.lit(stuck_after_ms), F.lit("stuck"))
        .otherwise(F.lit("lost"))
    )


def _per_attempt(markers: DataFrame, params: LedgerParams) -> DataFrame:
    """One row per (message, attempt): its START(s), lease, first outcome, deferral."""
    kind = F.col("kind")
    is_start = kind == "START"
    is_extend = kind == "EXTEND"
    is_deferred = (kind == "DELAY") & F.col("deferred")
    is_terminal = kind.isin("ACK", "REJECT") | ((kind == "DELAY") & ~F.col("deferred"))
    lease = F.when(
        is_start,
        F.when(F.col("timeout_ms") > 0, F.col("timeout_ms")).otherwise(
            F.lit(params.default_timeout_ms)
        ),
    ).when(is_extend, F.col("timeout_ms"))
    # One shuffle for both aggregations: rows hashed by message key satisfy the grouping by
    # (message, attempt) here and by message in build_ledger, so Spark sorts once and runs both
    # as streaming sort aggregates (grouped by (key, attempt) first, Spark hashed on all five
    # columns, then shuffled and sorted a second time for the key alone: twice the time).
    valid = markers.where(F.col("error").isNull() & kind.isNotNull()).repartition(*KEY)
    rows = valid.select(
        *KEY,
        "attempt",
        "markers_partition",
        # Markers of one message share a markers partition: its offsets are the write order.
        F.struct("markers_partition", "markers_offset").alias("pos"),
        F.unix_millis("timestamp").alias("ts"),
        is_start.alias("is_start"),
        is_extend.alias("is_extend"),
        is_terminal.alias("is_terminal"),
        is_deferred.alias("is_deferred"),
        lease.alias("lease_ms"),
        F.struct("topic", "partition", "offset").alias("record"),
        "consumer",
        F.struct(
            kind.alias("kind"),
            F.unix_millis("timestamp").alias("ts"),
            F.nullif(F.col("reason"), F.lit("")).alias("reason"),
            F.col("delay_ms"),
            F.col("policy_delay"),
        ).alias("outcome"),
        "delay_ms",
    )
    c = F.col
    grouped = rows.groupBy(*KEY, "attempt").agg(
        F.min("markers_partition").alias("markers_partition"),
        F.min("ts").alias("first_ms"),
        F.max("ts").alias("last_ms"),
        F.min(F.when(c("is_start"), c("ts"))).alias("started_ms"),
        F.count(F.when(c("is_start"), 1)).alias("starts"),
        F.count(F.when(c("is_extend"), 1)).alias("extends"),
        F.max_by(c("ts") + c("lease_ms"), F.when(c("lease_ms").isNotNull(), c("pos"))).alias(
            "deadline_ms"
        ),
        F.min_by(F.struct("record", "consumer"), F.when(c("is_start"), c("pos"))).alias("first"),
        F.min_by("record", "pos").alias("any_record"),
        F.min_by("outcome", F.when(c("is_terminal"), c("pos"))).alias("outcome"),
        F.min_by(c("ts") + c("delay_ms"), F.when(c("is_deferred"), c("pos"))).alias(
            "deferred_due_ms"
        ),
    )
    o = c("outcome")
    processing = F.when(o.isNotNull() & c("started_ms").isNotNull(), o["ts"] - c("started_ms"))
    requested = F.when((o["kind"] == "DELAY") & ~o["policy_delay"], o["delay_ms"])
    record = F.coalesce(c("first.record"), c("any_record"))
    info = F.struct(
        c("attempt"),
        record["topic"].alias("topic"),
        record["partition"].alias("partition"),
        record["offset"].alias("offset"),
        F.nullif(c("first.consumer"), F.lit("")).alias("consumer"),
        F.timestamp_millis("started_ms").alias("started_at"),
        F.timestamp_millis("deadline_ms").alias("deadline_at"),
        c("starts").cast("int").alias("starts"),
        c("extends").cast("int").alias("extends"),
        F.when(o["kind"] == "ACK", F.lit("acked"))
        .when(o["kind"] == "DELAY", F.lit("retried"))
        .when(o["kind"] == "REJECT", F.lit("rejected"))
        .otherwise(F.lit("open"))
        .alias("outcome"),
        F.timestamp_millis(o["ts"]).alias("outcome_at"),
        processing.alias("processing_ms"),
        requested.alias("delay_ms"),
        F.coalesce((o["kind"] == "DELAY") & o["policy_delay"], F.lit(False)).alias("policy_delay"),
        F.when(o["kind"].isin("DELAY", "REJECT"), o["reason"]).alias("reason"),
        F.timestamp_millis("deferred_due_ms").alias("deferred_until"),
    )
    return grouped.select(
        *KEY,
        "attempt",
        "markers_partition",
        "first_ms",
        "last_ms",
        "started_ms",
        "starts",
        "deadline_ms",
        "deferred_due_ms",
        o.alias("outcome"),
        processing.alias("processing_ms"),
        requested.alias("requested_delay_ms"),
        info.alias("info"),
    )


def _dead_letters(dlq: DataFrame) -> DataFrame:
    """One row per message with DLQ records: the first record, and how many there are."""
    at = F.coalesce(F.unix_millis("dead_lettered_at"), F.unix_millis("timestamp"))
    return (
        dlq.where(F.col("error").isNull())
        .select(
            *KEY,
            F.struct(
                at.alias("at_ms"),
                "dlq_topic",
                "dlq_partition",
                "dlq_offset",
                F.col("reason"),
                F.col("attempts"),
            ).alias("dlq"),
        )
        .groupBy(*KEY)
        .agg(F.count("*").cast("int").alias("dlq_records"), F.min("dlq").alias("dlq"))
    )


#: How the fold runs: ``jvm`` walks the sorted markers once in Java (pipeline/jvm/LedgerFold.java),
#: ``sql`` aggregates with Spark SQL; ``auto`` is the first where the session has its class.
FOLDS = ("auto", "jvm", "sql")


def build_ledger(
    markers: DataFrame, dlq: DataFrame | None, params: LedgerParams, *, fold: str = "auto"
) -> DataFrame:
    """The ledger rows of every message in ``markers`` (decoded markers, MARKERS_DDL).

    ``dlq`` (DLQ_DDL) confirms dead letters; records of messages with no marker here are
    ignored (see :func:`count_orphan_dead_letters`). No Python UDF runs: the fold is Spark SQL or,
    where the session has the pipeline's jar, one pass over the sorted markers in the JVM
    (``fold``, see :data:`FOLDS`); both give the same rows.
    """
    if fold not in FOLDS:
        raise ValueError(f"unknown fold {fold!r}; expected one of {list(FOLDS)}")
    fold_class = None if fold == "sql" else jvm_fold_class(markers.sparkSession)
    if fold_class is not None:
        per_key = _per_key_jvm(fold_class, markers, dlq, params)
        return _ledger_rows(per_key, params, timed_out_marked=True)
    if fold == "jvm":
        raise LedgerError("the JVM fold is not on this session's classpath (pipeline/jvm_jar.py)")
    return _ledger_rows(_per_key_sql(markers, dlq, params), params, timed_out_marked=False)


def jvm_fold_class(spark: SparkSession) -> Any | None:
    """The JVM fold's class in ``spark`` (a py4j handle), or ``None`` where the session has
    no JVM of its own (Spark Connect) or not the pipeline's jar."""
    from py4j.java_gateway import JavaClass  # type: ignore[import-untyped]  # noqa: PLC0415

    jvm = getattr(spark, "_jvm", None)
    if jvm is None:
        return None
    found = getattr(jvm, FOLD_CLASS)
    return found if isinstance(found, JavaClass) else None


#: The fold's class (pipeline/jvm/LedgerFold.java).
FOLD_CLASS = "kmq.pipeline.LedgerFold"
#: What the JVM fold makes, as the JSON it is handed (Spark's schema JSON).
_FOLDED_SCHEMA_JSON = FOLDED_SCHEMA.json()


def _fold_input(markers: DataFrame, dlq: DataFrame | None) -> DataFrame:
    """The rows the JVM fold walks: valid markers, and dead letters in the same columns
    (LedgerFold.java names them), so one shuffle brings a message's markers and its dead
    letters together."""
    c = F.col
    rows = markers.where(c("error").isNull() & c("kind").isNotNull()).select(
        *KEY,
        F.lit(0).alias("src"),
        "attempt",
        "markers_partition",
        "markers_offset",
        F.unix_millis("timestamp").alias("ts"),
        "kind",
        "topic",
        "partition",
        "offset",
        "consumer",
        "timeout_ms",
        "delay_ms",
        "policy_delay",
        "deferred",
        "reason",
    )
    if dlq is None:
        return rows
    # A join never matches a null key part (the SQL fold joins its dead letters), while the
    # fold's grouping does: such dead letters name no message. The decoders never make one.
    named = c("error").isNull()
    for column in KEY:
        named &= c(column).isNotNull()
    letters = dlq.where(named).select(
        *KEY,
        F.lit(1).alias("src"),
        c("attempts").alias("attempt"),
        F.lit(None).cast("int").alias("markers_partition"),
        F.lit(None).cast("bigint").alias("markers_offset"),
        F.coalesce(F.unix_millis("dead_lettered_at"), F.unix_millis("timestamp")).alias("ts"),
        F.lit(None).cast("string").alias("kind"),
        c("dlq_topic").alias("topic"),
        c("dlq_partition").alias("partition"),
        c("dlq_offset").alias("offset"),
        F.lit(None).cast("string").alias("consumer"),
        F.lit(None).cast("bigint").alias("timeout_ms"),
        F.lit(None).cast("bigint").alias("delay_ms"),
        F.lit(None).cast("boolean").alias("policy_delay"),
        F.lit(None).cast("boolean").alias("deferred"),
        "reason",
    )
    return rows.unionByName(letters)


def _per_key_jvm(
    fold_class: Any,
    markers: DataFrame,
    dlq: DataFrame | None,
    params: LedgerParams,
) -> DataFrame:
    """:func:`_per_key_sql`'s rows, folded in the JVM (pipeline/jvm/LedgerFold.java), as
    :data:`~pipeline.ledger_schemas.FOLDED_SCHEMA` declares them."""
    from pyspark.sql.classic.dataframe import DataFrame as ClassicDataFrame  # noqa: PLC0415

    rows = _fold_input(markers, dlq)
    folded = fold_class.fold(rows._jdf, _FOLDED_SCHEMA_JSON, params.default_timeout_ms)
    return ClassicDataFrame(folded, markers.sparkSession)


def _per_key_sql(markers: DataFrame, dlq: DataFrame | None, params: LedgerParams) -> DataFrame:
    """One row per message: its attempts folded (first seen, attempts, history, the latest
    attempt's outcome, sums) and its first dead letter, with Spark SQL aggregations."""
    c = F.col
    attempts = _per_attempt(markers, params)
    latest = F.struct(
        c("outcome.kind").alias("kind"),
        c("outcome.ts").alias("outcome_ms"),
        c("outcome.delay_ms").alias("delay_ms"),
        c("outcome.policy_delay").alias("policy_delay"),
        c("deadline_ms"),
        c("deferred_due_ms"),
        c("started_ms"),
        c("processing_ms"),
    )
    per_key = attempts.groupBy(*KEY).agg(
        F.min("markers_partition").alias("markers_partition"),
        F.min("first_ms").alias("first_seen_ms"),
        F.max("last_ms").alias("last_marker_ms"),
        F.min("started_ms").alias("first_start_ms"),
        F.max("attempt").alias("attempts"),
        F.sum("starts").cast("int").alias("deliveries"),
        F.sort_array(F.collect_list("info")).alias("history"),
        F.max_by(latest, "attempt").alias("latest"),
        F.sum("processing_ms").alias("total_processing_ms"),
        F.sum("requested_delay_ms").alias("total_delay_ms"),
        F.max_by(c("outcome.reason"), F.when(c("outcome.reason").isNotNull(), c("attempt"))).alias(
            "last_reason"
        ),
    )
    if dlq is not None:
        per_key = per_key.join(_dead_letters(dlq), KEY, "left")
    else:
        per_key = per_key.withColumn("dlq_records", F.lit(0)).withColumn(
            "dlq",
            F.lit(None).cast(FOLDED_SCHEMA["dlq"].dataType),
        )

    return per_key


def _ledger_rows(per_key: DataFrame, params: LedgerParams, *, timed_out_marked: bool) -> DataFrame:
    """Each message's ledger row from its folded attempts: final state, what is pending and
    when, settlement, the dead letter's columns, the history with timed-out attempts
    (``timed_out_marked``: the fold marked them already, as the JVM one does; a ``transform``
    of every history costs a fifth of the ledger)."""
    c = F.col
    lk = c("latest.kind")
    waiting_for_delivery = (
        lk.isNull() & c("latest.started_ms").isNull() & c("latest.deferred_due_ms").isNotNull()
    )
    delay_for = F.when(c("latest.policy_delay"), F.lit(params.policy_delay_ms)).otherwise(
        c("latest.delay_ms")
    )
    expected_ms = (
        F.when(lk == "REJECT", c("latest.outcome_ms"))
        .when(lk == "DELAY", c("latest.outcome_ms") + delay_for)
        .when(waiting_for_delivery, c("latest.deferred_due_ms"))
        .when(
            lk.isNull(),
            F.coalesce(c("latest.deadline_ms"), c("latest.deferred_due_ms"), c("last_marker_ms")),
        )
    )
    has_dlq = c("dlq").isNotNull()
    state = (
        F.when(has_dlq, F.lit("dead_lettered"))
        .when(lk == "ACK", F.lit("acked"))
        .when((lk == "REJECT") & F.lit(not params.dlq_checked), F.lit("dead_lettered"))
        .otherwise(open_state(expected_ms, params.as_of_ms, params.grace_ms, params.stuck_after_ms))
    )
    is_open = (
        ~has_dlq
        & (lk.isNull() | lk.isin("DELAY", "REJECT"))
        & ~((lk == "REJECT") & F.lit(not params.dlq_checked))
    )
    pending = F.when(
        is_open,
        F.when(lk == "REJECT", F.lit("dead_letter"))
        .when((lk == "DELAY") | waiting_for_delivery, F.lit("redelivery"))
        .otherwise(F.lit("processing")),
    )
    settled_ms = (
        F.when(has_dlq, c("dlq.at_ms"))
        .when(lk == "ACK", c("latest.outcome_ms"))
        .when((lk == "REJECT") & F.lit(not params.dlq_checked), c("latest.outcome_ms"))
    )
    began_ms = F.coalesce(c("first_start_ms"), c("first_seen_ms"))
    history = c("history")
    if not timed_out_marked:
        history = F.transform(
            "history",
            lambda x: x.withField(
                "outcome",
                F.when(
                    (x["outcome"] == "open") & (x["attempt"] < c("attempts")), "timed_out"
                ).otherwise(x["outcome"]),
            ),
        )
    return per_key.select(
        c("group"),
        c("origin_topic").alias("topic"),
        c("origin_partition").alias("partition"),
        c("origin_offset").alias("offset"),
        c("markers_partition"),
        F.timestamp_millis("first_seen_ms").alias("first_seen"),
        F.timestamp_millis("first_start_ms").alias("first_start"),
        F.timestamp_millis(F.greatest(c("last_marker_ms"), c("dlq.at_ms"))).alias("last_event"),
        c("attempts"),
        c("deliveries"),
        state.alias("final_state"),
        pending.alias("pending"),
        F.timestamp_millis(F.when(is_open, expected_ms)).alias("expected_by"),
        F.timestamp_millis(settled_ms).alias("settled_at"),
        (settled_ms - began_ms).alias("end_to_end_ms"),
        c("total_processing_ms"),
        c("latest.processing_ms").alias("final_processing_ms"),
        c("total_delay_ms"),
        c("last_reason"),
        c("dlq.dlq_topic").alias("dlq_topic"),
        c("dlq.dlq_partition").alias("dlq_partition"),
        c("dlq.dlq_offset").alias("dlq_offset"),
        c("dlq.reason").alias("dlq_reason"),
        c("dlq.attempts").alias("dlq_attempts"),
        F.timestamp_millis("dlq.at_ms").alias("dead_lettered_at"),
        F.coalesce(c("dlq_records"), F.lit(0)).alias("dlq_records"),
        F.coalesce(c("last_marker_ms") > c("dlq.at_ms"), F.lit(False)).alias("markers_after_dlq"),
        history.alias("history"),
        F.to_date(F.timestamp_millis("first_seen_ms")).alias("date"),
    )


def fingerprint(ledger: DataFrame, columns: Sequence[str]) -> Column:
    """A hash of a row's content (``columns``, in that order; run bookkeeping excluded).

    Two versions of a message's row with equal fingerprints say the same thing, so an
    incremental run does not write the second one.
    """
    return F.xxhash64(*[ledger[c] for c in columns])


@contextmanager
def materialized(frame: DataFrame) -> Iterator[DataFrame]:
    """``frame`` computed once and kept (in memory, spilling to disk) while the block runs,
    then dropped, also when the block fails (``ledger --every`` keeps its session).

    Kept, its size is known when the queries that use it are planned, so Spark broadcasts it
    where it is small; planned from an aggregation it cannot size, Spark shuffles the other
    side of a join whole before adaptive execution sees how small this one is.
    """
    kept = frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        kept.count()
        yield kept
    finally:
        kept.unpersist()


def count_orphan_dead_letters(dlq: DataFrame, markers: DataFrame) -> int:
    """How many valid DLQ records name a message no valid marker in ``markers`` mentions
    (a message of another group, or one whose markers were never read).

    The dead letters' keys are taken and kept first (:func:`materialized`): they are few
    against the markers (a run's new dead letters against the whole history), so Spark
    broadcasts them and filters the markers as it reads them; asked for the markers' keys
    first, it shuffled every marker's key.
    """
    letters = dlq.where(F.col("error").isNull())
    with materialized(letters.select(*KEY).distinct()) as keys:
        named = markers.where(F.col("error").isNull()).join(keys, KEY, "left_semi")
        return letters.join(named.select(*KEY).distinct(), KEY, "left_anti").count()
