"""Topics the tracker creates or checks: its own at start, and each output topic before its
first write.

* :func:`prepare_tracker_topics`: the markers topic (``LogAppendTime``) and the topic of parked
  malformed markers, when ``create_topics`` is on; and a warning when the markers topic keeps
  the producers' clocks (``CreateTime``).
* :class:`OutputTopics`: a DLQ or retry topic gets as many partitions as the topic whose
  messages it receives, once per topic and process.
"""

from __future__ import annotations

import logging
from typing import Any

from tracker.errors import KmqError
from tracker.kafka.scan import PartitionScanner
from tracker.kafka.topic_admin import ensure_topic, topic_timestamp_type
from tracker.metrics import Metrics
from tracker.settings import TrackerSettings

log = logging.getLogger(__name__)


async def prepare_tracker_topics(settings: TrackerSettings, client_config: dict[str, Any]) -> None:
    """Create the tracker's own topics if asked to; warn about a ``CreateTime`` markers topic."""
    if settings.create_topics:
        await ensure_topic(
            settings.kafka_bootstrap_servers,
            settings.markers_topic,
            partitions=settings.markers_partitions,
            replication_factor=settings.markers_replication_factor,
            configs={"message.timestamp.type": "LogAppendTime"},
            client_config=client_config,
        )
        await ensure_topic(
            settings.kafka_bootstrap_servers,
            settings.invalid_topic,
            partitions=1,
            replication_factor=settings.markers_replication_factor,
            client_config=client_config,
        )
    kind = await topic_timestamp_type(
        settings.kafka_bootstrap_servers, settings.markers_topic, client_config=client_config
    )
    if kind == "CreateTime":
        log.warning(
            "markers topic %r uses CreateTime: deadlines follow the consumers' clocks; "
            "set message.timestamp.type=LogAppendTime (see docs/protocol.md, Time)",
            settings.markers_topic,
        )


class OutputTopics:
    """Checks (and with ``create_topics``, creates) DLQ and retry topics before they are used."""

    def __init__(
        self,
        settings: TrackerSettings,
        *,
        scanner: PartitionScanner,
        metrics: Metrics,
        client_config: dict[str, Any],
    ) -> None:
        self.settings = settings
        self.scanner = scanner
        self.metrics = metrics
        self._client_config = client_config
        self._ensured: set[str] = set()

    async def ensure(self, topic: str, like: str) -> None:
        """Before the first write to a DLQ or retry topic: as many partitions as ``like``?

        Creates the topic (``create_topics``) with the partition count of ``like``, the topic
        whose messages it receives, so that per-partition order and parallelism survive a
        redrive; an existing topic with fewer partitions is reported (a warning and
        ``kmq_output_topic_partitions_missing``), not changed. Partition counts are asked of
        the cluster (all-topics metadata, through the tracker's partition scanner): no client
        of the tracker subscribes to queue topics, and on Apache Kafka a consumer's metadata
        holds only the topics it subscribed to.
        """
        if topic in self._ensured:
            return
        try:
            # One all-topics metadata request (it creates nothing) answers for both.
            counts = await self.scanner.partition_counts([like, topic])
        except KmqError as exc:
            if self.settings.create_topics:
                raise  # the copy waits: it must not go to a topic auto-created with 1 partition
            # Only a check when the tracker creates nothing (a locked-down cluster may not
            # allow it): never a reason to hold a dead letter back.
            log.warning("cannot check the partitions of %r (%s); writing to it anyway", topic, exc)
            self._ensured.add(topic)
            return
        wanted, existing = counts[like] or 1, counts[topic]
        if existing is None and self.settings.create_topics:
            created = await ensure_topic(
                self.settings.kafka_bootstrap_servers,
                topic,
                partitions=wanted,
                replication_factor=self.settings.markers_replication_factor,
                configs=self.settings.output_topic_configs,
                client_config=self._client_config,
            )
            # Created: ensure_topic returned once all of them had a leader. Not created:
            # another replica did it a moment ago, with a count of its own.
            existing = wanted if created else (await self.scanner.partition_counts([topic]))[topic]
        if existing is None:
            log.warning(
                "topic %r does not exist (create_topics is off): writing to it relies on the "
                "broker's auto-creation (num.partitions), not %d partitions like %r",
                topic,
                wanted,
                like,
            )
        elif existing < wanted:
            log.warning(
                "topic %r has %d partitions, fewer than the %d of %r whose messages it "
                "receives: its records lose their partition order and parallelism; add "
                "partitions (kafka-topics.sh --alter --topic %s --partitions %d)",
                topic,
                existing,
                wanted,
                like,
                topic,
                wanted,
            )
        missing = 0 if existing is None else max(0, wanted - existing)
        self.metrics.output_topic_partitions_missing.labels(topic, like).set(missing)
        self._ensured.add(topic)
