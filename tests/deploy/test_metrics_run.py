"""After a short real run, ``/metrics`` exposes every metric docs/observability.md documents.

A tracker runs on the test broker with SQLite; markers drive every engine path that has a
metric (coalesced START+ACK, an expired lease, a reject, a missing original, a malformed
marker, an ACK without START, messages still in flight and delayed); then the admin API,
sharing the tracker's registry, serves ``/metrics`` over ASGI, as the probes and Prometheus
see it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import docs_config
import httpx
import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from tracker.client.marker_sink import KafkaMarkerSink
from tracker.ids import MessageId
from tracker.metrics import Metrics
from tracker.protocol import Marker
from tracker.runtime import create_tracker, engine_api_context
from tracker.settings import TrackerSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TopicFactory = Callable[..., Awaitable[str]]
GROUP = "metrics-workers"


def documented_metrics() -> dict[str, str]:
    """Metric name -> type, as listed in the committed docs/observability.md table."""
    text = docs_config.OBSERVABILITY_MD.read_text(encoding="utf-8")
    block = text.split(docs_config.METRICS_BEGIN)[1].split(docs_config.METRICS_END)[0]
    return dict(re.findall(r"^\| `(kmq_[a-z0-9_]+)` \| (\w+) \|", block, re.M))


async def eventually(check: Callable[[], bool], what: str, within: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


async def test_metrics_endpoint_exposes_every_documented_metric(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    documented = documented_metrics()
    assert len(documented) == len(list(Metrics().registry.collect())) >= 20

    topic = await topic_factory(partitions=1, prefix="queue")
    markers = await topic_factory(partitions=2, prefix="markers")
    settings = TrackerSettings(
        kafka_bootstrap_servers=kafka_bootstrap,
        database_url=sqlite_url,
        markers_topic=markers,
        tracker_group=f"tracker-{markers}",
        markers_partitions=2,
        migrate_on_start=True,
        coalesce_window=timedelta(milliseconds=300),
        ack_grace=timedelta(milliseconds=200),
        max_idle_sleep=timedelta(seconds=2),
        default_policy={"processing_timeout": 60, "max_attempts": 3},
        api_token="metrics-test-token",  # noqa: S106 - a test value
        http_port=0,
    )
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(topic, f"job-{i}".encode(), partition=0)
        sink = KafkaMarkerSink(producer, markers)
        at = [MessageId(topic, 0, offset) for offset in range(5)]
        async with create_tracker(settings) as tracker:
            m = tracker.metrics
            await sink.send_all(
                [
                    Marker.start(GROUP, at[0], timeout_ms=30_000),  # START + ACK: coalesced
                    Marker.ack(GROUP, at[0]),
                    Marker.start(GROUP, at[1], timeout_ms=300),  # lease expires: redelivered
                    Marker.start(GROUP, at[2], timeout_ms=30_000),  # poison: dead-lettered
                    Marker.reject(GROUP, at[2], reason="bad json"),
                    Marker.start(GROUP, at[3], timeout_ms=600_000),  # stays in flight
                    Marker.delay(GROUP, at[4], delay_ms=600_000, reason="later"),  # delayed
                    Marker.ack(GROUP, MessageId(topic, 0, 77)),  # an ACK without START
                    Marker.start(GROUP, MessageId(topic, 0, 10_000), timeout_ms=300),  # lost
                ]
            )
            await producer.send_and_wait(markers, b"\x01\x02garbage", partition=0)

            await eventually(lambda: value(m, "kmq_redeliveries_total", topic=topic) >= 1, "copy")
            await eventually(lambda: value(m, "kmq_dead_lettered_total", topic=topic) >= 1, "DLQ")
            await eventually(lambda: value(m, "kmq_lost_total", topic=topic) >= 1, "lost")
            await eventually(
                lambda: value(m, "kmq_markers_invalid_total", reason="malformed") >= 1, "invalid"
            )

            context = engine_api_context(tracker)
            try:
                transport = httpx.ASGITransport(app=create_app(context))
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://kmq.test"
                ) as client:
                    assert (await client.get("/healthz")).status_code == 200
                    response = await client.get("/metrics")
            finally:
                await context.close()
    finally:
        await producer.stop()

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}

    def exposed_name(name: str, kind: str) -> str:
        return name.removesuffix("_total") if kind == "counter" else name

    missing = [n for n, k in documented.items() if exposed_name(n, k) not in families]
    assert missing == [], f"documented but not exposed: {missing}"
    for name, kind in documented.items():
        assert families[exposed_name(name, kind)].type == kind, name

    def samples(name: str, **labels: str) -> list[float]:
        family = families[name]
        return [
            s.value
            for s in family.samples
            if all(s.labels.get(k) == v for k, v in labels.items())
            and not s.name.endswith("_created")
        ]

    # The run really went through the paths the metrics describe.
    assert sum(samples("kmq_markers_ingested", kind="START")) == 5
    assert sum(samples("kmq_markers_coalesced")) >= 1
    assert sum(samples("kmq_marker_anomalies")) >= 1
    assert sum(samples("kmq_redeliveries", topic=topic)) >= 1
    assert sum(samples("kmq_dead_lettered", topic=topic)) == 1
    assert sum(samples("kmq_lost", topic=topic)) == 1
    assert samples("kmq_tracked_messages", topic=topic, state="in_flight") == [1.0]
    assert samples("kmq_tracked_messages", topic=topic, state="delayed") == [1.0]
    assert samples("kmq_tracked_messages", topic=topic, state="lost") == [1.0]
    assert samples("kmq_dead_letters", topic=topic) == [1.0]
    assert samples("kmq_oldest_in_flight_age_seconds", topic=topic)[0] >= 0
    assert 0 < samples("kmq_next_delayed_due_seconds", topic=topic)[0] <= 600
    lateness_count = [
        s.value
        for s in families["kmq_redelivery_lateness_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert lateness_count
    assert lateness_count[0] >= 1
    requests: list[Any] = samples("kmq_api_requests", route="/healthz")
    assert sum(requests) >= 1
    assert samples("kmq_owned_markers_partitions") == [2.0]
