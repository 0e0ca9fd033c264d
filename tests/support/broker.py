"""Kafka topic helpers of the tests, for any Kafka-protocol cluster (tansu or a real Apache
Kafka), and the names the tests use from the one broker launcher, ``tracker.localbroker``
(shared with the demo and the benchmarks). See docs/testing.md.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code

from tracker.kafka.topic_admin import topic_partitions
from tracker.localbroker import (
    BrokerStartupError,
    KafkaNotReadyError,
    LocalBroker,
    find_tansu_binary,
    free_port,
    run_sync,
    wait_for_kafka,
)

__all__ = [
    "BrokerStartupError",
    "KafkaNotReadyError",
    "LocalBroker",
    "TopicFactory",
    "create_topic",
    "create_topics",
    "delete_topics",
    "find_tansu_binary",
    "free_port",
    "run_sync",
    "topic_partition_ids",
    "unique_topic",
    "wait_for_kafka",
]

T = TypeVar("T")

DEFAULT_TOPIC_TIMEOUT = 30.0
_POLL_INTERVAL = 0.05
_MAX_PREFIX = 200  # Kafka allows 249 characters; the suffix adds 13
_ILLEGAL_TOPIC_CHARS = re.compile(r"[^a-zA-Z0-9._-]")


class TopicFactory(Protocol):
    """What the ``topic_factory`` fixture returns: creates a fresh topic, returns its name."""

    async def __call__(
        self,
        partitions: int = 1,
        *,
        prefix: str = "test",
        configs: Mapping[str, str] | None = None,
    ) -> str: ...


# --------------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------------


def unique_topic(prefix: str = "test") -> str:
    """A fresh, legal Kafka topic name: ``<prefix>-<12 hex chars>``.

    Characters Kafka does not allow in topic names are replaced by ``-`` and the result is kept
    well under the 249-character limit.
    """
    clean = _ILLEGAL_TOPIC_CHARS.sub("-", prefix).strip(".")[:_MAX_PREFIX] or "test"
    return f"{clean}-{secrets.token_hex(6)}"


def _raise_for_error_code(code: int, what: str, message: str | None = None) -> None:
    if code != 0:
        error_cls = for_code(code)
        raise error_cls(f"{what}: {message or error_cls.__name__}")


# --------------------------------------------------------------------------------------------
# Cluster readiness and topics (any Kafka-protocol cluster)
# --------------------------------------------------------------------------------------------


async def create_topics(
    bootstrap_servers: str,
    topics: Mapping[str, int],
    *,
    configs: Mapping[str, str] | None = None,
    replication_factor: int = 1,
    within: float = DEFAULT_TOPIC_TIMEOUT,
) -> None:
    """Create ``{name: partitions}`` and wait until metadata shows every partition with a leader.

    A topic that already exists is accepted if it has the requested partition count (so the
    call is idempotent); a different count, or any other error, raises.
    """
    if not topics:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap_servers, request_timeout_ms=int(within * 1000)
    )
    try:
        await admin.start()
        new_topics = [
            NewTopic(name, partitions, replication_factor, topic_configs=dict(configs or {}))
            for name, partitions in topics.items()
        ]
        existed: set[str] = set()
        try:
            response = await admin.create_topics(new_topics, timeout_ms=int(within * 1000))
        except TopicAlreadyExistsError:
            existed.update(topics)  # some versions raise instead of reporting per topic
        else:
            for topic_error in response.topic_errors:
                name, code = topic_error[0], topic_error[1]
                message = topic_error[2] if len(topic_error) > 2 else None
                if code == TopicAlreadyExistsError.errno:
                    existed.add(name)
                else:
                    _raise_for_error_code(code, f"creating topic {name!r}", message)
        await _wait_for_topic_metadata(admin, topics, existed, deadline)
    finally:
        await admin.close()


async def _wait_for_topic_metadata(
    admin: AIOKafkaAdminClient, topics: Mapping[str, int], existed: set[str], deadline: float
) -> None:
    loop = asyncio.get_running_loop()
    pending = dict(topics)
    last_seen: object = None
    while True:
        described = await admin.describe_topics(list(pending))
        last_seen = described
        for entry in described:
            name = entry["topic"]
            expected = pending.get(name)
            if expected is None or entry["error_code"] != 0:
                continue
            partitions = entry["partitions"]
            if name in existed and partitions and len(partitions) != expected:
                raise ValueError(
                    f"topic {name!r} already exists with {len(partitions)} partitions, "
                    f"not {expected}"
                )
            led = [p for p in partitions if p["error_code"] == 0 and p["leader"] >= 0]
            if len(partitions) == expected and len(led) == expected:
                del pending[name]
        if not pending:
            return
        if loop.time() >= deadline:
            raise TimeoutError(
                f"metadata never showed topics {sorted(pending)} ready (last: {last_seen!r})"
            )
        await asyncio.sleep(_POLL_INTERVAL)


async def topic_partition_ids(
    bootstrap_servers: str, topic: str, *, within: float = DEFAULT_TOPIC_TIMEOUT
) -> list[int]:
    """The partition ids of ``topic``, asked of the cluster; waits (``within``) until it exists.

    Never ask a consumer (``partitions_for_topic``): its metadata holds only what it subscribed
    to or was assigned on Apache Kafka (tansu happens to answer for every topic). This asks with
    an all-topics metadata request (:func:`tracker.kafka.topic_admin.topic_partitions`), which also
    never auto-creates the topic.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        left = deadline - loop.time()
        count = await topic_partitions(bootstrap_servers, topic, timeout=max(left, 0.1))
        if count:
            return list(range(count))
        if loop.time() >= deadline:
            raise TimeoutError(f"topic {topic!r} did not show up in the metadata within {within}s")
        await asyncio.sleep(_POLL_INTERVAL)


async def create_topic(
    bootstrap_servers: str,
    partitions: int = 1,
    *,
    prefix: str = "test",
    configs: Mapping[str, str] | None = None,
    within: float = DEFAULT_TOPIC_TIMEOUT,
) -> str:
    """Create one fresh topic (``unique_topic(prefix)``) and return its name."""
    name = unique_topic(prefix)
    await create_topics(bootstrap_servers, {name: partitions}, configs=configs, within=within)
    return name


async def delete_topics(
    bootstrap_servers: str, names: Sequence[str], *, within: float = DEFAULT_TOPIC_TIMEOUT
) -> None:
    """Best-effort topic deletion (errors are swallowed: this is cleanup)."""
    if not names:
        return
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap_servers, request_timeout_ms=int(within * 1000)
    )
    try:
        await admin.start()
        await admin.delete_topics(list(names), timeout_ms=int(within * 1000))
    except (KafkaError, OSError, TimeoutError):
        pass
    finally:
        await admin.close()


# --------------------------------------------------------------------------------------------
# The broker process
# --------------------------------------------------------------------------------------------
