"""Value records (``tracker.domain.value_records``): frozen where it is checked, cheap to build."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

from tracker.domain.entries import Entry, State


def _entry(attempt: int = 2, reason: str = "") -> Entry:
    return Entry(
        "g", "orders", 1, 7, 3, State.DELAYED, attempt, "orders", 1, 9, 100, 50, 60, reason=reason
    )


def test_records_are_equal_and_hashed_by_value() -> None:
    assert _entry() == _entry()
    assert hash(_entry()) == hash(_entry())
    assert len({_entry(), _entry(), _entry(attempt=3)}) == 2
    assert _entry(reason="x") != _entry()


def test_records_have_slots_and_replace_builds_a_new_one() -> None:
    entry = _entry()
    assert not hasattr(entry, "__dict__")
    later = dataclasses.replace(entry, due_at_ms=200)
    assert (entry.due_at_ms, later.due_at_ms) == (100, 200)
    assert later.key == entry.key


def test_the_type_checker_refuses_an_assignment_to_a_field(tmp_path: Path) -> None:
    """What ``frozen=True`` guarded at run time is a type error instead (the module doc)."""
    snippet = tmp_path / "assigns.py"
    snippet.write_text(
        textwrap.dedent(
            """
            from tracker.domain.entries import Entry, State

            def bump(entry: Entry) -> None:
                entry.attempt = entry.attempt + 1
            """
        )
    )
    root = Path(__file__).resolve().parents[2]
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--strict", str(snippet)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert '"attempt" defined in "Entry" is read-only' in checked.stdout
