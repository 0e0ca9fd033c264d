"""The sidecar endpoint: markers over HTTP land on the markers topic, as the client writes them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from tracker.client.marker_sink import KafkaMarkerSink
from tracker.ids import MessageId
from tracker.partitioning import marker_key, markers_partition
from tracker.protocol import AnyMarker, Marker, decode_marker
from tracker.protocol_v2 import MAX_RANGE_WIDTH, RangeMarker

from .api_support import ApiEnv, api_env

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]
PARTITIONS = 4


@pytest.fixture
async def env(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> AsyncIterator[ApiEnv]:
    markers = await topic_factory(partitions=PARTITIONS, prefix="markers")
    async with api_env(kafka_bootstrap, database_url, markers) as env:
        yield env


async def read_markers(bootstrap: str, topic: str) -> list[tuple[int, bytes, AnyMarker]]:
    """Every record of the markers topic: (partition, key, decoded marker)."""
    async with AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False) as consumer:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[tuple[int, bytes, AnyMarker]] = []
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=200)
            idle = 0 if batch else idle + 1
            for records in batch.values():
                out += [(r.partition, r.key, decode_marker(r.value)) for r in records]
        return out


async def test_single_and_batched_markers_land_on_the_markers_topic(env: ApiEnv) -> None:
    client = env.client
    single = {
        "kind": "start",
        "group": "billing",
        "topic": "orders",
        "partition": 3,
        "offset": 42,
        "timeout_ms": 30_000,
        "consumer": "php-worker-1",
    }
    response = await client.post("/v1/markers", json=single)
    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": 1, "markers_topic": env.markers}
    batch: list[dict[str, Any]] = [
        {
            "kind": "extend",
            "group": "billing",
            "topic": "orders",
            "partition": 3,
            "offset": 42,
            "timeout_ms": 60_000,
        },
        {
            "kind": "delay",
            "group": "billing",
            "topic": "orders",
            "partition": 1,
            "offset": 900,
            "attempt": 2,
            "origin": "orders/3/42",
            "delay_ms": 5000,
            "reason": "timeout",
        },
        {
            "kind": "delay",
            "group": "billing",
            "topic": "orders",
            "partition": 3,
            "offset": 43,
            "reason": "busy",
        },
        {
            "kind": "delay",
            "group": "billing",
            "topic": "orders",
            "partition": 3,
            "offset": 44,
            "delay_ms": 3_600_000,
            "deferred": True,
        },
        {
            "kind": "reject",
            "group": "billing",
            "topic": "orders",
            "partition": 3,
            "offset": 45,
            "reason": "bad json",
        },
        {"kind": "ack", "group": "billing", "topic": "payments", "partition": 0, "offset": 7},
    ]
    response = await client.post("/v1/markers", json={"markers": batch})
    assert response.status_code == 200, response.text
    assert response.json()["accepted"] == len(batch)

    expected = [
        Marker.start(
            "billing", MessageId("orders", 3, 42), timeout_ms=30_000, consumer="php-worker-1"
        ),
        Marker.extend("billing", MessageId("orders", 3, 42), timeout_ms=60_000),
        Marker.delay(
            "billing",
            MessageId("orders", 1, 900),
            attempt=2,
            origin=MessageId("orders", 3, 42),
            delay_ms=5000,
            reason="timeout",
        ),
        Marker.delay("billing", MessageId("orders", 3, 43), reason="busy"),
        Marker.delay("billing", MessageId("orders", 3, 44), delay_ms=3_600_000, deferred=True),
        Marker.reject("billing", MessageId("orders", 3, 45), reason="bad json"),
        Marker.ack("billing", MessageId("payments", 0, 7)),
    ]
    found = await read_markers(env.bootstrap, env.markers)
    assert all(isinstance(m, Marker) for _, _, m in found), "the sidecar writes v1 markers"
    singles = [m for _, _, m in found if isinstance(m, Marker)]
    # Ordered within each markers partition; every marker on its origin's partition.
    assert sorted(singles, key=expected.index) == expected
    for partition, key, marker in found:
        assert partition == markers_partition(marker.origin_topic, marker.origin_partition, 4)
        assert key == marker_key(marker.origin_topic, marker.origin_partition)
    on_orders_3 = [m for m in singles if m.origin == MessageId("orders", 3, 42)]
    assert [m.kind.name for m in on_orders_3] == ["START", "EXTEND", "DELAY"]
    metrics = (await env.anonymous.get("/metrics")).text
    assert 'kmq_sidecar_markers_total{kind="delay"} 3.0' in metrics


async def test_invalid_markers_are_refused_and_nothing_is_written(env: ApiEnv) -> None:
    good = {"kind": "ack", "group": "billing", "topic": "orders", "partition": 0, "offset": 1}
    cases: list[tuple[Any, str]] = [
        ({**good, "kind": "nack"}, "kind"),
        ({**good, "topic": "bad topic"}, "topic"),
        ({**good, "offset": -1}, "offset"),
        ({**good, "group": ""}, "group"),
        ({**good, "attempt": 2}, "must name its origin"),
        ({**good, "origin": "orders/0/1", "attempt": 2}, "origin"),  # origin equals the record
        ({**good, "origin": "not-an-id"}, "origin"),
        ({**good, "timeout_ms": 5}, "timeout_ms applies to start and extend"),
        ({**good, "kind": "extend"}, "needs timeout_ms"),
        ({**good, "kind": "start", "reason": "x"}, "reason applies"),
        ({**good, "kind": "delay", "deferred": True}, "needs delay_ms"),
        ({**good, "kind": "delay", "delay_ms": 10**15}, "delay_ms"),
        ({**good, "kind": "reject", "reason": "bad \u0000 byte"}, "NUL character"),
        ({**good, "unknown": 1}, "unknown"),
        ({"markers": []}, "markers"),
        ({"markers": [good, {**good, "partition": "zero"}]}, "markers.1"),
        ([good], "body"),
    ]
    for body, expected in cases:
        response = await env.client.post("/v1/markers", json=body)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["error"] == "validation_error"
        assert expected in response.json()["detail"], (body, response.json()["detail"])
    # The protocol's own checks, with the position in the batch.
    response = await env.client.post(
        "/v1/markers", json={"markers": [good, {**good, "attempt": 2, "origin": "orders/0/1"}]}
    )
    assert response.status_code == 422
    assert response.json()["detail"].startswith("markers[1]: ")
    assert await read_markers(env.bootstrap, env.markers) == []


async def test_range_markers_land_as_protocol_v2_in_order_with_per_message_ones(
    env: ApiEnv,
) -> None:
    """A sidecar consumer tracks a whole fetched batch with two requests, not two per message."""
    where = {"group": "billing", "topic": "orders", "partition": 2}
    batch: list[dict[str, Any]] = [
        {
            **where,
            "kind": "range_start",
            "first_offset": 100,
            "last_offset": 199,
            "except_offsets": [150],  # a copy, tracked per message
            "timeout_ms": 30_000,
            "consumer": "go-worker-1",
        },
        {**where, "kind": "start", "offset": 150, "timeout_ms": 30_000},
        {**where, "kind": "reject", "offset": 120, "reason": "bad json"},
        {
            **where,
            "kind": "range_extend",
            "first_offset": 100,
            "last_offset": 199,
            "except_offsets": [150],
            "timeout_ms": 60_000,
        },
        {
            **where,
            "kind": "range_settle",
            "first_offset": 100,
            "last_offset": 199,
            "except_offsets": [120, 150, 151],
        },
    ]
    response = await env.client.post("/v1/markers", json={"markers": batch})
    assert response.status_code == 200, response.text
    response = await env.client.post(
        "/v1/markers",
        json={**where, "kind": "range_settle", "first_offset": 151, "last_offset": 151},
    )
    assert response.status_code == 200, response.text

    no_copy = 1 << 50
    expected: list[AnyMarker] = [
        RangeMarker.start(
            "billing",
            "orders",
            2,
            100,
            199,
            exceptions=no_copy,
            timeout_ms=30_000,
            consumer="go-worker-1",
        ),
        Marker.start("billing", MessageId("orders", 2, 150), timeout_ms=30_000),
        Marker.reject("billing", MessageId("orders", 2, 120), reason="bad json"),
        RangeMarker.extend("billing", "orders", 2, 100, 199, exceptions=no_copy, timeout_ms=60_000),
        RangeMarker.settle(
            "billing", "orders", 2, 100, 199, exceptions=no_copy | 1 << 20 | 1 << 51
        ),
        RangeMarker.settle("billing", "orders", 2, 151, 151),
    ]
    found = await read_markers(env.bootstrap, env.markers)
    # All on the markers partition of orders/2, in the order written.
    assert [marker for _, _, marker in found] == expected
    assert {partition for partition, _, _ in found} == {markers_partition("orders", 2, PARTITIONS)}
    metrics = (await env.anonymous.get("/metrics")).text
    assert 'kmq_sidecar_markers_total{kind="range_settle"} 2.0' in metrics
    assert 'kmq_sidecar_markers_total{kind="range_start"} 1.0' in metrics


async def test_invalid_range_markers_are_refused_and_nothing_is_written(env: ApiEnv) -> None:
    good = {
        "kind": "range_settle",
        "group": "billing",
        "topic": "orders",
        "partition": 0,
        "first_offset": 10,
        "last_offset": 19,
    }
    cases: list[tuple[Any, str]] = [
        ({**good, "kind": "range_nack"}, "kind"),
        ({**good, "last_offset": 9}, "last_offset must not be below first_offset"),
        ({**good, "first_offset": -1}, "first_offset"),
        ({**good, "except_offsets": [-3]}, "except_offsets"),
        ({**good, "timeout_ms": 5}, "timeout_ms applies to range_start and range_extend"),
        ({**good, "kind": "range_extend"}, "needs timeout_ms"),
        ({**good, "consumer": "x"}, "consumer applies to range_start"),
        ({**good, "offset": 12}, "offset"),  # a v1 field on a range marker
        ({"markers": [good, {**good, "partition": "zero"}]}, "markers.1"),
    ]
    for body, expected in cases:
        response = await env.client.post("/v1/markers", json=body)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["error"] == "validation_error"
        assert expected in response.json()["detail"], (body, response.json()["detail"])
    # The protocol's own checks, with the position in the batch.
    protocol_cases: list[tuple[dict[str, Any], str]] = [
        ({**good, "except_offsets": [20]}, "markers[1]: except_offsets: 20 is outside 10..19"),
        ({**good, "last_offset": 10 + MAX_RANGE_WIDTH}, "markers[1]: a range of"),
    ]
    for marker, expected in protocol_cases:
        response = await env.client.post("/v1/markers", json={"markers": [good, marker]})
        assert response.status_code == 422, (marker, response.text)
        assert response.json()["detail"].startswith(expected), response.json()["detail"]
    assert await read_markers(env.bootstrap, env.markers) == []


async def test_broker_failure_is_503(env: ApiEnv) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=env.bootstrap)
    await producer.start()
    sink = KafkaMarkerSink(producer, env.markers)
    await sink.start()
    await producer.stop()  # the broker connection is gone
    env.context.markers = sink
    response = await env.client.post(
        "/v1/markers",
        json={"kind": "ack", "group": "billing", "topic": "orders", "partition": 0, "offset": 1},
    )
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "unavailable"
    assert "not acknowledged" in response.json()["detail"]
