"""Whether ingest's store and broker answer: what readiness reports and the logs tell.

The ingest loop, the partition claims (``tracker.engine.markers_ownership``) and the flush
(``tracker.engine.marker_flush``) each find out that the store or the broker failed or answers
again. They share this one record of it, instead of each calling back into ingest.
"""

from __future__ import annotations

import logging
import time

from tracker.metrics import Metrics

#: Ingest's logger: these lines are its lines (operators filter on it).
log = logging.getLogger("tracker.engine.ingest")


class IngestHealth:
    """Whether the store and the broker answered ingest, and the last error seen."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.store_ok = True
        self.broker_ok = False
        self._broker_lost_at: float | None = None  #: monotonic time the broker went quiet
        self.last_error: str | None = None

    def store_failed(self, exc: Exception) -> None:
        if self.store_ok:
            log.error("store unavailable, pausing marker ingest: %s", exc)
        self.store_ok = False
        self.last_error = f"store: {exc}"

    def broker_seen(self, answering: bool) -> None:
        """Whether the broker answers now: one log line when it is back, and the gauge.

        The line that it went away is written where that is noticed (with why); in between,
        nothing is repeated (aiokafka's own lines are limited in ``tracker.logs``), so an
        outage reads as two lines of ours: gone, and back after how long.
        """
        if not answering and self.broker_ok:
            self._broker_lost_at = time.monotonic()
        elif answering and not self.broker_ok and self._broker_lost_at is not None:
            away = time.monotonic() - self._broker_lost_at
            log.info("broker answering again after %.0f s", away)
            self._broker_lost_at = None
        self.broker_ok = answering
        self._metrics.broker_reachable.set(1 if answering else 0)
