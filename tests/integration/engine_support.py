"""Helpers for tracker engine tests: settings for an isolated tracker, a topic watcher."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from support.broker import topic_partition_ids

from tracker.client import KmqConsumer
from tracker.headers import Headers
from tracker.settings import TrackerSettings

FAST_GROUP = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


def tracker_settings(
    bootstrap: str, database_url: str, markers_topic: str, **overrides: Any
) -> TrackerSettings:
    """Settings for a tracker isolated from other tests (own markers topic and group)."""
    values: dict[str, Any] = {
        "kafka_bootstrap_servers": bootstrap,
        "database_url": database_url,
        "markers_topic": markers_topic,
        "tracker_group": f"tracker-{markers_topic}",
        "markers_partitions": 4,
        "migrate_on_start": True,
        "coalesce_window": timedelta(milliseconds=300),
        "ack_grace": timedelta(milliseconds=200),
        "max_idle_sleep": timedelta(seconds=5),
        "kafka_client_config": {},
        "http_port": 0,  # the HTTP API runs too, on a free port
        "default_policy": {"processing_timeout": 2, "max_attempts": 3},
    }
    values.update(overrides)
    return TrackerSettings(**values)


def consumer(bootstrap: str, topic: str, group: str, markers: str, **kw: Any) -> KmqConsumer:
    kw.setdefault("consumer_config", dict(FAST_GROUP))
    return KmqConsumer(
        topic, group_id=group, bootstrap_servers=bootstrap, markers_topic=markers, **kw
    )


@dataclass(frozen=True)
class Seen:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: Headers

    def header(self, name: str) -> bytes | None:
        for key, value in reversed(self.headers):
            if key == name:
                return value
        return None


class TopicWatcher:
    """Reads topics from the beginning in the background and keeps every record."""

    def __init__(self, bootstrap: str, *topics: str) -> None:
        self._bootstrap = bootstrap
        self._topics = topics
        self.records: list[Seen] = []
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def __aenter__(self) -> TopicWatcher:
        consumer = AIOKafkaConsumer(bootstrap_servers=self._bootstrap, enable_auto_commit=False)
        await consumer.start()
        tps: list[Any] = []
        for topic in self._topics:
            partitions = await topic_partition_ids(self._bootstrap, topic, within=20)
            tps += [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._read(consumer))
        return self

    async def _read(self, consumer: Any) -> None:
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    for r in records:
                        self.records.append(
                            Seen(
                                r.topic,
                                r.partition,
                                r.offset,
                                r.timestamp,
                                r.key,
                                r.value,
                                tuple(r.headers),
                            )
                        )
                if batch:
                    self._changed.set()
        finally:
            await consumer.stop()

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def on(self, topic: str) -> list[Seen]:
        return [r for r in self.records if r.topic == topic]

    async def read_to_end(self, topic: str, within: float = 30.0) -> list[Seen]:
        """Wait until the watcher holds every record ``topic`` has now, and return them.

        Call it before counting what is in a topic: the background reader can be a fetch or
        two behind the broker (a fetch waits up to its ``fetch_max_wait_ms`` for data), and a
        copy produced just before the count would otherwise go unseen.
        """
        ends = await high_watermarks(self._bootstrap, topic, within=within)

        def holds_all(records: list[Seen]) -> bool:
            last: dict[int, int] = {}
            for r in records:
                if r.topic == topic and r.offset >= last.get(r.partition, -1):
                    last[r.partition] = r.offset
            return all(last.get(p, -1) + 1 >= end for p, end in ends.items())

        await self.wait_for(holds_all, within=within, what=f"the watcher to read {topic} to {ends}")
        return self.on(topic)

    async def wait_for(
        self, predicate: Callable[[list[Seen]], bool], within: float = 30.0, what: str = ""
    ) -> list[Seen]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not predicate(self.records):
            remaining = deadline - loop.time()
            assert remaining > 0, f"timed out waiting for {what or predicate}"
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))
        return self.records


async def high_watermarks(bootstrap: str, topic: str, within: float = 30.0) -> dict[int, int]:
    """Each partition's high watermark, by reading ``topic`` to its end (fetch responses)."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await c.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        partitions = await topic_partition_ids(bootstrap, topic, within=within)
        tps = [TopicPartition(topic, p) for p in partitions]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        while True:
            await c.getmany(timeout_ms=200, max_records=100_000)
            marks: list[Any] = [c.highwater(tp) for tp in tps]
            positions = [await c.position(tp) for tp in tps]
            if None not in marks and positions == marks:
                return {tp.partition: int(m) for tp, m in zip(tps, marks, strict=True)}
            assert loop.time() < deadline, f"could not read {topic} to its end"
    finally:
        await c.stop()


async def eventually(
    check: Callable[[], Any], within: float = 30.0, what: str = "condition"
) -> None:
    """Await an async or sync predicate until it holds, polling briefly, or fail."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
