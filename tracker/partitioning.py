"""Which markers partition a marker goes to, and its record key.

All markers of one logical message must land on one markers partition, in order, even when
several queue topics share one markers topic. The key is ``"<origin topic>:<origin partition>"``
(ASCII; topic names cannot contain ``:``) and the partition is Kafka's default partitioner
applied to it: ``toPositive(murmur2(key)) % partitions``, the same as the Java client's
``BuiltInPartitioner.partitionForKey``. Writers compute the partition themselves and produce to
it explicitly, so clients whose default partitioner differs (librdkafka uses CRC32) still agree.
"""

from __future__ import annotations

from functools import lru_cache

from aiokafka.partitioner import murmur2


def marker_key(origin_topic: str, origin_partition: int) -> bytes:
    """The record key of every marker about messages from this origin partition."""
    return f"{origin_topic}:{origin_partition}".encode("ascii")


@lru_cache(maxsize=65536)
def markers_partition(origin_topic: str, origin_partition: int, partitions: int) -> int:
    """The markers partition for messages from ``origin_topic``/``origin_partition``."""
    if partitions <= 0:
        raise ValueError("the markers topic must have at least one partition")
    hashed: int = murmur2(marker_key(origin_topic, origin_partition))
    return (hashed & 0x7FFFFFFF) % partitions
