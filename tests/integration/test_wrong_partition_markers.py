"""Markers on the wrong markers partition: refused, parked, counted, visible in the API.

A writer must put every marker about an origin on that origin's markers partition
(docs/protocol.md, "A marker on the wrong partition"). A raw producer here writes a START and
an ACK elsewhere, each next to valid traffic for the same origin partition: the tracker must
park both with the reason ``wrong_partition``, count them in ``kmq_markers_invalid_total``
(also on the API's ``/metrics``), apply neither, and apply the valid markers as usual.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from support.counts import assert_counters_match

from api.app import create_app
from tracker.client.marker_sink import KafkaMarkerSink
from tracker.domain.entries import State
from tracker.engine.process import Tracker
from tracker.headers import INVALID_CATEGORY, INVALID_REASON, INVALID_SOURCE
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import Marker, decode_marker, encode_marker
from tracker.runtime import create_tracker, engine_api_context
from tracker.store.dialects import create_engine

from .api_support import bearer, client_for
from .engine_support import TopicWatcher, eventually, high_watermarks, tracker_settings

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]
TOKEN = "wrong-partition-token"  # noqa: S105 - a test fixture
MARKERS_PARTITIONS = 4
LEASE_MS = 600_000  #: nothing falls due while the test runs


@contextlib.asynccontextmanager
async def tracker_api(
    bootstrap: str, database_url: str, markers: str
) -> AsyncIterator[tuple[Tracker, httpx.AsyncClient]]:
    settings = tracker_settings(
        bootstrap,
        database_url,
        markers,
        markers_partitions=MARKERS_PARTITIONS,
        api_token=TOKEN,
        default_policy={"processing_timeout": 600, "max_attempts": 5},
    )
    async with create_tracker(settings) as tracker:
        context = engine_api_context(tracker)
        try:
            async with client_for(
                httpx.ASGITransport(app=create_app(context)), bearer(TOKEN)
            ) as client:
                yield tracker, client
        finally:
            await context.close()
    # Stopped: whatever the engine wrote, the entry counters match the entries.
    engine = create_engine(database_url)
    try:
        await assert_counters_match(engine)
    finally:
        await engine.dispose()


def invalid_total(metrics_text: str, reason: str) -> float:
    found = re.search(
        rf'^kmq_markers_invalid_total\{{reason="{reason}"\}} (\S+)$', metrics_text, re.MULTILINE
    )
    return float(found.group(1)) if found else 0.0


async def test_markers_on_the_wrong_partition_are_parked_and_counted_not_applied(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> None:
    topic = await topic_factory(partitions=2, prefix="queue")
    markers = await topic_factory(partitions=MARKERS_PARTITIONS, prefix="markers")
    invalid = f"{markers}.invalid"
    group = f"workers-{topic}"
    right = markers_partition(topic, 0, MARKERS_PARTITIONS)
    wrong = (right + 1) % MARKERS_PARTITIONS
    # Messages of queue partition 0 (no record needs to exist: nothing falls due).
    acked_elsewhere = MessageId(topic, 0, 1)  # START on the wrong partition, ACK on the right
    started = MessageId(topic, 0, 2)  # START on the right partition, ACK on the wrong one
    done = MessageId(topic, 0, 3)  # START and ACK on the right partition
    open_ = MessageId(topic, 0, 4)  # START on the right partition
    misplaced_start = Marker.start(group, acked_elsewhere, timeout_ms=LEASE_MS, consumer="bad")
    misplaced_ack = Marker.ack(group, started)

    raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await raw.start()
    try:
        sink = KafkaMarkerSink(raw, markers)
        async with tracker_api(kafka_bootstrap, database_url, markers) as (tracker, client):

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await eventually(ready, within=30, what="readiness (markers partitions owned)")

            # The right key, the wrong partition: the partition is what orders markers.
            key = marker_key(topic, 0)
            bad_start = await raw.send_and_wait(
                markers, encode_marker(misplaced_start), key=key, partition=wrong
            )
            await sink.send_all(
                [
                    Marker.ack(group, acked_elsewhere),
                    Marker.start(group, started, timeout_ms=LEASE_MS, consumer="good"),
                    Marker.start(group, done, timeout_ms=LEASE_MS, consumer="good"),
                    Marker.ack(group, done),
                    Marker.start(group, open_, timeout_ms=LEASE_MS, consumer="good"),
                ]
            )
            bad_ack = await raw.send_and_wait(
                markers, encode_marker(misplaced_ack), key=key, partition=wrong
            )

            ends = await high_watermarks(kafka_bootstrap, markers)
            assert ends[wrong] == 2
            assert ends[right] == 5

            async def all_applied() -> bool:
                applied = await tracker.store.partition_offsets(markers)
                return all(applied.get(p, (0, -1))[1] >= end for p, end in ends.items() if end)

            await eventually(all_applied, within=30, what="every marker read and applied")
            async with TopicWatcher(kafka_bootstrap, invalid) as watcher:
                # Two refused, plus the ACK that found no START (an anomaly, parked after).
                parked = await watcher.wait_for(lambda r: len(r) == 3, what="3 parked markers")

            # Neither misplaced marker was applied; the valid ones were, as usual.
            assert await tracker.store.get_entry((group, topic, 0, acked_elsewhere.offset)) is None
            entry = await tracker.store.get_entry((group, topic, 0, started.offset))
            assert entry is not None, "the ACK on the wrong partition settled its message"
            assert (entry.state, entry.markers_partition) == (State.IN_FLIGHT, right)
            assert await tracker.store.get_entry((group, topic, 0, done.offset)) is None
            entry = await tracker.store.get_entry((group, topic, 0, open_.offset))
            assert entry is not None
            assert (entry.state, entry.markers_partition) == (State.IN_FLIGHT, right)

            # Counted, in the engine's metrics and on the API's /metrics.
            m = tracker.metrics
            assert m.markers_invalid.labels("wrong_partition")._value.get() == 2
            assert m.markers_ingested.labels("START")._value.get() == 3
            assert m.markers_ingested.labels("ACK")._value.get() == 2
            assert m.marker_anomalies._value.get() == 1
            response = await client.get("/metrics")
            assert response.status_code == 200, response.text
            assert invalid_total(response.text, "wrong_partition") == 2
            assert invalid_total(response.text, "malformed") == 0

            # The API tracks exactly the messages whose markers were valid.
            listed = await client.get("/v1/messages", params={"group": group})
            assert listed.status_code == 200, listed.text
            assert [item["id"] for item in listed.json()["items"]] == [
                f"{group}/{topic}/0/{started.offset}",
                f"{group}/{topic}/0/{open_.offset}",
            ]
            detail = await client.get(f"/v1/messages/{group}/{topic}/0/{started.offset}")
            assert detail.status_code == 200, detail.text
            assert detail.json()["entry"]["markers_partition"] == right
            gone = await client.get(f"/v1/messages/{group}/{topic}/0/{acked_elsewhere.offset}")
            assert gone.status_code == 404, gone.text
    finally:
        await raw.stop()

    assert {r.header(INVALID_CATEGORY) for r in parked} == {b"anomaly", b"wrong_partition"}
    refused = sorted(
        (r for r in parked if r.header(INVALID_CATEGORY) == b"wrong_partition"),
        key=lambda r: r.header(INVALID_SOURCE) or b"",
    )
    assert [r.header(INVALID_SOURCE) for r in refused] == [
        f"{markers}/{wrong}/{bad_start.offset}".encode(),
        f"{markers}/{wrong}/{bad_ack.offset}".encode(),
    ]
    assert [decode_marker(r.value or b"") for r in refused] == [misplaced_start, misplaced_ack]
    for record in refused:
        reason = (record.header(INVALID_REASON) or b"").decode()
        assert f"on markers partition {wrong}" in reason, reason
        assert f"belong on partition {right} of {MARKERS_PARTITIONS}" in reason, reason
    [anomaly] = [r for r in parked if r.header(INVALID_CATEGORY) == b"anomaly"]
    assert b"ACK without START" in (anomaly.header(INVALID_REASON) or b"")
