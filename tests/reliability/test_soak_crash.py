"""Soak only (``KMQ_SOAK=1``, ``make soak``): the crash-safety test, many more kills.

The CI-sized test (``tests/integration/test_crash_safety.py``: SIGKILL of a real
``kmq-tracker run`` process at seeded random moments under load, full accounting) runs in every
CI build. This module runs *that same test function* with soak sizes (more messages, many more
kills; PostgreSQL, the multi-replica store) instead of a copy of it, and turns its one-line
summary into the suite's figures. It is
not collected at all in a CI run (``conftest.collect_ignore``), so nothing is skipped there.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from integration import test_crash_safety as crash
from support.broker import TopicFactory

from .harness import SOAK, Figures, report

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MESSAGES = int(os.environ.get("KMQ_SOAK_CRASH_MESSAGES", "3000"))
KILLS = int(os.environ.get("KMQ_SOAK_CRASH_KILLS", "50"))

_SUMMARY = re.compile(
    r"(?P<produced>\d+) produced, .*?(?P<copies>\d+) copies .*?"
    r"(?P<duplicates>\d+) duplicate copies, (?P<lost>\d+) never acked, "
    r"(?P<after>\d+) redelivered after an ack"
)


@pytest.mark.timeout(1800)
async def test_tracker_killed_many_times_loses_nothing(
    *,
    kafka_bootstrap: str,
    topic_factory: TopicFactory,
    postgres_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert SOAK, "soak-only module collected outside KMQ_SOAK=1"
    monkeypatch.setattr(crash, "MESSAGES", MESSAGES)
    monkeypatch.setattr(crash, "KILLS", KILLS)
    started = time.monotonic()
    await crash.test_tracker_killed_at_random_moments_loses_nothing(
        kafka_bootstrap, topic_factory, postgres_url, tmp_path
    )
    out = capsys.readouterr().out
    print(out)
    match = _SUMMARY.search(out)
    assert match is not None, f"no summary line in the crash test's output: {out[-500:]}"
    report(
        Figures(
            test=f"tracker SIGKILL x{KILLS} under load, postgres",
            lost=int(match["lost"]),
            acked_then_redelivered=int(match["after"]),
            duplicates=int(match["duplicates"]),
            duplicate_bound=KILLS * crash.REDELIVERY_BATCH,
            recovery_s=None,
            produced=int(match["produced"]),
            copies=int(match["copies"]),
            seconds=time.monotonic() - started,
            detail={"kills": KILLS},
        )
    )
