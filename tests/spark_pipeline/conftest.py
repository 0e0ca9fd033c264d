"""Fixtures for the Spark pipeline tests: one local SparkSession for the whole test session.

Starting Spark costs seconds (a JVM, then Python workers), so every pipeline test shares one
``local[2]`` session with a small shuffle, no UI and quiet logs. It starts only when a test
asks for ``spark``: the pure unit tests in this package never start it.

The directory is ``tests/spark_pipeline`` and not ``tests/pipeline``: pytest puts ``tests/``
on ``sys.path``, so a ``tests/pipeline`` directory would shadow the real ``pipeline`` package
(as a package with an ``__init__.py``, or as a namespace package without one).

Warnings: ``filterwarnings = error`` stays in force. The one PySpark warning this stack can
raise (a ``FutureWarning`` that pandas 3 is not fully supported, from ``mapInArrow``) is
avoided at the source: the ``spark``/``dev`` extras pin ``pandas<3``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A local SparkSession (``local[2]``) shared by the pipeline tests."""
    from pipeline.spark_session import build_session  # noqa: PLC0415 - starts nothing on import

    session = build_session(
        "local[2]",
        app_name="kmq-pipeline-tests",
        conf={
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "2",
        },
        log_level="ERROR",
    )
    try:
        yield session
    finally:
        session.stop()
