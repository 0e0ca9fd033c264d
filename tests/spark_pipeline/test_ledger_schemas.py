"""The ledger's declared schemas are the ones its plans make.

``pipeline/ledger_schemas.py`` declares them so that neither a run nor a reader of the ledger
plans a fold to learn a schema. A change to a fold that adds, drops, renames or retypes a
column fails here until the declaration follows it. (The columns a run stores are compared
with ``STORED_SCHEMA`` in ``test_pipeline_ledger.py``, on rows a real run wrote.)
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pytest

from pipeline.ledger_fold import LedgerParams, _per_key_sql, build_ledger
from pipeline.ledger_schemas import FOLDED_SCHEMA, LEDGER_SCHEMA
from pipeline.record_schemas import spark_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = [pytest.mark.integration]

PARAMS = LedgerParams(as_of=datetime(2026, 12, 3, tzinfo=UTC))


def _inputs(spark: SparkSession, with_dlq: bool) -> tuple[DataFrame, DataFrame | None]:
    markers = spark.createDataFrame([], spark_schema("markers"))
    return markers, spark.createDataFrame([], spark_schema("dlq")) if with_dlq else None


def test_the_sql_fold_makes_the_declared_folded_rows(spark: SparkSession) -> None:
    assert _per_key_sql(*_inputs(spark, True), PARAMS).schema == FOLDED_SCHEMA
    # With no dead letters read, the SQL fold's count is a literal 0 (not nullable); the
    # declaration allows the null a left join leaves, so it holds for both.
    without = _per_key_sql(*_inputs(spark, False), PARAMS).schema
    assert [f.name for f in without] == FOLDED_SCHEMA.names
    for made, declared in zip(without.fields, FOLDED_SCHEMA.fields, strict=True):
        if made.name == "dlq_records":
            assert (made.dataType, made.nullable) == (declared.dataType, False)
        else:
            assert made == declared


@pytest.mark.parametrize("fold", ["sql", "jvm"])
@pytest.mark.parametrize("with_dlq", [True, False], ids=["dlq", "no-dlq"])
def test_both_folds_make_the_declared_ledger_rows(
    spark: SparkSession, fold: str, with_dlq: bool
) -> None:
    assert build_ledger(*_inputs(spark, with_dlq), PARAMS, fold=fold).schema == LEDGER_SCHEMA
