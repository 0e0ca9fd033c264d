"""What the tracker knows about queue topics: existence, partitions, retention, policy.

Markers name topics; a marker for a topic (or partition) that does not exist is refused at
ingest rather than tracked until it turns into a "lost" message. The catalog answers from a
snapshot of the cluster's topic list, refreshed when an unknown name shows up, at most once
per ``refresh_interval`` (so a flood of junk names cannot flood the broker with requests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from tracker.domain.policy import ResolvedPolicy, TopicPolicy
from tracker.kafka.topic_admin import topic_retention_ms
from tracker.protocol import AnyMarker
from tracker.settings import TrackerSettings

log = logging.getLogger(__name__)

ASSUMED_RETENTION_MS = 7 * 24 * 3600 * 1000  #: Kafka's default retention.ms


class TopicCatalog:
    def __init__(
        self,
        settings: TrackerSettings,
        *,
        client_config: Mapping[str, Any] | None = None,
        refresh_interval: float = 5.0,
    ) -> None:
        self._settings = settings
        self._client_config = dict(client_config or {})
        self._refresh_interval = refresh_interval
        self._partitions: dict[str, int] = {}
        self._retention: dict[str, int | None] = {}
        self._policies: dict[str, TopicPolicy] = {}
        self._resolved: dict[str, ResolvedPolicy] = {}
        self._refreshed_at = float("-inf")
        self._allowed = set(settings.allowed_topics) if settings.allowed_topics else None
        self._admin: Any = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self._admin = AIOKafkaAdminClient(
            bootstrap_servers=self._settings.kafka_bootstrap_servers, **self._client_config
        )
        await self._admin.start()

    async def stop(self) -> None:
        if self._admin is not None:
            await self._admin.close()
            self._admin = None

    async def _refresh(self) -> None:
        if self._admin is None:
            return
        try:
            described = await self._admin.describe_topics()
        except KafkaError as exc:
            log.warning("cannot list topics: %r", exc)
            return
        partitions = {
            t["topic"]: len(t["partitions"])
            for t in described
            if t.get("error_code", 0) == 0 and t.get("partitions")
        }
        self._partitions.update(partitions)
        self._refreshed_at = time.monotonic()

    async def prepare(self, topics: Iterable[str]) -> None:
        """Make sure the snapshot knows these topics if they exist (refreshing if allowed)."""
        unknown = {t for t in topics if t not in self._partitions}
        if not unknown:
            return
        async with self._lock:
            unknown = {t for t in unknown if t not in self._partitions}
            if unknown and time.monotonic() - self._refreshed_at >= self._refresh_interval:
                await self._refresh()
            for topic in unknown & set(self._partitions):
                await self._learn_retention(topic)

    async def _learn_retention(self, topic: str) -> None:
        try:
            self._retention[topic] = await topic_retention_ms(
                self._settings.kafka_bootstrap_servers,
                topic,
                client_config=self._client_config,
                timeout=10.0,
            )
        except Exception as exc:
            log.warning("cannot read retention.ms of %r (%s); assuming 7 days", topic, exc)
            self._retention[topic] = None
        self._resolved.pop(topic, None)

    def check(self, marker: AnyMarker) -> str | None:
        """Why ``marker`` names something that does not exist (None when it is fine)."""
        for topic, partition in (
            (marker.topic, marker.partition),
            (marker.origin_topic, marker.origin_partition),
        ):
            if self._allowed is not None and topic not in self._allowed:
                return f"topic {topic!r} is not in allowed_topics"
            count = self._partitions.get(topic)
            if count is None:
                return f"topic {topic!r} does not exist"
            if partition >= count:
                return (
                    f"partition {partition} of topic {topic!r} does not exist ({count} partitions)"
                )
        return None

    def policy(self, topic: str) -> TopicPolicy:
        policy = self._policies.get(topic)
        if policy is None:
            policy = self._policies[topic] = self._settings.policy_for(topic)
        return policy

    def resolved(self, topic: str) -> ResolvedPolicy:
        """The policy in the state machine's terms, with the payload-copy threshold."""
        resolved = self._resolved.get(topic)
        if resolved is None:
            policy = self.policy(topic)
            if policy.keep_payload_after is not None:
                keep_after = int(policy.keep_payload_after.total_seconds() * 1000)
            else:
                retention = self._retention.get(topic)
                if retention is not None and retention < 0:
                    keep_after = 2**62  # unlimited retention: the original stays
                else:
                    keep_after = (retention or ASSUMED_RETENTION_MS) // 2
            resolved = self._resolved[topic] = ResolvedPolicy(
                processing_timeout_ms=int(policy.processing_timeout.total_seconds() * 1000),
                backoff=policy.backoff,
                keep_payload_after_ms=keep_after,
            )
        return resolved
