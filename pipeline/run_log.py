"""The ledger's run log: a commit record per run, and checkpoints that keep reading it cheap.

A ledger run is committed by one JSON record in ``_runs/`` (see :mod:`pipeline.ledger`):
where it stopped reading, its parameters, its counts. Every run, audit and report needs the
ids of all committed runs (rows of a run that died before its record are ignored) and the
newest record (where to resume, how the ledger was judged). Read as one small file per run,
that cost grew with the ledger's age: 2,016 records (a week of runs every five minutes) took
4.8 s in a fresh session and 1.8 s in a warm one.

So, as Delta Lake does with its transaction log, a run now and then writes a *checkpoint*:
``_runs_checkpoint/seq=<n>/`` holds one line per committed run up to run ``n`` (its id, the
name of its record file, the counts the audit adds up) and the whole record of run ``n``. A
reader takes the newest complete checkpoint (its ``_COMPLETE`` marker is written after its
data; a directory without one is a checkpoint whose writer died, and is ignored), then reads
the ``_runs/`` directory in one read and skips the files the checkpoint covers. Once a newer
checkpoint is complete, the record files the one before it covered are moved to
``_runs_archive/`` (kept for people, never read again) and older checkpoints are deleted, so
from the second checkpoint on ``_runs/`` holds at most about two checkpoints' worth of
records, whatever the ledger's age.

Why a reader is safe from the writer's moves: it chooses its checkpoint *before* it reads the
records, and a writer moves only files that the checkpoint before its new one covers and
deletes only checkpoints older than that one, so whichever of the two the reader took, it
skips what may vanish (``ignoreMissingFiles``). A record that vanishes otherwise leaves a gap
in the run numbers, which every read checks: runs are numbered 1, 2, 3... as they commit.
That holds with one run writing a ledger at a time, which the pipeline assumes throughout.

The records stay the commit: a checkpoint is derived from them, so one that fails to be
written costs nothing but the next run's time (it tries again).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from pipeline.hadoop_fs import (
    delete_tree,
    join_path,
    move_into,
    path_exists,
    touch,
    visible_children,
)
from pipeline.ledger_fold import LedgerError, LedgerParams

RUNS_DIR = "_runs"
CHECKPOINT_DIR = "_runs_checkpoint"
ARCHIVE_DIR = "_runs_archive"
#: Records not covered by a checkpoint that make the next run write one.
CHECKPOINT_EVERY = 50
#: The file that makes a checkpoint directory complete (written after its data).
COMPLETE_MARKER = "_COMPLETE"

_RECORD_SCHEMA = StructType(
    [
        StructField("run_seq", IntegerType()),
        StructField("run_id", StringType()),
        StructField("record", StringType()),  # the run's JSON (see LedgerRun.to_json)
    ]
)
#: A checkpoint line: a committed run, the file its record is in, the record itself only
#: for the newest run (a record is 1-3 KB; a year of five-minute runs is 105,000 of them).
_CHECKPOINT_SCHEMA = StructType(
    [
        *_RECORD_SCHEMA.fields,
        StructField("file", StringType()),
        # what the audit adds up over all runs
        StructField("invalid_markers", LongType()),
        StructField("orphan_dlq_records", LongType()),
        # a compaction run (null in checkpoints written before compactions existed)
        StructField("compaction", BooleanType()),
    ],
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LedgerRun:
    """What a run did; its JSON is the run's commit record in ``_runs``."""

    run_seq: int
    run_id: str
    params: LedgerParams
    offsets: dict[str, dict[str, int]]  #: topic -> partition -> next offset to read
    topics: list[str]  #: origin topics seen so far
    dlq_topics: list[str]
    markers_read: int = 0
    invalid_markers: int = 0
    dlq_records_read: int = 0
    orphan_dlq_records: int = 0
    rows_written: int = 0
    states_written: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    committed_at: str = ""
    #: a compaction (see pipeline.ledger_compaction): read nothing, rewrote every row that
    #: counted as its own; rows of runs before it no longer count
    compaction: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["params"] = self.params.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LedgerRun:
        values = dict(data)
        values["params"] = LedgerParams.from_json(values["params"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class RunEntry:
    """One committed run as the log lists it: its id, which record file holds it, and the
    counts the audit adds up over every run."""

    run_seq: int
    run_id: str
    file: str
    invalid_markers: int
    orphan_dlq_records: int
    compaction: bool = False


@dataclass(frozen=True, slots=True)
class RunLog:
    """The committed runs of a ledger, as one read of its run log found them."""

    entries: tuple[RunEntry, ...] = ()  #: every committed run, oldest first
    latest: LedgerRun | None = None  #: the newest committed run's record
    checkpoint: int | None = None  #: the run the checkpoint read ends with (None: none read)
    uncovered: int = 0  #: records read from their own files (no checkpoint covered them)

    @property
    def run_ids(self) -> list[str]:
        return [entry.run_id for entry in self.entries]

    @property
    def floor(self) -> int:
        """The newest compaction's run number (0: none): rows of runs before it no longer
        count, as it rewrote every row that did as its own."""
        return max((e.run_seq for e in self.entries if e.compaction), default=0)

    @property
    def live_run_ids(self) -> list[str]:
        """The committed runs whose rows count: the newest compaction and the runs after it."""
        floor = self.floor
        return [entry.run_id for entry in self.entries if entry.run_seq >= floor]

    @property
    def invalid_markers(self) -> int:
        """Markers every committed run refused (malformed, truncated, unknown version)."""
        return sum(entry.invalid_markers for entry in self.entries)

    @property
    def orphan_dlq_records(self) -> int:
        """Dead letters every committed run found naming a message no marker mentions."""
        return sum(entry.orphan_dlq_records for entry in self.entries)


def _seq_of(name: str) -> int | None:
    """The run a checkpoint directory (``seq=<n>``) ends with; None for any other name."""
    prefix, _, digits = name.partition("=")
    return int(digits) if prefix == "seq" and digits.isdigit() else None


def _newest_complete_checkpoint(spark: SparkSession, root: str) -> int | None:
    """The run the newest complete checkpoint ends with (None: there is none)."""
    names = visible_children(spark, join_path(root, CHECKPOINT_DIR)) or []
    for seq in sorted((seq for seq in map(_seq_of, names) if seq is not None), reverse=True):
        if path_exists(spark, _complete_marker(root, seq)):
            return seq
    return None


def _complete_marker(root: str, seq: int) -> str:
    """Written once a checkpoint's file is: ours, not Hadoop's ``_SUCCESS``, which a job
    configuration may turn off (``mapreduce.fileoutputcommitter.marksuccessfuljobs``)."""
    return join_path(root, f"{CHECKPOINT_DIR}/{_dir_name(seq)}/{COMPLETE_MARKER}")


def _dir_name(seq: int) -> str:
    return f"seq={seq:09d}"


def read_run_log(spark: SparkSession, root: str) -> RunLog:
    """The committed runs of the ledger at ``root`` (see the module docstring)."""
    runs_dir = join_path(root, RUNS_DIR)
    if not path_exists(spark, runs_dir):
        return RunLog()
    # The checkpoint is chosen before the record files are read: a writer archives only files
    # that the checkpoint before its new one covers, which this reader skips whichever of the
    # two it took (and a file archived while Spark lists and reads them is not missed).
    checkpoint = _newest_complete_checkpoint(spark, root)
    #: (entry, its record if the checkpoint holds it or the record was read, parsed if it was)
    found: list[tuple[RunEntry, str | None, LedgerRun | None]] = []
    covered: set[str] = set()
    if checkpoint is not None:
        for row in (
            spark.read.schema(_CHECKPOINT_SCHEMA)
            .json(join_path(root, f"{CHECKPOINT_DIR}/{_dir_name(checkpoint)}"))
            .collect()
        ):
            entry = RunEntry(
                row["run_seq"],
                row["run_id"],
                row["file"],
                row["invalid_markers"],
                row["orphan_dlq_records"],
                bool(row["compaction"]),
            )
            found.append((entry, row["record"], None))
            covered.add(entry.file)
    # The whole directory, in one read: after checkpoints it holds at most two checkpoints'
    # worth of small files, and one read of a directory costs far less than a read of a list
    # of its files (Spark checks every path of a list on its own: 2,016 took 8 s warm).
    uncovered = 0
    for row in (
        spark.read.schema(_RECORD_SCHEMA)
        .option("ignoreMissingFiles", "true")
        .json(runs_dir)
        .select("record", F.col("_metadata.file_name").alias("file"))
        .collect()
    ):
        if row["file"] in covered:
            continue
        uncovered += 1
        run = LedgerRun.from_json(json.loads(row["record"]))
        entry = RunEntry(
            run.run_seq,
            run.run_id,
            row["file"],
            run.invalid_markers,
            run.orphan_dlq_records,
            run.compaction,
        )
        found.append((entry, row["record"], run))
    found.sort(key=lambda item: (item[0].run_seq, item[0].run_id))
    if not found:
        return RunLog()
    seqs = [entry.run_seq for entry, _, _ in found]
    if seqs != list(range(1, len(seqs) + 1)):
        # Each run takes the number after the last committed one, so a gap or a repeat is a
        # record gone (deleted, or archived under a reader: see the module docstring) or two
        # runs that wrote the ledger at once. Going on would hide committed rows.
        raise LedgerError(
            f"the run log at {root} is damaged: run numbers {_ranges(seqs)} (expected 1 to "
            f"{len(seqs)}, each once); see docs/pipeline.md, Runs"
        )
    _, newest_record, newest = found[-1]
    if newest is None:
        if newest_record is None:
            raise LedgerError(f"the run log at {root} has no record of its newest run")
        newest = LedgerRun.from_json(json.loads(newest_record))
    return RunLog(
        tuple(entry for entry, _, _ in found),
        newest,
        checkpoint,
        uncovered,
    )


def _ranges(seqs: list[int]) -> str:
    """``1-40, 42-50`` (sorted numbers as runs of consecutive ones; repeats shown twice)."""
    parts: list[str] = []
    start = prev = seqs[0]
    for seq in [*seqs[1:], None]:
        if seq is not None and seq == prev + 1:
            prev = seq
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if seq is not None:
            start = prev = seq
    return ", ".join(parts)


def commit_run(spark: SparkSession, root: str, run: LedgerRun) -> None:
    """Write ``run``'s record: from now on the run is committed."""
    record = spark.createDataFrame(
        [(run.run_seq, run.run_id, json.dumps(run.to_json()))], _RECORD_SCHEMA
    )
    record.coalesce(1).write.mode("append").json(join_path(root, RUNS_DIR))


def checkpoint_run_log(spark: SparkSession, root: str, runs: RunLog) -> None:
    """Write a checkpoint of ``runs`` (a complete read of the log): its file, then its
    completion marker. Nothing happens if that checkpoint is complete already."""
    if runs.latest is None:
        return
    seq = runs.entries[-1].run_seq
    if path_exists(spark, _complete_marker(root, seq)):
        return
    latest = runs.latest.run_id
    lines = [
        (
            entry.run_seq,
            entry.run_id,
            json.dumps(runs.latest.to_json()) if entry.run_id == latest else None,
            entry.file,
            entry.invalid_markers,
            entry.orphan_dlq_records,
            entry.compaction,
        )
        for entry in runs.entries
    ]
    # Overwrite: what is there is a checkpoint whose writer died before its marker.
    spark.createDataFrame(lines, _CHECKPOINT_SCHEMA).coalesce(1).write.mode("overwrite").json(
        join_path(root, f"{CHECKPOINT_DIR}/{_dir_name(seq)}")
    )
    touch(spark, _complete_marker(root, seq))


def tidy_run_log(spark: SparkSession, root: str, runs: RunLog) -> None:
    """After a checkpoint of ``runs``: move the record files that the checkpoint before it
    (the one ``runs`` was read with) covered to the archive, and delete the checkpoints
    before that one. Readers take the new checkpoint or that one (see the module
    docstring), so they never look for what is moved or deleted here."""
    if runs.checkpoint is None:
        return
    previous = {entry.file for entry in runs.entries if entry.run_seq <= runs.checkpoint}
    on_disk = set(visible_children(spark, join_path(root, RUNS_DIR)) or [])
    stuck = move_into(
        spark, sorted(previous & on_disk), join_path(root, RUNS_DIR), join_path(root, ARCHIVE_DIR)
    )
    if stuck:
        log.warning(
            "ledger: %d run records were not moved to %s (next checkpoint retries): %s",
            len(stuck),
            ARCHIVE_DIR,
            ", ".join(stuck[:5]),
        )
    for name in visible_children(spark, join_path(root, CHECKPOINT_DIR)) or []:
        older = _seq_of(name)
        if older is not None and older < runs.checkpoint:
            delete_tree(spark, join_path(root, f"{CHECKPOINT_DIR}/{name}"))


def checkpoint_if_due(spark: SparkSession, root: str, runs: RunLog, every: int) -> bool:
    """After a run committed: write a checkpoint if ``runs`` (the log the run started from)
    read ``every`` or more records from their own files, and tidy up after it. True if the
    checkpoint was written (or found complete).

    Failures are logged, not raised: the run is committed, a checkpoint is derived from the
    records, and the next run tries again. Every exception is caught for that reason (Spark
    and Py4J raise many kinds); the log line carries its trace.
    """
    if runs.uncovered < every:
        return False
    try:
        checkpoint_run_log(spark, root, runs)
    except Exception:
        log.warning(
            "ledger: the run log checkpoint was not written (next run retries)", exc_info=True
        )
        return False
    try:
        tidy_run_log(spark, root, runs)
    except Exception:
        log.warning("ledger: tidying the run log after its checkpoint failed", exc_info=True)
    return True
