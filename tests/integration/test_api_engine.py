"""The API inside the tracker process (``engine_api_context``), against the real engine.

Markers written through the sidecar endpoint are ingested; "redeliver now" and "dead-letter
now" make the engine act at once; a dead letter is redriven back to its topic.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta

import httpx
import pytest

from api.app import create_app
from api.context import ApiContext
from tracker import headers as h
from tracker.engine.process import Tracker
from tracker.engine.redrive_runner import RedriveRunner
from tracker.headers import REDRIVE_JOB
from tracker.runtime import create_tracker, engine_api_context
from tracker.store.redrive_leases import RedriveLeaseStore

from .api_support import bearer, client_for
from .engine_support import TopicWatcher, eventually, tracker_settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TopicFactory = Callable[..., Awaitable[str]]
TOKEN = "engine-admin-token"  # noqa: S105 - a test fixture


@contextlib.asynccontextmanager
async def tracker_api(
    bootstrap: str, database_url: str, markers: str
) -> AsyncIterator[tuple[Tracker, ApiContext, httpx.AsyncClient]]:
    settings = tracker_settings(
        bootstrap,
        database_url,
        markers,
        api_token=TOKEN,
        default_policy={"processing_timeout": 600, "max_attempts": 5},
        claim_lease=timedelta(seconds=5),
    )
    async with create_tracker(settings) as tracker:
        context = engine_api_context(tracker)
        try:
            async with client_for(
                httpx.ASGITransport(app=create_app(context)), bearer(TOKEN)
            ) as client:
                yield tracker, context, client
        finally:
            await context.close()


async def test_the_api_drives_the_engine(
    kafka_bootstrap: str, topic_factory: TopicFactory, database_url: str
) -> None:
    topic = await topic_factory(partitions=2, prefix="queue")
    markers = await topic_factory(partitions=4, prefix="markers")
    group = f"workers-{topic}"
    async with tracker_api(kafka_bootstrap, database_url, markers) as (tracker, context, client):

        async def ready() -> bool:
            response = await client.get("/readyz")
            return response.status_code == 200

        await eventually(ready, within=30, what="readiness (markers partitions owned)")
        checks = (await client.get("/readyz")).json()["checks"]
        assert checks["partitions"]["ok"] is True

        async with TopicWatcher(kafka_bootstrap, topic) as watcher:
            producer = context.producer
            first = await (await producer.send(topic, b"job-1", key=b"k1", partition=0))
            second = await (await producer.send(topic, b"job-2", key=b"k2", partition=1))
            # A consumer without a Kafka producer of its own: START markers over HTTP.
            started = await client.post(
                "/v1/markers",
                json={
                    "markers": [
                        {
                            "kind": "start",
                            "group": group,
                            "topic": topic,
                            "partition": 0,
                            "offset": first.offset,
                            "timeout_ms": 600_000,
                            "consumer": "http-1",
                        },
                        {
                            "kind": "start",
                            "group": group,
                            "topic": topic,
                            "partition": 1,
                            "offset": second.offset,
                            "timeout_ms": 600_000,
                            "consumer": "http-1",
                        },
                    ]
                },
            )
            assert started.status_code == 200, started.text
            ids = [f"{group}/{topic}/0/{first.offset}", f"{group}/{topic}/1/{second.offset}"]

            async def tracked() -> bool:
                page = (await client.get("/v1/messages", params={"group": group})).json()
                return [m["id"] for m in page["items"]] == ids

            await eventually(tracked, within=15, what="the STARTs ingested")

            # Redeliver now: the engine republishes at once, not after the 10-minute lease.
            response = await client.post(f"/v1/messages/{ids[0]}/redeliver")
            assert response.status_code == 200, response.text
            [copy] = [
                r
                for r in await watcher.wait_for(
                    lambda rs: any(r.header(h.ORIGIN) for r in rs), within=15, what="the copy"
                )
                if r.header(h.ORIGIN)
            ]
            assert copy.header(h.ATTEMPT) == b"2"
            assert copy.value == b"job-1"

            # Dead-letter now: published to the DLQ with the operator's reason.
            response = await client.post(
                f"/v1/messages/{ids[1]}/dead-letter", json={"reason": "poison, confirmed"}
            )
            assert response.status_code == 200, response.text

            async def dead_lettered() -> bool:
                items = (await client.get("/v1/dlq", params={"topic": topic})).json()["items"]
                return len(items) == 1

            await eventually(dead_lettered, within=15, what="the dead letter")
            [dead] = (await client.get("/v1/dlq", params={"topic": topic})).json()["items"]
            assert "dead-lettered by admin: poison, confirmed" in dead["reason"]
            detail = (await client.get(f"/v1/messages/{ids[1]}")).json()
            assert detail["status"] == "dead_lettered"
            assert [e["kind"] for e in detail["markers"]["events"]] == ["start"]
            assert detail["payload"]["value"]["data"] == "job-2"
            assert any(hd["name"] == h.DLQ_REASON for hd in detail["payload"]["headers"])

            # Redrive it back to its topic.
            job = (
                await client.post("/v1/redrive-jobs", json={"ids": [dead["id"]], "rate": 10})
            ).json()
            runner = RedriveRunner(
                jobs=RedriveLeaseStore(context.store, context.settings.markers_topic),
                producer=context.producer,
                originals=tracker.originals,
                scanner=context.scanner,
                owner="tracker-test",
                metrics=tracker.metrics,
                poll_interval=0.05,
            )
            stopping = asyncio.Event()
            task = asyncio.create_task(runner.run(stopping))
            try:
                records = await watcher.wait_for(
                    lambda rs: any(r.header(REDRIVE_JOB) for r in rs), within=15, what="redrive"
                )
            finally:
                stopping.set()
                await task
            [redriven] = [r for r in records if r.header(REDRIVE_JOB)]
            assert redriven.header(REDRIVE_JOB) == str(job["id"]).encode()
            assert redriven.value == b"job-2"
            assert not any(name.startswith("kmq-dlq-") for name, _ in redriven.headers)

        metrics = (await client.get("/metrics")).text
        assert f'kmq_redeliveries_total{{topic="{topic}"}} 1.0' in metrics
        assert f'kmq_dead_lettered_total{{topic="{topic}"}} 1.0' in metrics
        assert 'kmq_sidecar_markers_total{kind="start"} 2.0' in metrics
        assert 'kmq_api_actions_total{action="dead_letter",outcome="applied"} 1.0' in metrics
        stats = (await client.get(f"/v1/topics/{topic}")).json()
        assert stats["dead_lettered"] == 1
