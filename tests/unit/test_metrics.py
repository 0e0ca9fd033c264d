"""Metrics helpers that reach past prometheus_client's public calls."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from tracker.metrics import observe_times

BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1)


def _samples(histogram: Histogram) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in histogram.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def _histogram(labelled: bool = False) -> Histogram:
    return Histogram(
        "lateness_seconds",
        "test",
        ["topic"] if labelled else [],
        registry=CollectorRegistry(),
        buckets=BUCKETS,
    )


@pytest.mark.parametrize("amount", [0.0, 0.01, 0.07, 0.5, 2.0, 99.0])
@pytest.mark.parametrize("times", [1, 3, 1000])
def test_observing_a_value_many_times_at_once_equals_observing_it_one_by_one(
    amount: float, times: int
) -> None:
    one_by_one, at_once = _histogram(), _histogram()
    one_by_one.observe(0.2)
    at_once.observe(0.2)
    for _ in range(times):
        one_by_one.observe(amount)
    observe_times(at_once, amount, times)
    assert _samples(at_once) == pytest.approx(_samples(one_by_one))
    assert _samples(at_once)[("lateness_seconds_count", ())] == times + 1


def test_observing_nothing_changes_nothing() -> None:
    histogram, untouched = _histogram(), _histogram()
    observe_times(histogram, 0.3, 0)
    assert _samples(histogram) == _samples(untouched)


def test_a_labelled_histogram_must_be_observed_through_its_labels() -> None:
    labelled = _histogram(labelled=True)
    with pytest.raises(ValueError, match="missing label values"):
        observe_times(labelled, 0.3, 2)
    observe_times(labelled.labels("orders"), 0.3, 2)
    assert _samples(labelled)[("lateness_seconds_count", (("topic", "orders"),))] == 2
