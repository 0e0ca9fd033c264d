"""The pipeline's jar (``pipeline/jvm/*.java``): built, handed to Spark, its decoder registered.

It holds the two parts of the pipeline that run in the JVM, because moving rows between the
JVM and Python workers, or through Spark SQL's aggregation buffers, cost more than the work:

* the marker decoder (``MarkerRowsUdf.java``). Decoding markers in Python (``mapInArrow`` with
  the C decoder) moves every record from the JVM to a Python worker and every decoded column
  back; that round trip, not the decoding, was 85 % of the decode step (docs/benchmarks.md,
  change 61). Where the records already are in the JVM (Spark's ``kafka`` connector, Parquet),
  they are decoded there by a Java UDF that applies the C decoder's rules with its error texts;
  ``tests/spark_pipeline/test_jvm_decoder.py`` holds the two to the same rows;
* the ledger fold (``LedgerFold.java``, used by :func:`pipeline.ledger_fold.build_ledger`): one
  pass over each message's sorted markers instead of two SQL aggregations
  (``tests/spark_pipeline/test_ledger_fold_jvm.py`` holds it to the SQL fold's rows).

The jar is built from the sources shipped in this package, with the JDK's ``javac`` (from
``JAVA_HOME`` or the ``PATH``) against PySpark's own jars, into a cache directory
(``KMQ_JVM_CACHE``, default ``~/.cache/kmq-tracker/jvm``) under a name that hashes the sources
and the Spark version, so a stale build is never used. ``make install`` builds it ahead
(``python -m pipeline.jvm_jar``); :func:`pipeline.spark_session.build_session` builds it
if missing and hands it to the driver and every executor with ``spark.jars``. Where
no compiler is found, or under ``spark-submit`` without ``--jars`` naming the jar, markers are
decoded in Python and the ledger folded in Spark SQL, as before: same rows, slower.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_JVM_DIR = Path(__file__).with_name("jvm")
#: The Java sources of the pipeline's jar: the marker decoder and the ledger fold.
SOURCES = tuple(sorted(_JVM_DIR.glob("*.java")))
CLASS_NAME = "kmq.pipeline.MarkerRowsUdf"
#: The SQL function the decoder is registered as: ``kmq_marker_rows(value)`` is an array of
#: the ``markers`` format's marker fields, one element per row (``inline`` makes them rows).
FUNCTION = "kmq_marker_rows"
CACHE_ENV = "KMQ_JVM_CACHE"

log = logging.getLogger(__name__)


class JarBuildError(RuntimeError):
    """``javac`` refused the sources (a Spark whose API moved, a broken JDK)."""


class NoJavacError(JarBuildError):
    """No JDK compiler was found (a JRE only, or no Java at all)."""


def find_javac() -> str | None:
    """The JDK's compiler: ``$JAVA_HOME/bin/javac``, else the one on the ``PATH``."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home) / "bin" / "javac", os.X_OK):
        return str(Path(home) / "bin" / "javac")
    return shutil.which("javac")


def _spark_jars() -> Path:
    import pyspark  # noqa: PLC0415 - pyspark is optional

    return Path(pyspark.__file__).parent / "jars"


def jar_path() -> Path:
    """Where the jar for these sources and this Spark version is (or would be) cached."""
    import pyspark  # noqa: PLC0415

    sources = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in SOURCES)
    digest = hashlib.sha256(sources + pyspark.__version__.encode()).hexdigest()
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kmq-tracker" / "jvm")
    return cache / f"{_JAR_PREFIX}{digest[:16]}.jar"


#: (Named when the jar held the decoder alone; kept, so the cache still prunes older builds.)
_JAR_PREFIX = "kmq-marker-rows-"


