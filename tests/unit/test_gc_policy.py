"""The tracker process's collector policy: what ``kmq-tracker run`` and ``api`` set, and that
the setting reaches the process before anything runs."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from tracker import cli
from tracker.gc_policy import DEFAULT_GEN0_THRESHOLD, apply_gc_policy, gc_policy

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _thresholds_restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_policy_sets_the_young_generation_only() -> None:
    gc.set_threshold(700, 11, 12)
    assert apply_gc_policy(25_000) == (700, 11, 12)
    assert gc.get_threshold() == (25_000, 11, 12)


def test_zero_leaves_pythons_setting() -> None:
    gc.set_threshold(700, 10, 10)
    apply_gc_policy(0)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        apply_gc_policy(-1)


def test_the_block_form_puts_the_thresholds_back() -> None:
    gc.set_threshold(700, 10, 10)
    with gc_policy(DEFAULT_GEN0_THRESHOLD):
        assert gc.get_threshold()[0] == DEFAULT_GEN0_THRESHOLD
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize(("env", "expected"), [(None, DEFAULT_GEN0_THRESHOLD), ("0", 700)])
def test_the_tracker_process_runs_with_the_configured_policy(
    monkeypatch: pytest.MonkeyPatch, env: str | None, expected: int
) -> None:
    """``kmq-tracker run`` and ``kmq-tracker api`` set the thresholds before they start."""
    gc.set_threshold(700, 10, 10)
    if env is not None:
        monkeypatch.setenv("KMQ_GC_GEN0_THRESHOLD", env)
    seen: list[int] = []

    def started(coroutine: Any) -> None:
        seen.append(gc.get_threshold()[0])
        coroutine.close()

    monkeypatch.setattr("tracker.cli.asyncio.run", started)
    for command in ("run", "api"):
        gc.set_threshold(700, 10, 10)
        assert cli.main([command]) == 0
    assert seen == [expected, expected]
