"""The tracker process's garbage-collector policy: collect the young generation less often.

The hot paths allocate per record, in batches of thousands: aiokafka builds a
``ConsumerRecord`` per fetched record, ingest a marker and a pending entry per record,
redelivery a record per copy. Almost none of it can form a reference cycle, yet each
allocated container counts towards CPython's young-generation threshold, and at the default
(a collection every 700 allocations) the collector ran dozens of times per fetched batch.
Measured with the ingest bench (scenario 2, acked v1 markers, SQLite): 1.4x the ingest rate
at 20,000, most of it already at 5,000; decoding a batch of markers took 1.4 µs per record in
the running tracker and 0.3 µs in isolation, the difference being the collector (see
docs/benchmarks.md, change 42).

A higher threshold only delays the collection of garbage cycles: at most that many young
objects wait for the next collection, a few megabytes at worst. The older generations keep
CPython's settings. It is a setting of the process (``kmq-tracker run`` and ``kmq-tracker api``
apply it at start), not of the :class:`~tracker.engine.process.Tracker` object, which may be
embedded in a process whose collector is not ours to tune.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

#: the young generation's threshold the tracker process runs with (CPython's default: 700)
DEFAULT_GEN0_THRESHOLD = 20_000


def apply_gc_policy(gen0_threshold: int) -> tuple[int, int, int]:
    """Collect the young generation every ``gen0_threshold`` allocations (0: leave CPython's
    setting); return the thresholds as they were."""
    if gen0_threshold < 0:
        raise ValueError(f"gen0_threshold must not be negative, got {gen0_threshold}")
    before: tuple[int, int, int] = gc.get_threshold()
    if gen0_threshold:
        gc.set_threshold(gen0_threshold, before[1], before[2])
    return before


@contextmanager
def gc_policy(gen0_threshold: int) -> Iterator[None]:
    """The policy while the block runs, the thresholds as they were after (benchmarks and
    tests that run a tracker in their own process)."""
    before = apply_gc_policy(gen0_threshold)
    try:
        yield
    finally:
        gc.set_threshold(*before)


__all__ = ["DEFAULT_GEN0_THRESHOLD", "apply_gc_policy", "gc_policy"]
