"""How refused markers are logged: a bounded number of lines, however much garbage arrives."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from tracker.engine.parking import LOG_EACH_PER_WINDOW, LOG_WINDOW_S, InvalidMarkerParker, Rejected

pytestmark = pytest.mark.unit


@dataclass
class Record:
    partition: int
    offset: int
    key: bytes | None = b"k"
    value: bytes | None = b"\x00garbage"


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refused(count: int, start: int = 0) -> list[Rejected]:
    return [
        Rejected(Record(0, start + i), "bad magic", "malformed" if i % 3 else "unknown_topic")
        for i in range(count)
    ]


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.name == "tracker.engine.parking"]
    caplog.clear()
    return messages


def test_a_flood_logs_a_few_lines_then_one_summary_per_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    clock = ManualClock()
    parker = InvalidMarkerParker(None, "m.invalid", "m", clock=clock)

    parker._log(refused(4))
    assert len(lines(caplog)) == 4  # a few bad markers: each one named

    parker._log(refused(500, start=4))
    logged = lines(caplog)
    assert len(logged) == LOG_EACH_PER_WINDOW - 4 + 1
    assert logged[0].startswith("invalid marker at m/0/4 ")
    assert logged[-1] == (
        "494 more invalid markers on m (329 malformed, 165 unknown_topic); all parked on m.invalid"
    )

    parker._log(refused(3, start=504))
    assert lines(caplog) == [
        "3 more invalid markers on m (2 malformed, 1 unknown_topic); all parked on m.invalid"
    ]

    clock.now += LOG_WINDOW_S  # a new window: the next ones are named again
    parker._log(refused(2, start=507))
    assert [line.split(" (")[0] for line in lines(caplog)] == [
        "invalid marker at m/0/507",
        "invalid marker at m/0/508",
    ]
