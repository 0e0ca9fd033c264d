"""The log stays readable in an outage: aiokafka's repeated lines are limited, ours are not."""

from __future__ import annotations

import logging

import pytest

from tracker.logs import RepeatLimiter

pytestmark = [pytest.mark.unit]


def _record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_one_line_per_kind_and_interval_then_a_count_of_what_was_held_back() -> None:
    now = [0.0]
    limiter = RepeatLimiter(60.0, clock=lambda: now[0])
    template = "Unable connect to node with id %s: %s"
    passed = []
    for second in range(120):  # a broker away for two minutes, five attempts a second
        now[0] = float(second)
        for attempt in range(5):
            record = _record("aiokafka.conn", template, 1, f"attempt {attempt}")
            if limiter.filter(record):
                passed.append(record.getMessage())
    assert passed == [
        "Unable connect to node with id 1: attempt 0",
        "Unable connect to node with id 1: attempt 0 (and 299 more like it in the last 60 s)",
    ]
    # Another kind of line is not held back by the first one.
    assert limiter.filter(_record("aiokafka.conn", "Connection to %s closed", 1))
    assert limiter.filter(_record("aiokafka.consumer", template, 1, "x"))


def test_the_trackers_own_lines_pass_untouched() -> None:
    limiter = RepeatLimiter(60.0, clock=lambda: 0.0)
    records = [_record("tracker.engine.ingest", "cannot apply: %s", n) for n in range(3)]
    assert all(limiter.filter(record) for record in records)
    assert [record.getMessage() for record in records] == [
        "cannot apply: 0",
        "cannot apply: 1",
        "cannot apply: 2",
    ]
