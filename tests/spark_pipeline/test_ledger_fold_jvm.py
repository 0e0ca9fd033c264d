"""The JVM ledger fold gives exactly the rows of the Spark SQL one.

``build_ledger`` folds each message's markers in one pass over the sorted rows in Java
(pipeline/jvm/LedgerFold.java) where the session has the pipeline's jar, and with Spark SQL
aggregations otherwise. The two are separate implementations of one definition
(docs/pipeline.md, "Definitions"), so the tests here build the same ledger both ways from
generated markers and dead letters that reach every rule: several attempts (with gaps), STARTs
out of timestamp order, leases from the START's timeout, the policy's default and EXTENDs (or
none), first outcomes among several, deferred and policy delays, empty and missing reasons and
consumers, nulls where the columns allow them (key parts, attempts, timestamps, positions), a
message's markers on two markers partitions, refused records, duplicate dead letters (decided
by time, by record, or only by reason and attempts) and dead letters of messages with no
marker; with and without DLQ topics read.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from pipeline.ledger_fold import LedgerError, LedgerParams, build_ledger, jvm_fold_class
from pipeline.record_schemas import spark_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = [pytest.mark.integration]

BASE = datetime(2026, 12, 1, tzinfo=UTC)
KINDS = ("START", "START", "EXTEND", "ACK", "DELAY", "REJECT")


def _key(rng: random.Random, n: int) -> tuple[Any, ...]:
    """A message key; one in fifty has a null part (no decoder makes one; the columns allow it)."""
    key = [rng.choice(["g1", "g2"]), rng.choice(["orders", "payments"]), n % 3, 1000 + n]
    if rng.random() < 0.02:
        key[rng.randrange(4)] = None
    return tuple(key)


def _markers(rng: random.Random, messages: int) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """Decoded marker rows (the ``markers`` format) and the keys they are about."""
    rows: list[tuple[Any, ...]] = []
    next_offset = 0  # unique positions: ties in write order are arbitrary in both folds
    keys = []
    for n in range(messages):
        key = _key(rng, n)
        keys.append(key)
        attempts: list[int | None] = [*sorted(rng.sample(range(1, 6), rng.randint(1, 3)))]
        if rng.random() < 0.03:
            attempts.append(None)  # not from the decoder, but the column allows it
        for attempt in attempts:
            for _ in range(rng.randint(1, 5)):
                next_offset += 1
                # A message's markers share a markers partition, but the fold must not
                # count on it: now and then one is elsewhere, or has no partition at all.
                markers_partition = rng.choice([(n * 7) % 3] * 18 + [(n * 7 + 1) % 3, None])
                at = BASE + timedelta(milliseconds=rng.randint(0, 10_000))  # not write order
                rows.append(
                    (
                        markers_partition,
                        next_offset,
                        at if rng.random() > 0.01 else None,
                        rng.choice(KINDS),
                        key[0],
                        key[1] if attempt in (None, 1) else f"{key[1]}.copy",
                        rng.randint(0, 2),
                        rng.randint(0, 50_000),
                        attempt,
                        key[1],
                        key[2],
                        key[3],
                        rng.choice([0, 0, 5_000, 60_000, None]),
                        rng.choice([None, 0, 1_000, 90_000]),
                        rng.choice([None, True, False, False]),
                        rng.choice([None, True, False, False]),
                        rng.choice(["", "c-1", "c-2", "ç-3", None]),
                        rng.choice(["", "", "boom", "Ünïcode 😀", None]),
                        None,
                    )
                )
    for i in range(messages // 20):  # refused records: every marker field null but error
        rows.append(
            (0, 10_000_000 + i, BASE, *([None] * 15), "truncated marker (3 bytes, expected 19)")
        )
    rng.shuffle(rows)
    return rows, keys


def _dead_letters(rng: random.Random, keys: list[Any]) -> list[tuple[Any, ...]]:
    """DLQ rows (the ``dlq`` format): none, one or more per message, some for unknown ones.

    Duplicates of one message differ in their time, their record, or (same time and record)
    only in their reason and attempts: the first by all of them is the one a row shows.
    """
    rows: list[tuple[Any, ...]] = []
    wanted = [k for k in keys if rng.random() < 0.3]
    wanted += [("g1", "orders", 0, 99_000 + i) for i in range(5)]  # no marker names these
    for i, key in enumerate(wanted):
        at = BASE + timedelta(milliseconds=rng.choice([20_000, 30_000]))
        record = (f"{key[1]}.dlq", 0, i)
        for _ in range(rng.choice([1, 1, 2, 3])):
            if rng.random() < 0.5:
                at = BASE + timedelta(milliseconds=rng.choice([20_000, 30_000]))
                record = (f"{key[1]}.dlq", rng.randint(0, 1), rng.randint(0, 3))
            rows.append(
                (
                    *record,
                    at if rng.random() > 0.05 else None,
                    None,
                    b"v",
                    [],
                    key[0],
                    key[1],
                    key[2],
                    key[3],
                    rng.choice(["rejected", "", "boom", None]),
                    rng.choice([1, 3, None]),
                    None,
                    rng.choice([at, at, None]),
                    None,
                    "tracker",
                    None,
                )
            )
    rows.append(("orders.dlq", 0, 9_999, BASE, None, b"v", [], *([None] * 10), "no kmq-origin"))
    return rows


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _ledger(
    markers: DataFrame, dlq: DataFrame | None, params: LedgerParams, fold: str
) -> list[Any]:
    rows = build_ledger(markers, dlq, params, fold=fold).collect()
    return sorted((_freeze(tuple(r)) for r in rows), key=repr)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_both_folds_give_the_same_ledger(spark: SparkSession, seed: int) -> None:
    # Not skipped without the jar: the pipeline's tests need a JDK compiler (docs/testing.md).
    if jvm_fold_class(spark) is None:
        pytest.fail("the JVM fold is not on the test session's classpath (no JDK compiler?)")
    rng = random.Random(seed)
    marker_rows, keys = _markers(rng, 400)
    markers = spark.createDataFrame(marker_rows, spark_schema("markers"))
    dlq = spark.createDataFrame(_dead_letters(rng, keys), spark_schema("dlq"))
    states: set[str] = set()
    # Judged soon after the markers (in flight), later (stuck) and days later (lost).
    for frame, dlq_checked, minutes in ((dlq, True, 1), (None, True, 10), (None, False, 2_000)):
        params = LedgerParams(
            as_of=BASE + timedelta(minutes=minutes),
            default_timeout_ms=7_000,
            dlq_checked=dlq_checked,
        )
        in_sql = _ledger(markers, frame, params, "sql")
        in_jvm = _ledger(markers, frame, params, "jvm")
        assert len(in_jvm) == len(in_sql) == len(set(keys))
        for mine, theirs in zip(in_jvm, in_sql, strict=True):
            assert mine == theirs
        states |= {row[10] for row in in_sql}
    # The corpus reaches every final state and every end of an attempt.
    assert states == {"acked", "dead_lettered", "in_flight", "stuck", "lost"}
    history = [attempt for row in in_sql for attempt in row[-2]]
    assert {"acked", "retried", "rejected", "timed_out", "open"} <= {a[9] for a in history}


def test_an_unknown_fold_is_refused(spark: SparkSession) -> None:
    markers = spark.createDataFrame([], spark_schema("markers"))
    with pytest.raises(ValueError, match="unknown fold 'c'"):
        build_ledger(markers, None, LedgerParams(as_of=BASE), fold="c")


def test_asking_for_the_jvm_fold_without_its_class_says_so(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pipeline.ledger_fold.jvm_fold_class", lambda _spark: None)
    markers = spark.createDataFrame([], spark_schema("markers"))
    with pytest.raises(LedgerError, match="not on this session's classpath"):
        build_ledger(markers, None, LedgerParams(as_of=BASE), fold="jvm")
    # "auto" folds with Spark SQL instead.
    assert build_ledger(markers, None, LedgerParams(as_of=BASE)).count() == 0
