"""The message and dead-letter views while Kafka does not answer: bounded by a setting.

The API's Kafka clients reach the broker only through a :class:`support.kafka_proxy.KafkaProxy`
(it rewrites the advertised broker addresses, so every connection goes through it, on tansu
and on an external cluster alike). The test **stalls** it: connections are accepted and
nothing is forwarded, a black-holed network, where these views used to take 30 s (payload) +
30 s (marker history) to answer. Then it heals the network and the payload is read again.
Topics and records are made through the real bootstrap address, rows written to the store
directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from support.kafka_proxy import KafkaProxy

from tracker.client.marker_sink import KafkaMarkerSink
from tracker.ids import MessageId
from tracker.partitioning import markers_partition
from tracker.protocol import Marker

from .api_support import ApiEnv, api_env, entry, insert_dead_letters, insert_entries, produce
from .engine_support import eventually

pytestmark = [pytest.mark.integration]

TopicFactory = Callable[..., Awaitable[str]]

BOUND = 2.0  #: api_kafka_read_timeout (the default, set explicitly)
SLACK = 1.5  #: what a loaded test machine may add to it


@pytest.fixture
async def proxy(kafka_bootstrap: str) -> AsyncIterator[KafkaProxy]:
    async with KafkaProxy(kafka_bootstrap) as proxy:
        yield proxy
    assert proxy.errors == [], "responses the proxy could not rewrite (clients went around it)"


async def timed_get(client: httpx.AsyncClient, path: str) -> tuple[float, dict[str, Any]]:
    started = time.monotonic()
    response = await client.get(path)
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body, dict)
    return elapsed, body


async def test_views_answer_within_the_bound_while_kafka_does_not(
    proxy: KafkaProxy, kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> None:
    topic = await topic_factory(partitions=1, prefix="orders")
    dlq = await topic_factory(partitions=1, prefix="orders-dlq")
    markers = await topic_factory(partitions=4, prefix="markers")
    [(_, offset)] = await produce(kafka_bootstrap, topic, [(b"k", b'{"id": 1}', [])])
    [(_, dlq_offset)] = await produce(kafka_bootstrap, dlq, [(b"k", b"poison", [])])
    async with api_env(proxy.address, database_url, markers, api_kafka_read_timeout=BOUND) as env:
        tracked = f"/v1/messages/billing/{topic}/0/{offset}"
        dead = "/v1/messages/billing/orders/0/77"  # only dead-lettered: no entry
        mp = markers_partition(topic, 0, 4)
        await insert_entries(env.context, [entry(offset, topic=topic, markers_partition=mp)])
        [dead_id] = await insert_dead_letters(
            env.context, [{"origin_offset": 77, "dlq_topic": dlq, "dlq_offset": dlq_offset}]
        )
        dead_letter = f"/v1/dlq/{dead_id}"
        sink = KafkaMarkerSink(env.context.markers._producer, env.markers)
        await sink.send_all(
            [Marker.start("billing", MessageId(topic, 0, offset), timeout_ms=30_000)]
        )

        async def everything_read() -> bool:
            """Every view has its payload and (message views) its marker history."""
            views = [(await timed_get(env.client, path))[1] for path in (tracked, dead)]
            dlq_view = (await timed_get(env.client, dead_letter))[1]
            return (
                all(v["payload"] is not None and v["markers"] is not None for v in views)
                and dlq_view["payload"] is not None
            )

        await eventually(everything_read, within=30, what="the views with Kafka answering")
        _, body = await timed_get(env.client, tracked)
        assert body["payload"]["value"]["data"] == '{"id": 1}'
        assert [e["kind"] for e in body["markers"]["events"]] == ["start"]

        proxy.stall()
        first, body = await timed_get(env.client, tracked)
        # The store's data, and what Kafka did not serve.
        assert body["status"] == "in_flight"
        assert body["entry"]["id"] == f"billing/{topic}/0/{offset}"
        assert body["payload"] is None
        assert body["payload_error"] == f"Kafka did not answer within {BOUND:g} s"
        assert body["markers"] is None
        assert body["markers_error"] == (
            f"marker history unavailable: Kafka did not answer within {BOUND:g} s"
        )
        assert BOUND * 0.9 <= first < BOUND + SLACK, f"answered after {first:.2f} s"

        # The reads that timed out go on in the background (not cancelled half-way). Requests
        # meanwhile start no more of them: a reload joins its read, other records answer at
        # once. Many at the same time, as a dashboard would send them.
        burst = [tracked, dead, dead_letter] * 4
        started = time.monotonic()
        answers = await asyncio.gather(*(timed_get(env.client, path) for path in burst))
        whole = time.monotonic() - started
        for path, (elapsed, view) in zip(burst, answers, strict=True):
            assert elapsed < BOUND + SLACK, f"{path} answered after {elapsed:.2f} s"
            assert view["payload"] is None, path
            assert view["payload_error"].startswith(f"Kafka did not answer within {BOUND:g} s")
            if path == dead_letter:
                assert view["dead_letter"]["id"] == dead_id
            else:
                assert view["markers"] is None, path
                assert "Kafka did not answer" in view["markers_error"]
        assert answers[1][1]["status"] == "dead_lettered"
        # The two reads of the first request, nothing more.
        reads = env.context.reads
        assert (reads.payloads.pending, reads.history.pending) == (1, 1)
        slowest = max(elapsed for elapsed, _ in answers)

        proxy.resume()
        healed = time.monotonic()
        await eventually(everything_read, within=30, what="the payloads read again after the heal")
        recovered = time.monotonic() - healed
        await eventually(
            lambda: reads.payloads.pending == reads.history.pending == 0,
            within=30,
            what="no read left running",
        )

        # The broker gone (connections refused): the payload read fails at once, the marker
        # history's used to wait 30 s for a fetch response.
        proxy.drop()
        dropped, body = await timed_get(env.client, tracked)
        assert dropped < BOUND + SLACK, f"answered after {dropped:.2f} s"
        assert body["entry"]["id"] == f"billing/{topic}/0/{offset}"
        assert body["payload"] is None
        assert body["markers"] is None
        assert body["payload_error"].startswith("Kafka"), body["payload_error"]
        assert body["markers_error"].startswith("marker history unavailable: ")
        proxy.resume()
        await eventually(everything_read, within=30, what="the payloads read again after the drop")
        print(
            f"\ndegraded reads ({database_url.partition(':')[0]}, bound {BOUND:g} s): stalled: "
            f"first answer {first:.2f} s, {len(burst)} concurrent requests in {whole:.2f} s "
            f"(slowest {slowest:.2f} s), payloads and markers read again {recovered:.2f} s "
            f"after the heal; dropped: {dropped:.2f} s ({body['payload_error']!r}, "
            f"{body['markers_error']!r})"
        )


async def test_the_bound_is_the_setting(
    proxy: KafkaProxy, kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    """A shorter bound, on the dead-letter view: answered after it, not after the default."""
    bound = 0.5
    dlq = await topic_factory(partitions=1, prefix="orders-dlq")
    markers = await topic_factory(partitions=1, prefix="markers")
    [(_, dlq_offset)] = await produce(kafka_bootstrap, dlq, [(b"k", b"poison", [])])
    async with api_env(proxy.address, sqlite_url, markers, api_kafka_read_timeout="500ms") as env:
        [dead_id] = await insert_dead_letters(
            env.context, [{"dlq_topic": dlq, "dlq_offset": dlq_offset}]
        )
        await expect_payload(env, f"/v1/dlq/{dead_id}", "poison")
        proxy.stall()
        elapsed, body = await timed_get(env.client, f"/v1/dlq/{dead_id}")
        assert body["payload_error"] == f"Kafka did not answer within {bound:g} s"
        assert body["dead_letter"]["dlq"]["offset"] == dlq_offset
        assert bound * 0.9 <= elapsed < bound + SLACK, f"answered after {elapsed:.2f} s"
        proxy.resume()
        await expect_payload(env, f"/v1/dlq/{dead_id}", "poison")


async def expect_payload(env: ApiEnv, path: str, value: str) -> None:
    async def shown() -> bool:
        payload = (await timed_get(env.client, path))[1]["payload"]
        return payload is not None and payload["value"]["data"] == value

    await eventually(shown, within=30, what=f"the payload of {path}")


async def test_closing_with_reads_outstanding(
    proxy: KafkaProxy, kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    """Shutting the API down in an outage does not wait for its abandoned reads."""
    dlq = await topic_factory(partitions=1, prefix="orders-dlq")
    markers = await topic_factory(partitions=1, prefix="markers")
    [(_, dlq_offset)] = await produce(kafka_bootstrap, dlq, [(b"k", b"poison", [])])
    async with api_env(proxy.address, sqlite_url, markers, api_kafka_read_timeout=0.5) as env:
        [dead_id] = await insert_dead_letters(
            env.context, [{"dlq_topic": dlq, "dlq_offset": dlq_offset}]
        )
        await expect_payload(env, f"/v1/dlq/{dead_id}", "poison")
        proxy.stall()
        body = (await timed_get(env.client, f"/v1/dlq/{dead_id}"))[1]
        assert body["payload"] is None
        assert env.context.reads.payloads.pending == 1
        closing = time.monotonic()
    closed = time.monotonic() - closing
    assert closed < 5, f"closing took {closed:.2f} s"
    print(f"\nclosed in {closed:.2f} s with a read outstanding")
