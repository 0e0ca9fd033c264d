"""The kmq Spark pipeline: delivery ledger, audit, analytics report and bulk redrive.

The tracker keeps only what it must act on; the complete history of every logical message
lives in Kafka, in the markers topic and the dead-letter topics. These PySpark jobs turn that
history into something an operator can query and trust at a scale one process cannot handle:

* :mod:`pipeline.source` reads Kafka into DataFrames (a Python data source that runs a Kafka
  client on the executors, or Spark's own ``kafka`` connector where a cluster has it), split
  into Spark partitions by Kafka partition and offset range;
* :mod:`pipeline.ledger` folds the markers into one row per logical message (every attempt,
  the final state, timings, reasons), stored as Parquet and extended incrementally;
* :mod:`pipeline.audit` proves from the ledger that no started message was silently dropped;
* :mod:`pipeline.report` renders throughput, latency, retries and dead letters (JSON + HTML);
* :mod:`pipeline.bulk_redrive` republishes a SQL-selected set of dead letters exactly once.

Run them with ``python -m pipeline {ledger,audit,report,redrive} ...`` (see ``docs/pipeline.md``).
PySpark is an optional dependency (the ``spark`` extra); importing this package does not need it.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
