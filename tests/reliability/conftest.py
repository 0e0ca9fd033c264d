"""Fixtures and reporting of the reliability suite (see docs/reliability.md).

* ``KMQ_SOAK=1`` selects the long versions of the fault tests (``make soak``); without it the
  same tests run CI-sized. Soak-only modules (``SOAK_ONLY`` below) are not even collected in a
  CI run, so nothing is skipped there.
* The figures every fault test reports are printed again at the end of the session.
* ``private_postgres``: a PostgreSQL server of the test's own, which it may stop and restart
  (the session's shared server must never be stopped: other people's tests use it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.private_postgres import PrivatePostgres

from .harness import FIGURES, MODE, SOAK

#: Modules that exist only in the soak run (they would duplicate a CI-sized test otherwise).
SOAK_ONLY = ["test_soak_crash.py"]

collect_ignore = [] if SOAK else SOAK_ONLY


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability: fault, bad-input and security suite")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not FIGURES:
        return
    terminalreporter.section(f"reliability figures ({MODE})")
    for figures in FIGURES:
        terminalreporter.write_line(figures.line())


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL server on a free port; the test may ``stop()``/``start()`` it."""
    with PrivatePostgres() as server:
        yield server


__all__ = ["SOAK"]
