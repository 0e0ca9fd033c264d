"""``python -m pipeline {ledger,audit,report,redrive}``: the pipeline's command line.

Every command starts its own SparkSession (:func:`pipeline.spark_session.build_session`):
``local[*]`` by default, ``--master URL`` for a cluster, or whatever ``spark-submit`` set up
(``spark-submit pipeline/__main__.py ledger ...``). Results are printed as JSON on stdout;
logs go to stderr. Exit codes: 0 done, 1 the audit found broken chains, 2 bad usage or a job
that could not run (``ledger --every``: as many failed runs in a row as ``--max-failures``).

Times are ISO 8601 with a time zone (``2026-01-31T12:00:00Z``) or ``now``; durations are
``250ms``, ``30s``, ``5m``, ``2h``, ``1d``, ISO 8601 (``PT5M``) or plain seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pipeline.ledger import LedgerJob
    from pipeline.run_log import LedgerRun

from pipeline import __version__

_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_ISO_DURATION = re.compile(
    r"P(?:(?P<d>\d+(?:\.\d+)?)D)?(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?"
    r"(?:(?P<s>\d+(?:\.\d+)?)S)?)?"
)


def duration_ms(text: str) -> int:
    """Milliseconds of ``250ms`` / ``30s`` / ``5m`` / ``2h`` / ``1d`` / ``PT5M`` / ``90``."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?", value)
    if match:
        return round(float(match.group(1)) * _UNITS[match.group(2) or "s"])
    iso = _ISO_DURATION.fullmatch(value.upper())
    if iso and any(iso.groupdict().values()):
        parts = {k: float(v) for k, v in iso.groupdict().items() if v}
        unit = {"d": "d", "h": "h", "m": "m", "s": "s"}
        return round(sum(v * _UNITS[unit[k]] for k, v in parts.items()))
    raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 30s, 5m, PT1H)")


def timestamp(text: str) -> datetime:
    """``now`` or an ISO 8601 time with a time zone."""
    if text.strip().lower() == "now":
        return datetime.now(UTC)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time") from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no time zone: add Z or an offset (runs must be reproducible)"
        )
    return when


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value.strip()


def _config(pairs: Sequence[tuple[str, str]] | None) -> dict[str, Any]:
    from pipeline.source import option_value  # noqa: PLC0415

    return {k: option_value(v) for k, v in pairs or ()}


def _spark_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("spark")
    group.add_argument("--master", help="Spark master URL (default local[*] or spark-submit's)")
    group.add_argument(
        "--conf", type=key_value, action="append", metavar="KEY=VALUE", help="Spark setting"
    )
    group.add_argument("--log-level", default="WARN", help="Spark log level (default WARN)")
    group.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Spark's progress bar on stderr (default: when stderr is a terminal)",
    )
    group.add_argument(
        "--ship-code",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ship pipeline/ and tracker/, C decoder included, to the executors as an archive "
        "(default: on for non-local masters)",
    )


def _kafka_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kafka")
    group.add_argument(
        "--bootstrap",
        default=os.environ.get("KMQ_KAFKA_BOOTSTRAP_SERVERS", "localhost:9092"),
        help="bootstrap servers (default $KMQ_KAFKA_BOOTSTRAP_SERVERS or localhost:9092)",
    )
    group.add_argument(
        "--kafka-config",
        type=key_value,
        action="append",
        metavar="KEY=VALUE",
        help="aiokafka client setting, e.g. security_protocol=SSL (repeatable)",
    )
    group.add_argument(
        "--chunk",
        type=int,
        default=250_000,
        help="offsets per read task, over all partitions (default 250000)",
    )
    group.add_argument(
        "--source",
        choices=["python", "spark"],
        default="python",
        help="python: the built-in data source; spark: Spark's kafka connector (if installed)",
    )
    group.add_argument(
        "--spark-kafka-option",
        type=key_value,
        action="append",
        metavar="KEY=VALUE",
        help="option for Spark's kafka connector, e.g. kafka.security.protocol=SSL",
    )


