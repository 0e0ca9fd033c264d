"""The Kafka-aware fault-injection proxy (``support.kafka_proxy``) that lets the broker-outage
test run against an external cluster.

What the outage test relies on: every broker address a client learns (Metadata brokers, the
FindCoordinator coordinator) is one of the proxy's listeners, every other byte is unchanged,
a response it cannot rewrite is refused rather than passed on, and ``drop()``/``stall()`` cut a
client that has already learnt the cluster's layout (nothing goes around the proxy).
The integration tests run in front of the session's broker: tansu by default, the real cluster
with ``KAFKA_BOOTSTRAP_SERVERS``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.protocol.coordination import FindCoordinatorResponse_v0, FindCoordinatorResponse_v1
from aiokafka.protocol.metadata import (
    MetadataResponse_v0,
    MetadataResponse_v1,
    MetadataResponse_v5,
)
from aiokafka.structs import OffsetAndMetadata
from support.broker import TopicFactory, unique_topic
from support.kafka_proxy import (
    FIND_COORDINATOR,
    METADATA,
    RESPONSES,
    KafkaProxy,
    UnsupportedResponse,
    parse_bootstrap,
    rewrite_response,
)

BROKERS = [(1, "kafka-1.example", 9092), (2, "kafka-2.example", 9093)]
TOPICS: list[tuple[int, str, list[Any]]] = [
    (0, "orders", [(0, 0, 1, [1, 2], [1, 2]), (0, 1, 2, [2, 1], [2])])
]


def route_to(table: dict[tuple[str, int], int]) -> Callable[[str, int], Awaitable[tuple[str, int]]]:
    async def route(host: str, port: int) -> tuple[str, int]:
        return "127.0.0.1", table[(host, port)]

    return route


async def same(host: str, port: int) -> tuple[str, int]:
    return host, port


LOCAL = {("kafka-1.example", 9092): 41001, ("kafka-2.example", 9093): 41002}


def metadata_v0() -> bytes:
    return bytes(MetadataResponse_v0(BROKERS, TOPICS).encode())


def metadata_v1() -> bytes:
    brokers = [(*b, "rack-a") for b in BROKERS]
    topics = [(e, t, False, p) for e, t, p in TOPICS]
    return bytes(MetadataResponse_v1([(*brokers[0][:3], None), brokers[1]], 2, topics).encode())


def metadata_v5() -> bytes:
    brokers = [(*b, None) for b in BROKERS]
    topics = [(e, t, False, [(*p, list[int]()) for p in parts]) for e, t, parts in TOPICS]
    return bytes(MetadataResponse_v5(7, brokers, "cluster-x", 1, topics).encode())


@pytest.mark.unit
@pytest.mark.parametrize(
    ("version", "encoded", "cls"),
    [
        (0, metadata_v0, MetadataResponse_v0),
        (1, metadata_v1, MetadataResponse_v1),
        (5, metadata_v5, MetadataResponse_v5),
    ],
    ids=["v0", "v1", "v5"],
)
async def test_metadata_brokers_point_at_the_proxy_and_nothing_else_changes(
    version: int, encoded: Callable[[], bytes], cls: Any
) -> None:
    body = encoded()
    unchanged, count = await rewrite_response(METADATA, version, body, same)
    assert unchanged == body, "decode + encode must give back the same bytes"
    assert count == 2

    rewritten, _ = await rewrite_response(METADATA, version, body, route_to(LOCAL))
    before, after = cls.decode(body), cls.decode(rewritten)
    assert [(b[0], b[1], b[2]) for b in after.brokers] == [
        (1, "127.0.0.1", 41001),
        (2, "127.0.0.1", 41002),
    ]
    assert [b[3:] for b in after.brokers] == [b[3:] for b in before.brokers]  # racks
    for name in cls.SCHEMA.names:
        if name != "brokers":
            assert getattr(after, name) == getattr(before, name), name


@pytest.mark.unit
async def test_the_coordinator_points_at_the_proxy_unless_there_is_none() -> None:
    v0 = FindCoordinatorResponse_v0(0, 2, "kafka-2.example", 9093).encode()
    body, count = await rewrite_response(FIND_COORDINATOR, 0, v0, route_to(LOCAL))
    assert count == 1
    assert FindCoordinatorResponse_v0.decode(body) == FindCoordinatorResponse_v0(
        0, 2, "127.0.0.1", 41002
    )
    v1 = FindCoordinatorResponse_v1(5, 0, None, 1, "kafka-1.example", 9092).encode()
    body, _ = await rewrite_response(FIND_COORDINATOR, 1, v1, route_to(LOCAL))
    assert FindCoordinatorResponse_v1.decode(body) == FindCoordinatorResponse_v1(
        5, 0, None, 1, "127.0.0.1", 41001
    )
    # COORDINATOR_NOT_AVAILABLE (15): no address to route; passed on unchanged.
    missing = FindCoordinatorResponse_v1(0, 15, "not yet", -1, "", -1).encode()
    assert await rewrite_response(FIND_COORDINATOR, 1, missing, route_to({})) == (missing, 0)


@pytest.mark.unit
async def test_what_cannot_be_rewritten_is_refused_not_passed_on() -> None:
    for api_version in (6, 9, 12):  # Metadata versions aiokafka never sends (v9+: flexible)
        with pytest.raises(UnsupportedResponse, match="cannot be rewritten"):
            await rewrite_response(METADATA, api_version, metadata_v5(), same)
    with pytest.raises(UnsupportedResponse):
        await rewrite_response(FIND_COORDINATOR, 4, b"", same)
    with pytest.raises(UnsupportedResponse, match="decoded"):
        await rewrite_response(METADATA, 5, metadata_v5() + b"\x00", same)  # bytes left over
    with pytest.raises(ValueError, match=r"buffer"):  # truncated
        await rewrite_response(METADATA, 5, metadata_v5()[:-3], same)
    assert {key for key, _ in RESPONSES} == {METADATA, FIND_COORDINATOR}


@pytest.mark.unit
def test_bootstrap_lists_are_parsed() -> None:
    assert parse_bootstrap("a:1, b.example:9092") == [("a", 1), ("b.example", 9092)]
    assert parse_bootstrap("[::1]:9092") == [("::1", 9092)]
    with pytest.raises(ValueError, match="not host:port"):
        parse_bootstrap("kafka")


# -- in front of the session's broker -----------------------------------------------------------


@pytest.fixture
async def proxy(kafka_bootstrap: str) -> AsyncIterator[KafkaProxy]:
    async with KafkaProxy(kafka_bootstrap) as proxy:
        yield proxy
    assert proxy.errors == []


async def wait_for(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await condition():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.05)


@pytest.mark.integration
@pytest.mark.slow
async def test_clients_reach_the_cluster_only_through_the_proxy(
    proxy: KafkaProxy, topic_factory: TopicFactory
) -> None:
    topic = await topic_factory(partitions=2, prefix="kproxy")
    group = unique_topic("kproxy-group")
    tp = TopicPartition(topic, 0)
    async with (
        AIOKafkaProducer(
            bootstrap_servers=proxy.address, acks="all", request_timeout_ms=3000
        ) as producer,
        AIOKafkaConsumer(
            bootstrap_servers=proxy.address, group_id=group, enable_auto_commit=False
        ) as consumer,
    ):
        first = await producer.send_and_wait(topic, b"one", partition=0)
        consumer.assign([tp])
        consumer.seek(tp, first.offset)
        records = await consumer.getmany(tp, timeout_ms=10_000)
        assert [r.value for r in records.get(tp, [])][:1] == [b"one"]
        await consumer.commit({tp: OffsetAndMetadata(first.offset + 1, "")})  # coordinator
        assert await consumer.committed(tp) == first.offset + 1

        # Every address the clients know is a listener of the proxy.
        listeners = set(proxy.brokers.values())
        for client in (producer.client, consumer._client):
            known = {(b.host, b.port) for b in client.cluster.brokers()}
            assert known, "no brokers in the client's metadata"
            assert all(h == "127.0.0.1" and p in listeners for h, p in known), known
        # aiokafka connects to the coordinator by node id, through the (rewritten) metadata;
        # the FindCoordinator answer itself is rewritten too, for clients that use its address.
        coordinator = consumer._coordinator.coordinator_id
        assert coordinator is not None
        address = consumer._client.cluster.broker_metadata(coordinator)
        assert address is not None
        assert (address.host, address.port in listeners) == ("127.0.0.1", True), address
        assert proxy.rewritten_addresses >= 2

        # drop: clients that already know the cluster are cut off; nothing goes around.
        proxy.drop()
        with pytest.raises(KafkaError):
            await asyncio.wait_for(producer.send_and_wait(topic, b"lost", partition=1), 30)
        proxy.resume()
        again = await asyncio.wait_for(producer.send_and_wait(topic, b"two", partition=0), 30)
        assert again.offset > first.offset

        # stall: nothing moves until resume, then the send goes through.
        proxy.stall()
        sending = asyncio.ensure_future(producer.send(topic, b"held", partition=0))
        await asyncio.sleep(0)
        held = await sending
        done, _ = await asyncio.wait({held}, timeout=1.5)
        assert not done, "a produce completed while the proxy was stalled"
        proxy.resume()
        metadata = await asyncio.wait_for(held, 30)
        assert metadata.offset > again.offset

    async def every_link_closed() -> bool:
        return proxy.open_connections == 0

    await wait_for(every_link_closed, 10, "connections left open after the clients stopped")
