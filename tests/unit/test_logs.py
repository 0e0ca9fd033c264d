"""The log stays readable in an outage: aiokafka's repeated lines are limited, ours are not."""

from __future__ import annotations

import io
import logging

import pytest

from tracker.logs import LimitedStreamHandler, RepeatLimiter

pytestmark = [pytest.mark.unit]

T0 = 1_795_000_000.0  #: wall-clock time of the first record (2026-11-18T11:06:40Z)


def _record(name: str, msg: str, *args: object, at: float = T0) -> logging.LogRecord:
    record = logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)
    record.created = at
    return record


def test_one_line_per_kind_and_interval_then_a_count_of_what_was_held_back() -> None:
    now = [0.0]
    limiter = RepeatLimiter(60.0, clock=lambda: now[0])
    template = "Unable connect to node with id %s: %s"
    passed = []
    for second in range(120):  # a broker away for two minutes, five attempts a second
        now[0] = float(second)
        for attempt in range(5):
            record = _record("aiokafka.conn", template, 1, f"attempt {attempt}", at=T0 + second)
            suffix = limiter.admit(record)
            if suffix is not None:
                passed.append(record.getMessage() + suffix)
    assert passed == [
        "Unable connect to node with id 1: attempt 0",
        "Unable connect to node with id 1: attempt 0 (and 299 more like it since 11:06:40 UTC)",
    ]
    # Another kind of line is not held back by the first one.
    assert limiter.admit(_record("aiokafka.conn", "Connection to %s closed", 1)) == ""
    assert limiter.admit(_record("aiokafka.consumer", template, 1, "x")) == ""


def test_the_trackers_own_lines_pass_untouched() -> None:
    limiter = RepeatLimiter(60.0, clock=lambda: 0.0)
    records = [_record("tracker.engine.ingest", "cannot apply: %s", n) for n in range(3)]
    assert [limiter.admit(record) for record in records] == ["", "", ""]


def test_the_handler_writes_the_count_on_a_copy_other_handlers_see_the_record_as_logged() -> None:
    now = [0.0]
    stream = io.StringIO()
    handler = LimitedStreamHandler(RepeatLimiter(60.0, clock=lambda: now[0]))
    handler.setStream(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    records = [_record("aiokafka", "Unable connect to %s", "node", at=T0 + n) for n in range(3)]
    for n, record in enumerate(records):
        now[0] = [0.0, 1.0, 61.0][n]
        handler.handle(record)
    assert stream.getvalue().splitlines() == [
        "Unable connect to node",
        "Unable connect to node (and 1 more like it since 11:06:40 UTC)",
    ]
    assert [r.getMessage() for r in records] == ["Unable connect to node"] * 3
