"""A broker outage of a minute leaves a log an operator can read: few lines, what and when.

A real ``kmq-tracker run`` (JSON logs) reaches the session's cluster through a
``support.kafka_proxy.KafkaProxy`` (so the outage is injectable on an external cluster too),
with messages in flight whose leases run out during the outage, so that redelivery keeps
trying to read their originals while the broker is away. The proxy drops every connection
for ``OUTAGE_S`` seconds, then lets them through again.

What must hold: the outage writes at most ``MAX_LINES`` log lines (aiokafka alone wrote
thousands: one per connection attempt); one of them says the broker went away, and one after
the heal says it answers again; the tracker is ready again and redelivers what came due.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from support.broker import delete_topics
from support.kafka_proxy import KafkaProxy
from support.tracker_run import TrackerRun, broker_down, ready

from tracker.client.marker_sink import KafkaMarkerSink
from tracker.ids import MessageId
from tracker.protocol import Marker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OUTAGE_S = 60.0
MAX_LINES = 20
MESSAGES = 20
GROUP = "outage-workers"

TopicFactory = Callable[..., Awaitable[str]]


async def test_a_minute_without_the_broker_writes_a_few_lines_that_say_what_happened(
    kafka_bootstrap: str, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    queue = await topic_factory(partitions=2, prefix="outage-queue")
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    proxy = KafkaProxy(kafka_bootstrap)
    proxy.start()
    run = TrackerRun(proxy.address, tmp_path)
    try:
        async with run:
            await run.wait_for_readiness("ready", ready)
            # Messages in flight whose leases end during the outage.
            sent = [await producer.send_and_wait(queue, b"job %d" % n) for n in range(MESSAGES)]
            sink = KafkaMarkerSink(producer, run.markers)
            await sink.start()
            lease = int(timedelta(seconds=15).total_seconds() * 1000)
            await sink.send_all(
                [
                    Marker.start(GROUP, MessageId(queue, m.partition, m.offset), timeout_ms=lease)
                    for m in sent
                ]
            )
            await wait_for_in_flight(run, queue, MESSAGES)

            before = len(run.stderr)
            proxy.drop()
            await run.wait_for_readiness("reporting the broker down", broker_down, within=30)
            await asyncio.sleep(OUTAGE_S)  # the scenario: an outage of this length
            during = run.stderr[before:]
            healed_at = len(run.stderr)
            proxy.resume()
            await run.wait_for_readiness("ready again", ready, within=60)
            await wait_for_in_flight(run, queue, 0, within=60)  # redelivered once back
            after = run.stderr[healed_at:]
            await run.stop_with(signal.SIGINT)
    finally:
        proxy.stop()
        await producer.stop()
        await delete_topics(kafka_bootstrap, [run.markers, f"{run.markers}.invalid"])

    print(f"\n[outage logs] {len(during)} lines in a {OUTAGE_S:.0f} s outage:")
    print("\n".join(during))
    assert proxy.errors == []
    assert len(during) <= MAX_LINES, f"{len(during)} lines in the outage:\n" + "\n".join(during)
    assert any("broker" in line and "no fetch response" in line for line in during), during
    assert any("broker answering again" in line for line in after), after


async def wait_for_in_flight(run: TrackerRun, topic: str, count: int, within: float = 30.0) -> None:
    """Until the tracker's API reports ``count`` messages of ``topic`` in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: object = None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{run.http_port}") as http:
        while True:
            run.check_alive()
            response = await http.get(f"/v1/topics/{topic}", timeout=5)
            if response.status_code == 200:
                last = response.json().get("in_flight")
                if last == count:
                    return
            assert loop.time() < deadline, f"in flight: {last}, not {count}:\n{run.log}"
            await asyncio.sleep(0.2)