def build_jar(javac: str, target: Path) -> Path:
    """Compile the sources into ``target`` (written whole, then renamed: builds that race
    each other, as test processes may, each leave a complete jar)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kmq-jvm-") as work:
        classes = Path(work) / "classes"
        done = subprocess.run(  # noqa: S603 - the JDK's own compiler, arguments are ours
            [
                javac,
                "--release",
                "17",
                "-nowarn",
                "-cp",
                str(_spark_jars() / "*"),
                "-d",
                str(classes),
                *map(str, SOURCES),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise JarBuildError(f"javac failed on {_JVM_DIR}:\n{done.stderr.strip()}")
        partial = target.with_name(f"{target.name}.{os.getpid()}.part")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as jar:
            for path in sorted(classes.rglob("*.class")):
                jar.write(path, path.relative_to(classes).as_posix())
        os.replace(partial, target)
    return target


def ensure_jar() -> Path:
    """The pipeline's jar, built now if it is not cached yet. Raises :class:`NoJavacError`
    without a JDK compiler, :class:`JarBuildError` if the compiler refuses.

    A jar found is marked as used (its modification time); a build then removes the jars
    of the cache not used for :data:`UNUSED_DAYS` (:func:`prune_cache`).
    """
    target = jar_path()
    if target.is_file():
        with contextlib.suppress(OSError):  # a read-only cache still serves its jars
            os.utime(target)
        return target
    javac = find_javac()
    if javac is None:
        raise NoJavacError("no javac found (install a JDK, or set JAVA_HOME)")
    built = build_jar(javac, target)
    prune_cache(built.parent, keep=built)
    return built


#: A cached jar not used for this long is removed by the next build (see :func:`prune_cache`).
UNUSED_DAYS = 30


def prune_cache(cache: Path, *, keep: Path) -> list[Path]:
    """Remove the pipeline jars of ``cache`` (and partial builds) not used for
    :data:`UNUSED_DAYS`, except ``keep``; returns what was removed.

    Each new source or Spark version builds a jar of its own, and the old ones were never
    removed. Not every other jar can go: several installations (other virtualenvs, other
    Spark versions) may share the cache, and a running job's executors may still fetch the
    jar it started with. Every session marks the jar it uses (:func:`ensure_jar`), so a jar
    left alone for a month belongs to no installation still in use; if it does, it is built
    again when needed.
    """
    cutoff = time.time() - UNUSED_DAYS * 86_400
    removed: list[Path] = []
    for path in cache.glob(f"{_JAR_PREFIX}*"):
        if path == keep or path.suffix not in (".jar", ".part"):
            continue
        with contextlib.suppress(OSError):  # gone already, or not ours to remove
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed.append(path)
    if removed:
        log.info("removed %d unused pipeline jar(s) from %s", len(removed), cache)
    return removed


def pipeline_jar() -> Path | None:
    """:func:`ensure_jar`, or ``None`` (logged) when it cannot be built: markers are then
    decoded in Python and the ledger folded in Spark SQL."""
    try:
        return ensure_jar()
    except NoJavacError:
        # Only raw records read with Spark's connector decode in the JVM: no warning per run
        # for the many jobs that never do.
        log.info("no javac found: markers read as raw records decode in Python (slower)")
    except (JarBuildError, OSError) as exc:
        log.warning(
            "the pipeline's jar was not built (%s): markers decode in Python, the ledger "
            "folds in Spark SQL",
            exc,
        )
    return None


def with_pipeline_jar(jars: str, jar: Path) -> str:
    """A ``spark.jars`` value with ``jar`` added to the ones already asked for."""
    listed = [j for j in jars.split(",") if j]
    return ",".join([*listed, str(jar)] if str(jar) not in listed else listed)


def register_decoder(
    spark: SparkSession, *, function: str = FUNCTION, class_name: str = CLASS_NAME
) -> bool:
    """Register ``function`` (the decoder, :data:`FUNCTION`) in ``spark``; ``False`` where
    the class is not on the session's classpath (no jar, or ``spark-submit`` without it)."""
    from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]  # noqa: PLC0415
    from pyspark.errors import PySparkException  # noqa: PLC0415
    from pyspark.sql import types as t  # noqa: PLC0415

    from pipeline.record_schemas import spark_schema  # noqa: PLC0415

    if spark.catalog.functionExists(function):
        return True
    fields = [f for f in spark_schema("markers").fields if f.name not in _POSITION_COLUMNS]
    try:
        spark.udf.registerJavaFunction(function, class_name, t.ArrayType(t.StructType(fields)))
    except (Py4JJavaError, PySparkException):
        return False
    return True


#: The ``markers`` columns that come from the record, not from its value.
_POSITION_COLUMNS = ("markers_partition", "markers_offset", "timestamp")


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.jvm_jar``: build the jar (if needed) and print its path."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.jvm_jar", description=__doc__)
    parser.add_argument(
        "--if-possible",
        action="store_true",
        help="exit 0 without a JDK compiler (the pipeline then decodes markers in Python)",
    )
    args = parser.parse_args(argv)
    try:
        print(ensure_jar())
    except NoJavacError as exc:
        print(exc, file=sys.stderr)
        return 0 if args.if_possible else 1
    except JarBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
