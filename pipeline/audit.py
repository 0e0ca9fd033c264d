"""The audit: the independent proof that the tracker loses nothing.

It trusts no tracker state, only the ledger built from Kafka: every logical message that was
started must end acknowledged, dead-lettered, or still be legitimately in flight (what it waits
for is not overdue by more than the grace). Anything else is a *broken chain*: ``stuck``
(overdue, within the ``stuck_after`` horizon) or ``lost`` (overdue beyond it). The audit lists
them and the command exits non-zero when there is one.

Open rows are judged again at the audit's own ``as_of`` (default: the as-of of the ledger's
latest run, so that markers the ledger has not read cannot make a message look overdue), with
the ledger's grace and horizon unless others are given.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pipeline.ledger_fold import BROKEN_STATES, OPEN_STATES, LedgerError, as_utc, open_state
from pipeline.ledger_store import load_ledger
from pipeline.run_log import read_run_log
from tracker.clock import to_millis

#: Columns listed for each broken message.
BROKEN_COLUMNS = [
    "group",
    "topic",
    "partition",
    "offset",
    "state",
    "pending",
    "expected_by",
    "attempts",
    "first_start",
    "last_event",
    "last_reason",
    "markers_partition",
]


@dataclass(slots=True)
class AuditResult:
    as_of: str
    grace_ms: int
    stuck_after_ms: int
    messages: int
    states: dict[str, int]
    broken_count: int
    broken: list[dict[str, Any]] = field(default_factory=list)  #: the first ``limit`` of them
    invalid_markers: int = 0
    orphan_dlq_records: int = 0

    @property
    def ok(self) -> bool:
        return self.broken_count == 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def judged(ledger: DataFrame, as_of: datetime, grace_ms: int, stuck_after_ms: int) -> DataFrame:
    """The ledger with ``state``: the final state, open rows re-judged at ``as_of``."""
    expected = F.unix_millis("expected_by")
    return ledger.withColumn(
        "state",
        F.when(
            F.col("final_state").isin(*OPEN_STATES) & F.col("expected_by").isNotNull(),
            open_state(expected, to_millis(as_of), grace_ms, stuck_after_ms),
        ).otherwise(F.col("final_state")),
    )


def audit_ledger(
    spark: SparkSession,
    root: str,
    *,
    as_of: datetime | None = None,
    grace_ms: int | None = None,
    stuck_after_ms: int | None = None,
    limit: int = 1000,
    output: str | None = None,
) -> AuditResult:
    """Audit the ledger at ``root``; with ``output``, write ``audit.json`` and ``broken/``."""
    runs = read_run_log(spark, root)
    ledger = load_ledger(spark, root, runs)
    if ledger is None or runs.latest is None:
        raise LedgerError(f"no committed ledger at {root}")
    params = runs.latest.params
    as_of = as_of or params.as_of
    grace = params.grace_ms if grace_ms is None else grace_ms
    horizon = params.stuck_after_ms if stuck_after_ms is None else stuck_after_ms
    if horizon < grace:
        raise LedgerError("stuck_after must be at least the grace")
    rows = judged(ledger, as_of, grace, horizon).cache()
    try:
        states = {r["state"]: r["count"] for r in rows.groupBy("state").count().collect()}
        broken = (
            rows.where(F.col("state").isin(*BROKEN_STATES))
            .select(*BROKEN_COLUMNS)
            .orderBy("group", "topic", "partition", "offset")
        )
        listed = [_plain(r.asDict()) for r in broken.limit(limit).collect()]
        if output is not None:
            broken.coalesce(1).write.mode("overwrite").json(f"{output.rstrip('/')}/broken")
    finally:
        rows.unpersist()
    result = AuditResult(
        as_of=as_of.isoformat(),
        grace_ms=grace,
        stuck_after_ms=horizon,
        messages=sum(states.values()),
        states=states,
        broken_count=sum(states.get(s, 0) for s in BROKEN_STATES),
        broken=listed,
        invalid_markers=runs.invalid_markers,
        orphan_dlq_records=runs.orphan_dlq_records,
    )
    if output is not None:
        target = Path(output)
        target.mkdir(parents=True, exist_ok=True)
        (target / "audit.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: as_utc(v).isoformat() if isinstance(v, datetime) else v for k, v in row.items()}
