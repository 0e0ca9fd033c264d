"""End to end: a real workload through a real tracker, then every pipeline job on its history.

Workers (KmqConsumer) ack, retry-then-ack, reject and keep failing messages while an
in-process Tracker (SQLite) redelivers and dead-letters them, so every copy, marker and DLQ
record is the real thing. After the tracker stopped, START markers are written for three
messages nobody will ever settle: the "lost on purpose" ones. The ledger must have exactly
the expected rows, the audit must flag exactly those three, the report must count them, and
a bulk redrive must republish exactly the selected dead letters, once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from integration.engine_support import consumer, tracker_settings
from pyspark.sql import SparkSession
from support.broker import create_topics, run_sync, unique_topic
from support.databases import sqlite_url

from pipeline.audit import audit_ledger
from pipeline.bulk_redrive import BulkRedriveJob, read_manifest, run_redrive
from pipeline.commands import main
from pipeline.ledger import LedgerJob, run_ledger
from pipeline.ledger_fold import LedgerParams
from pipeline.ledger_store import load_ledger
from pipeline.report import build_report, write_report
from pipeline.spark_session import CODE_DIR
from tracker.client import KmqMessage, KmqProducer
from tracker.client.marker_sink import KafkaMarkerSink
from tracker.headers import REDRIVE_RUN, REDRIVE_SOURCE
from tracker.ids import MessageId
from tracker.protocol import Marker
from tracker.runtime import create_tracker

from .standalone import standalone_cluster
from .workload import high_watermarks, read_topic

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PLAN = {"ack": 6, "retry": 3, "reject": 2, "fail": 2}
GHOSTS = 3


@dataclass
class World:
    bootstrap: str
    topic: str
    markers: str
    parked: str  #: where the lost-on-purpose messages sit
    group: str
    ledger: str
    as_of: datetime
    tmp: Path


async def _behave(message: KmqMessage, acks: list[str]) -> None:
    kind = (message.value or b"").decode().split(":")[0]
    if kind == "ack" or (kind == "retry" and message.attempt > 1):
        await message.ack()
        acks.append((message.value or b"").decode())
    elif kind == "retry":
        await message.retry(timedelta(milliseconds=500), reason="busy")
    elif kind == "reject":
        await message.reject(f"poison {message.value.decode() if message.value else ''}")
    else:
        await message.retry(timedelta(milliseconds=300), reason="still failing")


async def _workload(world: World, database_url: str) -> None:
    bootstrap, topic = world.bootstrap, world.topic
    await create_topics(bootstrap, {topic: 2, world.markers: 4, f"{topic}.dlq": 1, world.parked: 1})
    settings = tracker_settings(
        bootstrap,
        database_url,
        world.markers,
        default_policy={"processing_timeout": 5, "max_attempts": 3},
    )
    acks: list[str] = []
    async with create_tracker(settings) as tracker:
        async with KmqProducer(bootstrap) as producer:
            for kind, count in PLAN.items():
                for i in range(count):
                    await producer.send(topic, f"{kind}:{i}".encode(), key=f"{kind}-{i}".encode())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        async with consumer(
            bootstrap, topic, world.group, world.markers, processing_timeout=timedelta(seconds=5)
        ) as worker:
            while True:
                for message in await worker.getmany(timedelta(milliseconds=200)):
                    await _behave(message, acks)
                dead = await tracker.store.list_dead_letters(topic=topic)
                if len(acks) == PLAN["ack"] + PLAN["retry"] and len(dead) == 4:
                    break
                assert loop.time() < deadline, f"workload incomplete: {len(acks)} acks, {dead}"
            await worker.flush()
    # The tracker is gone: these STARTs will never be acted on.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        sink = KafkaMarkerSink(producer, world.markers)
        for i in range(GHOSTS):
            meta = await producer.send_and_wait(world.parked, f"ghost:{i}".encode())
            ghost = MessageId(world.parked, meta.partition, meta.offset)
            await sink.send_all([Marker.start(world.group, ghost, timeout_ms=1000)])
    finally:
        await producer.stop()


@pytest.fixture(scope="module")
def world(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory, spark: SparkSession
) -> World:
    tmp = tmp_path_factory.mktemp("e2e")
    topic = unique_topic("orders")
    w = World(
        bootstrap=kafka_bootstrap,
        topic=topic,
        markers=unique_topic("markers"),
        parked=unique_topic("parked"),
        group=unique_topic("workers"),
        ledger=str(tmp / "ledger"),
        as_of=datetime.now(UTC),
        tmp=tmp,
    )
    run_sync(lambda: _workload(w, sqlite_url(tmp / "tracker.sqlite3")))
    w.as_of = datetime.now(UTC) + timedelta(minutes=10)
    params = LedgerParams(as_of=w.as_of, default_timeout_ms=5000, grace_ms=60_000)
    run_ledger(spark, LedgerJob(kafka_bootstrap, w.markers, w.ledger, params))
    return w


def test_ledger_and_audit_account_for_every_message(world: World, spark: SparkSession) -> None:
    ledger = load_ledger(spark, world.ledger)
    assert ledger is not None
    rows: dict[str, dict[str, Any]] = {}
    for record in ledger.collect():
        assert record["group"] == world.group
        key = f"{record['topic']}/{record['partition']}/{record['offset']}"
        rows[key] = record.asDict(recursive=True)
    assert len(rows) == sum(PLAN.values()) + GHOSTS

    by_kind: dict[str, list[dict[str, Any]]] = {}
    for row in rows.values():
        kind = "ghost" if row["topic"] == world.parked else None
        if kind is None:
            # The first attempt's record is the original; its value says what the worker did.
            kind = _kind_of(world, row)
        by_kind.setdefault(kind, []).append(row)
    assert {k: len(v) for k, v in by_kind.items()} == {**PLAN, "ghost": GHOSTS}

    def outcomes(row: dict[str, Any]) -> tuple[str, ...]:
        return tuple(a["outcome"] for a in row["history"])

    for row in by_kind["ack"]:
        assert (row["final_state"], outcomes(row)) == ("acked", ("acked",))
    for row in by_kind["retry"]:
        assert (row["final_state"], outcomes(row)) == ("acked", ("retried", "acked"))
        assert row["total_delay_ms"] == 500
        assert row["history"][1]["topic"] == world.topic
        assert row["history"][1]["offset"] != row["offset"], "attempt 2 is a redelivered copy"
    for row in by_kind["reject"]:
        assert (row["final_state"], outcomes(row)) == ("dead_lettered", ("rejected",))
        assert row["dlq_reason"].startswith("rejected by the consumer: poison reject:")
        assert row["dlq_topic"] == f"{world.topic}.dlq"
    for row in by_kind["fail"]:
        assert row["final_state"] == "dead_lettered"
        assert outcomes(row) == ("retried", "retried", "retried")
        assert row["dlq_reason"] == "max attempts reached (3 of 3; last: retried)"
        assert row["dlq_attempts"] == 3
    for row in by_kind["ghost"]:
        assert (row["final_state"], row["pending"]) == ("stuck", "processing")

    audit = audit_ledger(spark, world.ledger)
    ghosts = {f"{r['topic']}/{r['partition']}/{r['offset']}" for r in by_kind["ghost"]}
    assert {f"{b['topic']}/{b['partition']}/{b['offset']}" for b in audit.broken} == ghosts
    assert audit.broken_count == GHOSTS
    assert audit.states == {"acked": 9, "dead_lettered": 4, "stuck": GHOSTS}
    lost = audit_ledger(
        spark, world.ledger, as_of=world.as_of + timedelta(hours=2), stuck_after_ms=3_600_000
    )
    assert {b["state"] for b in lost.broken} == {"lost"}
    assert lost.broken_count == GHOSTS


def _kind_of(world: World, row: dict[str, Any]) -> str:
    values = _originals(world)
    return values[(row["partition"], row["offset"])].split(":")[0]


_ORIGINALS: dict[str, dict[tuple[int, int], str]] = {}


def _originals(world: World) -> dict[tuple[int, int], str]:
    if world.topic not in _ORIGINALS:
        records = run_sync(lambda: read_topic(world.bootstrap, world.topic))
        _ORIGINALS[world.topic] = {
            (r.partition, r.offset): (r.value or b"").decode() for r in records
        }
    return _ORIGINALS[world.topic]


def test_report_counts_the_workload(world: World, spark: SparkSession) -> None:
    report = build_report(spark, world.ledger)
    groups = {g["topic"]: g for g in report["groups"]}
    queue = groups[world.topic]
    assert queue["messages"] == 13
    assert queue["states"] == {
        "acked": 9,
        "dead_lettered": 4,
        "in_flight": 0,
        "stuck": 0,
        "lost": 0,
    }
    assert queue["attempts_histogram"] == {"1": 8, "2": 3, "3": 2}
    assert queue["retry_rate"] == round(5 / 13, 6)
    assert queue["dlq_rate"] == round(4 / 13, 6)
    assert queue["latency_ms"]["processing"]["count"] == 9
    assert sum(r["count"] for r in queue["dlq_reasons"]) == 4
    assert groups[world.parked]["states"]["stuck"] == GHOSTS
    assert report["totals"]["messages"] == 13 + GHOSTS
    json_path, html_path = write_report(report, world.tmp / "report")
    assert json_path.stat().st_size > 0
    assert world.topic in html_path.read_text()


def test_bulk_redrive_republishes_the_selection_exactly_once(
    world: World, spark: SparkSession
) -> None:
    dlq = f"{world.topic}.dlq"
    target = unique_topic("redriven")
    run_sync(lambda: create_topics(world.bootstrap, {target: 2}))
    manifest = str(world.tmp / "manifest")
    job = BulkRedriveJob(
        bootstrap=world.bootstrap,
        dlq_topics=[dlq],
        manifest=manifest,
        where="reason LIKE 'rejected by the consumer%' AND header['trace'] IS NULL",
        target_topic=target,
        rate=50.0,
    )
    dry = run_redrive(spark, replace(job, dry_run=True))
    assert (dry.selected, dry.to_produce, dry.produced, dry.per_target) == (2, 2, 0, {target: 2})

    first = run_redrive(spark, job)
    assert (first.produced, first.already_redriven, first.per_target) == (2, 0, {target: 2})
    again = run_redrive(spark, job)
    assert (again.selected, again.already_redriven, again.produced) == (2, 2, 0)

    copies = run_sync(lambda: read_topic(world.bootstrap, target))
    dead = {
        f"{dlq}/{r.partition}/{r.offset}": r
        for r in run_sync(lambda: read_topic(world.bootstrap, dlq))
    }
    assert len(copies) == 2, "republished once, not twice"
    for copy in copies:
        headers = dict(copy.headers)
        source = dead[headers[REDRIVE_SOURCE].decode()]
        assert (copy.key, copy.value) == (source.key, source.value)
        assert (copy.value or b"").startswith(b"reject:")
        assert headers[REDRIVE_RUN].decode() == first.run_id
        assert not any(k.startswith("kmq-dlq-") for k in headers)
    entries = read_manifest(manifest).to_pylist()
    assert sorted((e["dlq_offset"], e["target_topic"]) for e in entries) == sorted(
        (int(k.rsplit("/", 1)[1]), target)
        for k, r in dead.items()
        if (r.value or b"").startswith(b"reject:")
    )

    # Without a target: back to the original topic, to the end of its partitions.
    before = run_sync(lambda: high_watermarks(world.bootstrap, world.topic))
    home = run_redrive(
        spark,
        BulkRedriveJob(
            bootstrap=world.bootstrap,
            dlq_topics=[dlq],
            manifest=manifest,
            where="attempts = 3",
            rate=20.0,
        ),
    )
    assert (home.produced, home.per_target) == (2, {world.topic: 2})
    back = run_sync(lambda: read_topic(world.bootstrap, world.topic, start=before))
    assert sorted((r.value or b"").decode() for r in back) == ["fail:0", "fail:1"]


def test_command_line_jobs_and_exit_codes(
    world: World, spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m pipeline``: called in-process it reuses the running session."""
    out = world.tmp / "cli"
    ledger = str(out / "ledger")
    as_of = world.as_of.isoformat()
    common = ["--bootstrap", world.bootstrap, "--markers-topic", world.markers]
    assert main(["ledger", *common, "--output", ledger, "--as-of", as_of, "--grace", "1m"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["rows_written"] == sum(PLAN.values()) + GHOSTS
    assert run["compaction_after"] is None, "not due: 288 runs by default"
    assert run["dlq_topics"] == [f"{world.topic}.dlq"]

    assert main(["audit", "--ledger", ledger, "--output", str(out / "audit")]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["broken_count"] == GHOSTS
    assert "3 of 16 messages have a broken chain" in captured.err
    earlier = (world.as_of - timedelta(minutes=10)).isoformat()
    assert main(["audit", "--ledger", ledger, "--as-of", earlier]) == 0, "in flight back then"
    capsys.readouterr()

    assert main(["report", "--ledger", ledger, "--output", str(out / "report")]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["messages"] == 16
    assert (out / "report" / "report.html").is_file()

    assert main(["audit", "--ledger", str(out / "nothing")]) == 2
    assert "no committed ledger" in capsys.readouterr().err
    assert spark.range(1).count() == 1, "the shared session is still running"


def test_ledger_every_runs_again_in_the_same_session(
    world: World, spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ledger --every``: each run judged at its own time, one JSON line per run, the next
    run extending the one before, a compaction that followed a run reported with it; bad
    combinations are refused before anything runs."""
    ledger = str(world.tmp / "every")
    common = ["--bootstrap", world.bootstrap, "--markers-topic", world.markers]
    every = ["--every", "1s", "--runs", "2", "--compact-every", "2"]
    assert main(["ledger", *common, "--output", ledger, *every]) == 0
    captured = capsys.readouterr()
    first, second = (json.loads(line) for line in captured.out.splitlines())
    assert first["rows_written"] == sum(PLAN.values()) + GHOSTS
    assert (second["run_seq"], second["markers_read"]) == (first["run_seq"] + 1, 0)
    judged = [datetime.fromisoformat(run["params"]["as_of"]) for run in (first, second)]
    assert judged[1] > judged[0], "each run judged at its own time"
    # --compact-every 2: the second run is followed by a compaction, run 3 in the log.
    assert first["compaction_after"] is None
    compaction = second["compaction_after"]
    assert (compaction["run_seq"], compaction["compaction"]) == (second["run_seq"] + 1, True)
    assert compaction["rows_written"] == first["rows_written"], "each message's latest row"
    assert compaction["offsets"] == second["offsets"]
    lines = captured.err.splitlines()
    assert len([line for line in lines if line.startswith("ledger: run ")]) == 2, captured.err
    assert f"ledger: compaction {compaction['run_id']} committed in " in captured.err
    assert spark.range(1).count() == 1, "the shared session is still running"

    for wrong, why in (
        (["--every", "1s", "--as-of", world.as_of.isoformat()], "leave out --as-of and --to"),
        (["--every", "1s", "--to", "latest"], "leave out --as-of and --to"),
        (["--runs", "2"], "--runs and --max-failures go with --every"),
        (["--max-failures", "2"], "--runs and --max-failures go with --every"),
        (["--every", "1s", "--runs", "0"], "--runs must be at least 1"),
        (["--every", "1s", "--max-failures", "0"], "--max-failures must be at least 1"),
        (["--every", "0s"], "--every must be a positive interval"),
        (["--compact-every", "-1"], "--compact-every must be 0 (never) or a number of runs"),
        (["--every", "1s", "--grace", "2d"], "stuck_after must be at least the grace"),
    ):
        assert main(["ledger", *common, "--output", ledger, *wrong]) == 2, wrong
        assert why in capsys.readouterr().err, wrong


def test_a_failed_compaction_is_in_the_runs_json_as_one_line_not_a_traceback(
    world: World,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A compaction that fails after a run (here with a Py4J-style message that carries a
    Java stack) leaves the run committed and reported; the JSON says what failed (null when
    nothing did), the warning is one line, and the traceback is logged only at DEBUG."""
    from pipeline import ledger_compaction  # noqa: PLC0415

    def full(*_: object, **__: object) -> None:
        raise RuntimeError(
            "An error occurred while calling o57.save.\n"
            ": java.io.IOException: No space left on device\n"
            "\tat org.apache.hadoop.fs.RawLocalFileSystem.write(RawLocalFileSystem.java:1)\n"
        )

    monkeypatch.setattr(ledger_compaction, "compact_ledger", full)
    ledger = world.tmp / "compaction-fails"
    common = ["--bootstrap", world.bootstrap, "--markers-topic", world.markers]
    with caplog.at_level("DEBUG", logger=ledger_compaction.__name__):
        assert main(["ledger", *common, "--output", str(ledger), "--compact-every", "1"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["rows_written"] == sum(PLAN.values()) + GHOSTS, "the run itself committed"
    assert run["compaction_after"] is None
    error = (
        "RuntimeError: An error occurred while calling o57.save. "
        ": java.io.IOException: No space left on device"
    )
    assert run["compaction_failed"] == {"after_run": run["run_seq"], "error": error}
    records = [r for r in caplog.records if r.name == ledger_compaction.__name__]
    warnings = [r for r in records if r.levelname == "WARNING"]
    assert [r.getMessage() for r in warnings] == [
        f"ledger: compaction after run {run['run_seq']} failed (a later run retries): {error}"
    ]
    assert warnings[0].exc_info is None, "one line, no traceback"
    assert any(r.levelname == "DEBUG" and r.exc_info for r in records), "traceback at DEBUG"


def test_ledger_every_gives_up_after_max_failures_runs_in_a_row(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that fails is reported and tried again at the next tick; as many failures in a
    row as ``--max-failures`` end the job with exit code 2."""
    import pipeline.ledger  # noqa: PLC0415

    attempts = 0

    def unreachable(spark: SparkSession, job: object, **options: object) -> None:
        nonlocal attempts
        attempts += 1
        raise OSError("the storage is unreachable")

    monkeypatch.setattr(pipeline.ledger, "run_ledger", unreachable)
    ledger = str(world.tmp / "every-failing")
    common = ["--bootstrap", world.bootstrap, "--markers-topic", world.markers]
    args = ["ledger", *common, "--output", ledger, "--every", "10ms", "--max-failures", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert attempts == 2
    assert "run failed (1 of 2 in a row): OSError: the storage is unreachable" in err
    assert "giving up after 2 failed runs in a row" in err


def test_module_entry_point_runs_without_spark() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for command in ("ledger", "audit", "report", "redrive"):
        assert command in done.stdout


@pytest.mark.timeout(900)
def test_a_run_prints_its_result_and_summary_and_no_java_noise_first_and_next(
    world: World,
) -> None:
    """``python -m pipeline ledger`` in its own process, on an output directory that does not
    exist yet and then again on the ledger it wrote: each run's JSON on stdout, one summary
    line on stderr, no Java noise (no stack trace for the missing directory the first time,
    no warning about the run records' directory name the next)."""
    output = world.tmp / "first-run"

    def ledger_run() -> tuple[dict[str, Any], list[str]]:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "ledger",
                "--bootstrap",
                world.bootstrap,
                "--markers-topic",
                world.markers,
                "--output",
                str(output),
                "--as-of",
                world.as_of.isoformat(),
                "--no-progress",
                # Another Spark UI on this machine (the test session's, a CI neighbour's)
                # would make Spark warn that port 4040 is taken: true, but not tested here.
                "--conf",
                "spark.ui.enabled=false",
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        lines = [
            line
            for line in done.stderr.splitlines()
            # The JVM's own note about the module Spark asks for; no setting of ours hides it.
            if line.strip() and line != "WARNING: Using incubator modules: jdk.incubator.vector"
        ]
        assert len(lines) == 1, done.stderr
        return json.loads(done.stdout), lines

    run, lines = ledger_run()
    assert run["rows_written"] == sum(PLAN.values()) + GHOSTS
    assert lines[0].startswith(f"ledger: run {run['run_id']} committed in "), lines[0]
    assert f"{run['markers_read']:,} markers read" in lines[0]
    assert "markers/s" in lines[0]

    again, lines = ledger_run()
    assert again["run_seq"] == run["run_seq"] + 1, "the second run extends the first"
    assert again["markers_read"] == 0, "it read only what came after the first run's offsets"
    assert lines[0].startswith(f"ledger: run {again['run_id']} committed in "), lines[0]


_PROBE = """
import json, sys
from pipeline.spark_session import build_session
spark = build_session(sys.argv[1], app_name="kmq-probe", log_level="ERROR")

def where(_):
    import tracker, tracker.protocol
    from tracker import _speedups
    return (tracker.protocol.SPEEDUPS, tracker.__file__, _speedups.__file__)

print(json.dumps(spark.sparkContext.parallelize(range(2), 2).map(where).collect()))
spark.stop()
"""


def _pipeline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args, "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


@pytest.mark.timeout(1500)  # three drivers and their executors on two cores
def test_ledger_and_audit_on_a_standalone_cluster_match_local_mode(
    world: World, spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The jobs with ``--master spark://...`` on a real standalone cluster (a master and a
    worker process on loopback): the code reaches the executors as an archive, the executors
    decode with the C decoder, and ledger and audit say what they say in ``local[*]``."""
    local_root = str(world.tmp / "cluster-reference")
    common = ["--bootstrap", world.bootstrap, "--markers-topic", world.markers]
    when = ["--as-of", world.as_of.isoformat(), "--grace", "1m"]
    run_local = run_ledger(
        spark,
        LedgerJob(
            world.bootstrap,
            world.markers,
            local_root,
            LedgerParams(as_of=world.as_of, grace_ms=60_000),
        ),
    )
    local_audit = audit_ledger(spark, local_root)
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as cluster:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, cluster.master_url],
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        assert probe.returncode == 0, probe.stderr
        for speedups, package, compiled in json.loads(probe.stdout.splitlines()[-1]):
            assert speedups, "the executors decode with the C decoder"
            assert Path(package).is_relative_to(cluster.work_dir), package
            assert f"/{CODE_DIR}/tracker/" in package, "imported from the shipped archive"
            assert Path(compiled).parent == Path(package).parent

        cluster_root = str(world.tmp / "cluster-ledger")
        master = ["--master", cluster.master_url]
        ledger = _pipeline("ledger", *common, "--output", cluster_root, *when, *master)
        assert ledger.returncode == 0, ledger.stderr
        run = json.loads(ledger.stdout)
        audit = _pipeline("audit", "--ledger", cluster_root, *master)
        assert audit.returncode == 1, audit.stderr
        broken = json.loads(audit.stdout)

    assert (run["markers_read"], run["rows_written"], run["states_written"]) == (
        run_local.markers_read,
        run_local.rows_written,
        run_local.states_written,
    )
    drop = ["run_seq", "run_id", "as_of"]
    on_cluster = load_ledger(spark, cluster_root)
    in_local = load_ledger(spark, local_root)
    assert on_cluster is not None
    assert in_local is not None
    assert on_cluster.drop(*drop).exceptAll(in_local.drop(*drop)).count() == 0
    assert in_local.drop(*drop).exceptAll(on_cluster.drop(*drop)).count() == 0
    assert broken["broken_count"] == local_audit.broken_count == GHOSTS
    assert {b["offset"] for b in broken["broken"]} == {b["offset"] for b in local_audit.broken}
