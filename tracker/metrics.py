"""Prometheus metrics of one tracker process (its own registry, so several can coexist)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """The tracker's counters, gauges and histograms. Names follow Prometheus conventions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.markers_ingested = Counter(
            "kmq_markers_ingested_total", "Valid markers read, by kind.", ["kind"], registry=r
        )
        self.markers_invalid = Counter(
            "kmq_markers_invalid_total",
            "Markers refused and parked, by reason: malformed, unknown_topic (or partition), "
            "wrong_partition (not on its origin's markers partition).",
            ["reason"],
            registry=r,
        )
        self.marker_anomalies = Counter(
            "kmq_marker_anomalies_total",
            "Valid markers that did not apply (stale, ACK without START, ...).",
            registry=r,
        )
        self.markers_coalesced = Counter(
            "kmq_markers_coalesced_total",
            "Markers whose effect cancelled out in memory (e.g. START+ACK) or in one write.",
            registry=r,
        )
        self.redeliveries = Counter(
            "kmq_redeliveries_total",
            "Copies republished after a timeout or retry, by origin topic.",
            ["topic"],
            registry=r,
        )
        self.delayed_delivered = Counter(
            "kmq_delayed_delivered_total",
            "Delayed messages published when due (their first delivery; not redeliveries).",
            ["topic"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "kmq_dead_lettered_total", "Messages published to a DLQ.", ["topic"], registry=r
        )
        self.lost = Counter(
            "kmq_lost_total",
            "Messages whose original could not be read when due.",
            ["topic"],
            registry=r,
        )
        self.flush_seconds = Histogram(
            "kmq_ingest_flush_seconds",
            "Time to apply one batch of markers to the store.",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.redelivery_seconds = Histogram(
            "kmq_redelivery_round_seconds",
            "Time of one redelivery round (claim, read originals, produce, record).",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.redelivery_phase = Histogram(
            "kmq_redelivery_phase_seconds",
            "Time of each phase of a redelivery round: claim (store), read (originals from "
            "Kafka), produce (build and queue the copies), ack (the broker's acknowledgement), "
            "record (store). Rounds overlap: the next is claimed while one is acknowledged.",
            ["phase"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.redelivery_lateness = Histogram(
            "kmq_redelivery_lateness_seconds",
            "How long after its due time an entry was republished.",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.output_topic_partitions_missing = Gauge(
            "kmq_output_topic_partitions_missing",
            "Partitions a dead-letter or retry topic lacks against the topic whose messages "
            "it receives (0: none); read when the tracker first writes to it.",
            ["topic", "source"],
            registry=r,
        )
        self.pending_markers = Gauge(
            "kmq_pending_markers", "Markers held in memory (coalescing window).", registry=r
        )
        self.broker_reachable = Gauge(
            "kmq_broker_reachable",
            "1 while fetch responses for the markers partitions arrive; 0 when none came for "
            "5 s or the markers consumer failed (the broker is away).",
            registry=r,
        )
        self.owned_partitions = Gauge(
            "kmq_owned_markers_partitions", "Markers partitions this replica owns.", registry=r
        )
        self.markers_lag = Gauge(
            "kmq_markers_lag",
            "Markers not yet read by this replica, per markers partition it owns (the "
            "partition's end at the last fetch minus the read position).",
            ["partition"],
            registry=r,
        )
        self.fenced = Counter(
            "kmq_fenced_total",
            "Times this replica found markers partitions taken over by another replica "
            "(fencing: its writes for them are refused); it stops working on them.",
            registry=r,
        )
        self.redelivery_errors = Counter(
            "kmq_redelivery_errors_total",
            "Redelivery steps that failed and are retried, by stage: claim (store), read "
            "(originals from Kafka), produce (copies), record (store).",
            ["stage"],
            registry=r,
        )
        for stage in ("claim", "read", "produce", "record"):
            # Exported at 0 from the start, so that an alert on increase() sees the first error.
            self.redelivery_errors.labels(stage)
        self.read_ahead = Counter(
            "kmq_redelivery_read_ahead_total",
            "Originals a redelivery round wanted, by whether they had been read ahead while "
            "ack_grace ran (hit) or were read by the round (miss).",
            ["result"],
            registry=r,
        )
        # Store-wide gauges, computed from the database when /metrics is scraped.
        self.tracked_messages = Gauge(
            "kmq_tracked_messages",
            "Tracked messages (all replicas), by origin topic and state.",
            ["topic", "state"],
            registry=r,
        )
        self.oldest_in_flight_age = Gauge(
            "kmq_oldest_in_flight_age_seconds",
            "Age of the oldest in-flight message (since first seen), by origin topic.",
            ["topic"],
            registry=r,
        )
        self.next_delayed_due = Gauge(
            "kmq_next_delayed_due_seconds",
            "Seconds until the earliest delayed message is due (negative: overdue), by topic.",
            ["topic"],
            registry=r,
        )
        self.dead_letters_waiting = Gauge(
            "kmq_dead_letters",
            "Dead letters recorded and not redriven, by origin topic.",
            ["topic"],
            registry=r,
        )
        # The admin API and the sidecar endpoint.
        self.api_requests = Counter(
            "kmq_api_requests_total",
            "HTTP requests served, by method, route template and status code.",
            ["method", "route", "status"],
            registry=r,
        )
        self.api_request_seconds = Histogram(
            "kmq_api_request_seconds",
            "Time to serve one HTTP request, by route template.",
            ["route"],
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.api_actions = Counter(
            "kmq_api_actions_total",
            "Operator actions on messages, by action and outcome.",
            ["action", "outcome"],
            registry=r,
        )
        self.sidecar_markers = Counter(
            "kmq_sidecar_markers_total",
            "Markers written through the HTTP sidecar endpoint, by kind.",
            ["kind"],
            registry=r,
        )
        self.redrive_published = Counter(
            "kmq_redrive_published_total",
            "Dead letters republished by redrive jobs, by target topic.",
            ["topic"],
            registry=r,
        )
        self.redrive_batch_seconds = Histogram(
            "kmq_redrive_batch_seconds",
            "Time to produce one redrive batch and record it.",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )


def observe_times(histogram: Histogram, amount: float, times: int) -> None:
    """``histogram.observe(amount)``, ``times`` times over, in one step.

    The offsets of a claimed range share one due time, so one lateness: observing it once
    per offset cost 6 % of a burst round's CPU. prometheus_client has no call for it; this
    adds to the sum and to the one bucket its ``observe`` adds to (the unit test compares
    the two, so a client that changes its internals fails it).
    """
    if times <= 0:
        return
    histogram._raise_if_not_observable()  # type: ignore[no-untyped-call]
    histogram._sum.inc(amount * times)
    for i, bound in enumerate(histogram._upper_bounds):
        if amount <= bound:
            histogram._buckets[i].inc(times)
            break
