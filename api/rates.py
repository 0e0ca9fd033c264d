"""Recent rates from a Prometheus counter: "redeliveries per minute over the last N minutes".

The counter only knows totals since the process started, so this keeps a short history of
samples (taken at most every few seconds, lazily on reads and by the app's background task)
and answers with the increase over a window, and how much of the window the history covers.
Per process: with several replicas, each answers for itself (Prometheus has the sum).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import Counter

#: Below this much history, a rate would be noise: answer "unknown" instead.
MIN_COVERAGE_SECONDS = 1.0


class CounterRates:
    def __init__(
        self,
        counter: Counter,
        *,
        label: str = "topic",
        keep_seconds: float = 3600.0,
        every_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._counter = counter
        self._label = label
        self._keep = keep_seconds
        self._every = every_seconds
        self._clock = clock
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def _totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for metric in self._counter.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and self._label in sample.labels:
                    out[sample.labels[self._label]] = sample.value
        return out

    def sample(self) -> None:
        """Record the current totals (unless the last sample is very recent)."""
        now = self._clock()
        if self._samples and now - self._samples[-1][0] < self._every:
            return
        self._samples.append((now, self._totals()))
        while self._samples and now - self._samples[0][0] > self._keep:
            self._samples.popleft()

    def increase(self, key: str, window_seconds: float) -> tuple[float | None, float]:
        """``(increase, seconds covered)`` over the last ``window_seconds`` for ``key``.

        The increase is None while there is less than a second of history (covered is 0).
        """
        self.sample()
        now = self._clock()
        base: tuple[float, dict[str, float]] | None = None
        for sampled in self._samples:
            if sampled[0] <= now - window_seconds:
                base = sampled
            else:
                break
        if base is None:
            base = self._samples[0]
        covered = now - base[0]
        if covered < MIN_COVERAGE_SECONDS:
            return None, 0.0
        current = self._totals().get(key, 0.0)
        return max(0.0, current - base[1].get(key, 0.0)), min(covered, window_seconds)

    def per_minute(self, minutes: int = 60) -> list[float | None]:
        """The increase (all keys together) in each of the last ``minutes`` minutes, oldest
        first; None for a minute the history does not cover (before the process started)."""
        self.sample()
        now = self._clock()
        history = [(at, sum(totals.values())) for at, totals in self._samples]
        history.append((now, sum(self._totals().values())))

        def value_at(moment: float) -> float | None:
            found = None
            for at, total in history:
                if at > moment:
                    break
                found = total
            return found

        edges = [value_at(now - (minutes - i) * 60.0) for i in range(minutes)]
        edges.append(history[-1][1])
        return [
            None if before is None or after is None else max(0.0, after - before)
            for before, after in itertools.pairwise(edges)
        ]