def _ledger_repeat_args(parser: argparse.ArgumentParser) -> None:
    """What a ledger kept over many runs needs: repeating, and compacting its files."""
    parser.add_argument(
        "--compact-every",
        type=int,
        default=None,
        metavar="RUNS",
        help="compact the ledger's files after this many runs (default 288; 0: never)",
    )
    loop = parser.add_argument_group("repeating (one Spark session, docs/pipeline.md)")
    loop.add_argument(
        "--every",
        type=duration_ms,
        default=None,
        help="run again every INTERVAL until SIGTERM/SIGINT (each run's JSON is one line)",
    )
    loop.add_argument(
        "--runs", type=int, default=None, help="with --every: stop after this many runs"
    )
    loop.add_argument(
        "--max-failures",
        type=int,
        default=None,
        help="with --every: give up after this many failed runs in a row (default 3)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description="kmq Spark pipeline: delivery ledger, audit, analytics report, bulk redrive.",
    )
    parser.add_argument("--version", action="version", version=f"kmq-pipeline {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ledger = commands.add_parser("ledger", help="build or extend the delivery ledger")
    _kafka_args(ledger)
    _spark_args(ledger)
    ledger.add_argument("--output", required=True, help="ledger directory (Spark path)")
    ledger.add_argument(
        "--markers-topic", default=os.environ.get("KMQ_MARKERS_TOPIC", "kmq-markers")
    )
    ledger.add_argument(
        "--dlq-topic",
        action="append",
        help="DLQ topic to read (repeatable; default <topic>.dlq of every topic seen)",
    )
    ledger.add_argument(
        "--no-dlq",
        action="store_true",
        help="read no DLQ topic: a REJECT then counts as dead-lettered unconfirmed",
    )
    ledger.add_argument("--as-of", type=timestamp, default=None, help="judge time (default now)")
    ledger.add_argument(
        "--default-timeout",
        type=duration_ms,
        default=30_000,
        help="lease of a START with timeout 0 (the topic policy; default 30s)",
    )
    ledger.add_argument(
        "--grace", type=duration_ms, default=300_000, help="allowed lateness (default 5m)"
    )
    ledger.add_argument(
        "--stuck-after",
        type=duration_ms,
        default=86_400_000,
        help="overdue longer than this = lost (default 1d)",
    )
    ledger.add_argument(
        "--policy-delay",
        type=duration_ms,
        default=3_600_000,
        help="longest backoff a policy DELAY can mean (default 1h)",
    )
    ledger.add_argument("--from", dest="start", help="start bound for partitions not yet read")
    ledger.add_argument("--to", dest="end", help="end bound (default: the end at the start)")
    _ledger_repeat_args(ledger)
    ledger.set_defaults(func=_cmd_ledger)

    audit = commands.add_parser("audit", help="list broken chains; exit 1 if any")
    _spark_args(audit)
    audit.add_argument("--ledger", required=True, help="ledger directory")
    audit.add_argument("--as-of", type=timestamp, default=None, help="default: the ledger's")
    audit.add_argument("--grace", type=duration_ms, default=None, help="default: the ledger's")
    audit.add_argument("--stuck-after", type=duration_ms, default=None)
    audit.add_argument("--limit", type=int, default=100, help="broken messages printed")
    audit.add_argument("--output", help="directory for audit.json and broken/ (all of them)")
    audit.set_defaults(func=_cmd_audit)

    report = commands.add_parser("report", help="analytics report (JSON + HTML)")
    _spark_args(report)
    report.add_argument("--ledger", required=True, help="ledger directory")
    report.add_argument("--output", required=True, help="directory for report.json/html")
    report.add_argument("--bucket", type=duration_ms, default=None, help="throughput bucket")
    report.add_argument("--top", type=int, default=10, help="DLQ reasons / slowest listed")
    report.set_defaults(func=_cmd_report)

    redrive = commands.add_parser("redrive", help="republish selected dead letters once")
    _kafka_args(redrive)
    _spark_args(redrive)
    redrive.add_argument("--dlq-topic", action="append", required=True, help="repeatable")
    redrive.add_argument("--where", help="Spark SQL filter over the DLQ view (docs/pipeline.md)")
    redrive.add_argument("--target-topic", help="default: each record's original topic")
    redrive.add_argument("--manifest", required=True, help="manifest directory (pyarrow URI)")
    redrive.add_argument("--rate", type=float, default=None, help="records/s for the job")
    redrive.add_argument("--tasks", type=int, default=2, help="parallel producing tasks")
    redrive.add_argument("--dry-run", action="store_true", help="only count")
    redrive.add_argument("--run-id", help="default: a new one")
    redrive.set_defaults(func=_cmd_redrive)
    return parser


@contextlib.contextmanager
def _session(args: argparse.Namespace) -> Iterator[Any]:
    """The job's SparkSession, stopped afterwards unless it was already running (the command
    was called in-process, e.g. by ``kmq-tracker pipeline`` or a test)."""
    from pyspark.sql import SparkSession  # noqa: PLC0415

    from pipeline.spark_session import build_session  # noqa: PLC0415

    existing = SparkSession.getActiveSession()
    spark = existing or build_session(
        args.master,
        app_name=f"kmq-pipeline-{args.command}",
        conf=dict(args.conf or ()),
        ship_code=args.ship_code,
        log_level=args.log_level,
        progress=args.progress if args.progress is not None else sys.stderr.isatty(),
    )
    try:
        yield spark
    finally:
        if existing is None:
            spark.stop()


def _print(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _cmd_ledger(args: argparse.Namespace) -> int:
    from pipeline.ledger_fold import LedgerError  # noqa: PLC0415

    if args.every is None:
        if args.runs is not None or args.max_failures is not None:
            raise LedgerError("--runs and --max-failures go with --every")
        with _session(args) as spark:
            result, summary = _reported_run(spark, _ledger_job(args))
        _print(result)
        print(summary, file=sys.stderr)
        return 0
    return _ledger_every(args)


def _reported_run(spark: SparkSession, job: LedgerJob) -> tuple[dict[str, Any], str]:
    """Run the ledger job once; returns the run's JSON and its summary for stderr.

    A compaction that followed the run is a run of its own in the log: its record goes into
    the JSON as ``compaction_after`` (null when none ran) and its summary is a second line,
    so each invocation (each ``--every`` tick) prints one JSON value, whose ``run_seq`` and
    the compaction's account for every number in the log. A compaction (or the tidy after
    the run) that failed is ``compaction_failed`` (``{"after_run", "error"}``, else null);
    its warning is the line on stderr, and the run itself still succeeded.
    """
    from pipeline.ledger import run_ledger  # noqa: PLC0415
    from pipeline.ledger_compaction import CompactionFailed  # noqa: PLC0415

    outcome: LedgerRun | CompactionFailed | None = None

    def compacted(what: LedgerRun | CompactionFailed) -> None:
        nonlocal outcome
        outcome = what

    run = run_ledger(spark, job, on_compaction=compacted)
    result = run.to_json()
    failed: CompactionFailed | None = None
    compaction: LedgerRun | None = None
    if isinstance(outcome, CompactionFailed):
        failed = outcome
    else:
        compaction = outcome
    result["compaction_after"] = None if compaction is None else compaction.to_json()
    result["compaction_failed"] = None if failed is None else failed.to_json()
    if compaction is None:
        return result, ledger_summary(run)
    return result, f"{ledger_summary(run)}\n{ledger_summary(compaction)}"


def _ledger_job(args: argparse.Namespace) -> LedgerJob:
    """The job the options describe, judged at ``--as-of`` or now."""
    from pipeline.ledger import LedgerJob  # noqa: PLC0415
    from pipeline.ledger_compaction import COMPACT_EVERY  # noqa: PLC0415
    from pipeline.ledger_fold import LedgerError, LedgerParams  # noqa: PLC0415
    from pipeline.offsets import Bound  # noqa: PLC0415

    params = LedgerParams(
        as_of=args.as_of or datetime.now(UTC),
        default_timeout_ms=args.default_timeout,
        grace_ms=args.grace,
        stuck_after_ms=args.stuck_after,
        policy_delay_ms=args.policy_delay,
        dlq_checked=not args.no_dlq,
    )
    if args.compact_every is not None and args.compact_every < 0:
        raise LedgerError("--compact-every must be 0 (never) or a number of runs")
    end = Bound.parse(args.end) if args.end else None
    if end is None and args.as_of is not None:
        end = Bound.at_time(args.as_of)  # an explicit as-of reads what existed then
    return LedgerJob(
        bootstrap=args.bootstrap,
        markers_topic=args.markers_topic,
        output=args.output,
        params=params,
        dlq_topics=[] if args.no_dlq else args.dlq_topic,
        start=Bound.parse(args.start) if args.start else None,
        end=end,
        chunk=args.chunk,
        client_config=_config(args.kafka_config),
        source=args.source,
        spark_kafka_options=dict(args.spark_kafka_option or ()),
        compact_every=COMPACT_EVERY if args.compact_every is None else args.compact_every,
    )


def _ledger_every(args: argparse.Namespace) -> int:
    """``ledger --every``: runs in one session until stopped (see pipeline.ledger_loop)."""
    from pipeline.ledger_fold import LedgerError  # noqa: PLC0415
    from pipeline.ledger_loop import (  # noqa: PLC0415
        LoopPolicy,
        LoopPolicyError,
        run_every,
        stop_on_signals,
    )

    if args.as_of is not None or args.end is not None:
        raise LedgerError("--every judges each run at its own time: leave out --as-of and --to")
    try:
        policy = LoopPolicy(
            args.every / 1000, args.runs, 3 if args.max_failures is None else args.max_failures
        )
    except LoopPolicyError as wrong:
        option = {"every_s": "--every", "runs": "--runs", "max_failures": "--max-failures"}
        raise LedgerError(f"{option[wrong.field]} {wrong.requirement}") from None
    job = _ledger_job(args)  # what is wrong with the options shows now, not as failed runs
    stop = threading.Event()
    with _session(args) as spark:

        def run_once() -> None:
            now = dataclasses.replace(job.params, as_of=datetime.now(UTC))
            result, summary = _reported_run(spark, dataclasses.replace(job, params=now))
            print(json.dumps(result, default=str), flush=True)
            print(summary, file=sys.stderr, flush=True)

        def failed(error: BaseException, in_a_row: int) -> None:
            print(
                f"pipeline ledger: run failed ({in_a_row} of {policy.max_failures} in a row): "
                f"{type(error).__name__}: {_first_lines(error)}",
                file=sys.stderr,
                flush=True,
            )

        with stop_on_signals(stop):
            outcome = run_every(run_once, policy, stop, on_failure=failed)
    if outcome.gave_up:
        print(
            f"pipeline ledger: giving up after {policy.max_failures} failed runs in a row",
            file=sys.stderr,
        )
        return 2
    return 0


def _first_lines(error: BaseException, count: int = 2) -> str:
    """An error's message without a Java stack trace (a ``Py4JJavaError`` carries one)."""
    lines = [
        line.strip()
        for line in str(error).splitlines()
        if line.strip() and not line.lstrip().startswith(("at ", "..."))
    ]
    return " ".join(lines[:count])


def ledger_summary(run: LedgerRun) -> str:
    """The line a ledger run ends with on stderr (its JSON is on stdout); for a compaction
    run, the line that follows the run's."""
    if run.compaction:
        return (
            f"ledger: compaction {run.run_id} committed in {run.seconds:,.1f} s: "
            f"{run.rows_written:,} rows rewritten"
        )
    rate = f", {run.markers_read / run.seconds:,.0f} markers/s" if run.seconds > 0 else ""
    states = ", ".join(f"{state} {n:,}" for state, n in sorted(run.states_written.items()))
    return (
        f"ledger: run {run.run_id} committed in {run.seconds:,.1f} s{rate}: "
        f"{run.markers_read:,} markers read ({run.invalid_markers:,} refused), "
        f"{run.dlq_records_read:,} dead letters, {run.rows_written:,} rows written"
        + (f" ({states})" if states else "")
    )


def _cmd_audit(args: argparse.Namespace) -> int:
    from pipeline.audit import audit_ledger  # noqa: PLC0415

    with _session(args) as spark:
        result = audit_ledger(
            spark,
            args.ledger,
            as_of=args.as_of,
            grace_ms=args.grace,
            stuck_after_ms=args.stuck_after,
            limit=args.limit,
            output=args.output,
        )
    _print(result.to_json())
    if not result.ok:
        print(
            f"audit: {result.broken_count} of {result.messages} messages have a broken chain",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pipeline.report import build_report, write_report  # noqa: PLC0415

    with _session(args) as spark:
        bucket = max(1, args.bucket // 1000) if args.bucket else None
        report = build_report(spark, args.ledger, bucket_seconds=bucket, top=args.top)
    json_path, html_path = write_report(report, args.output)
    _print({"json": str(json_path), "html": str(html_path), "totals": report["totals"]})
    return 0


def _cmd_redrive(args: argparse.Namespace) -> int:
    from pipeline.bulk_redrive import BulkRedriveJob, run_redrive  # noqa: PLC0415

    job = BulkRedriveJob(
        bootstrap=args.bootstrap,
        dlq_topics=args.dlq_topic,
        manifest=args.manifest,
        where=args.where,
        target_topic=args.target_topic,
        rate=args.rate,
        tasks=args.tasks,
        dry_run=args.dry_run,
        client_config=_config(args.kafka_config),
        chunk=args.chunk,
        run_id=args.run_id,
    )
    with _session(args) as spark:
        result = run_redrive(spark, job)
    _print(result.to_json())
    return 0


_SPARK_MODULES = {"pyspark", "pyarrow", "pandas", "py4j"}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from pipeline.bulk_redrive import RedriveError  # noqa: PLC0415
        from pipeline.ledger_fold import LedgerError  # noqa: PLC0415
        from pipeline.offsets import OffsetsError  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _SPARK_MODULES:
            raise
        print(
            f"pipeline {args.command}: {exc.name} is not installed; "
            "install the Spark extra: pip install 'kmq-tracker[spark]'",
            file=sys.stderr,
        )
        return 2
    try:
        status: int = args.func(args)
    except (LedgerError, OffsetsError, RedriveError) as exc:
        print(f"pipeline {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return status
