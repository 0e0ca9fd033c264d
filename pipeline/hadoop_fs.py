"""Asking the Hadoop file system that Spark reads a path with: existence, listing, renames.

Any Hadoop URI works (a local path, ``s3a://``, ``hdfs://``, ``abfs://``), with the session's
Hadoop configuration, so the pipeline's own bookkeeping sees exactly what Spark's readers see.
Each call is a round trip to the JVM (and, on an object store, a request): callers keep the
number of paths they ask about small.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pyspark.sql import SparkSession


def join_path(root: str, sub: str) -> str:
    """``sub`` (a relative path) under ``root``, a directory URI with or without a trailing /."""
    return f"{root.rstrip('/')}/{sub}"


def _jvm(spark: SparkSession) -> Any:
    jvm = spark.sparkContext._jvm
    if jvm is None:  # pragma: no cover - a classic session always has its gateway
        raise RuntimeError("this Spark session has no JVM gateway (Spark Connect?)")
    return jvm


def _fs_path(spark: SparkSession, path: str) -> tuple[Any, Any]:
    jvm = _jvm(spark)
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    conf = spark._jsparkSession.sessionState().newHadoopConf()
    return hadoop_path.getFileSystem(conf), hadoop_path


def path_exists(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` exists.

    Asked before reading a directory that a first run has not written yet: Spark's reader
    looks for a streaming sink's metadata there first and logs the ``FileNotFoundException``
    it gets, with its whole Java stack trace, as a warning, though nothing is wrong.
    """
    fs, hadoop_path = _fs_path(spark, path)
    return bool(fs.exists(hadoop_path))


def visible_children(spark: SparkSession, path: str) -> list[str] | None:
    """Names of the entries directly under ``path`` that Spark's readers would read (not
    ``_SUCCESS``, ``_temporary``, ``.crc`` and other names starting with ``_`` or ``.``);
    None if ``path`` does not exist."""
    fs, hadoop_path = _fs_path(spark, path)
    if not fs.exists(hadoop_path):
        return None
    names = [str(status.getPath().getName()) for status in fs.listStatus(hadoop_path)]
    return sorted(name for name in names if not name.startswith(("_", ".")))


def move_into(spark: SparkSession, names: list[str], source: str, directory: str) -> list[str]:
    """Move the files ``names`` from the directory ``source`` into ``directory`` (made if
    missing), keeping their names; returns the names that could not be moved (gone already,
    or refused by the file system)."""
    fs, target = _fs_path(spark, directory)
    fs.mkdirs(target)
    path = _jvm(spark).org.apache.hadoop.fs.Path
    _, source_dir = _fs_path(spark, source)
    return [name for name in names if not fs.rename(path(source_dir, name), path(target, name))]


def touch(spark: SparkSession, path: str) -> None:
    """Create the empty file ``path`` (replacing one that is there)."""
    fs, hadoop_path = _fs_path(spark, path)
    fs.create(hadoop_path, True).close()


def delete_tree(spark: SparkSession, path: str) -> None:
    """Delete ``path`` and everything under it (nothing happens if it does not exist)."""
    fs, hadoop_path = _fs_path(spark, path)
    fs.delete(hadoop_path, True)


def delete_files(spark: SparkSession, paths: list[str]) -> list[str]:
    """Delete the files ``paths`` (URIs on one file system, percent-encoded as Spark lists
    them: ``inputFiles()``, ``_metadata.file_path``); returns those still there afterwards
    (a file already gone counts as deleted)."""
    if not paths:
        return []
    jvm = _jvm(spark)
    fs, _ = _fs_path(spark, paths[0])
    left: list[str] = []
    for name in paths:
        hadoop_path = jvm.org.apache.hadoop.fs.Path(jvm.java.net.URI(name))
        if not fs.delete(hadoop_path, False) and fs.exists(hadoop_path):
            left.append(name)
    return left


def modified_at(spark: SparkSession, path: str) -> datetime | None:
    """When ``path`` was last written (None: it does not exist)."""
    fs, hadoop_path = _fs_path(spark, path)
    if not fs.exists(hadoop_path):
        return None
    millis = int(fs.getFileStatus(hadoop_path).getModificationTime())
    return datetime.fromtimestamp(millis / 1000, UTC)
