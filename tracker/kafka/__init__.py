"""Kafka I/O for the tracker: reading original records back, and small admin helpers.

Kept apart from the engine so that everything that talks to a broker (and every broker quirk
it has to cope with) sits in one place, tested against a real broker.
"""

from tracker.kafka.original_records import Missing, OriginalRecord, OriginalsUnavailable
from tracker.kafka.originals import OriginalsReader
from tracker.kafka.topic_admin import (
    KafkaUnavailable,
    TopicMismatch,
    TopicRejected,
    ensure_topic,
    topic_partitions,
    topic_retention_ms,
    topic_timestamp_type,
)

__all__ = [
    "KafkaUnavailable",
    "Missing",
    "OriginalRecord",
    "OriginalsReader",
    "OriginalsUnavailable",
    "TopicMismatch",
    "TopicRejected",
    "ensure_topic",
    "topic_partitions",
    "topic_retention_ms",
    "topic_timestamp_type",
]
