"""Small Kafka admin helpers: make sure a topic exists, and read what the tracker needs to know.

The tracker creates its own topics (markers, DLQs) at startup and needs a few facts about the
queue topics: how many partitions (markers partitioning), how long records are kept
(``retention.ms``: delays that outlive it must be protected), and which timestamp a record
carries (``message.timestamp.type``).

Two rules shape the code:

- **Asking must never create.** tansu auto-creates a topic on any metadata request that names
  it, and Apache Kafka does the same when ``auto.create.topics.enable`` is on (its default).
  Existence and partition counts are therefore read from an *all-topics* metadata request,
  which names nothing.
- **Errors say what to do.** Every aiokafka failure is translated: :class:`KafkaUnavailable`
  (the cluster did not answer in time: retry later), :class:`TopicRejected` (the broker or a
  local check refused the request: fix the configuration), :class:`TopicMismatch` (the topic
  exists but does not fit).

Every function bounds its whole run by ``timeout`` seconds, including connecting (which is
retried within that time, so a broker that is still starting up is waited for).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    for_code,
)

from tracker.errors import KmqError
from tracker.ids import is_valid_topic

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0
#: Replication factor used when none is given: three copies, or one per broker if fewer.
DEFAULT_MAX_REPLICATION = 3
_POLL_FIRST = 0.02
_POLL_MAX = 0.25

RETENTION_MS = "retention.ms"
TIMESTAMP_TYPE = "message.timestamp.type"


class KafkaUnavailable(KmqError):
    """Kafka did not answer (in time): try again later."""


class TopicMismatch(KmqError):
    """The topic exists, but not as required (for example with fewer partitions)."""


class TopicRejected(KmqError, ValueError):
    """The topic cannot be created as requested (invalid name, partitions or configs)."""


async def ensure_topic(
    bootstrap_servers: str,
    name: str,
    *,
    partitions: int,
    configs: Mapping[str, str] | None = None,
    replication_factor: int | None = None,
    require_partitions: bool = False,
    client_config: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (bounds several requests, not one)
) -> bool:
    """Create topic ``name`` unless it exists; True if this call created it.

    Returns once the topic's partitions all have a leader in the metadata (for an existing
    topic too: another replica may have created it a moment ago), so the caller can produce
    to it right away.

    ``configs`` apply only when the topic is created; an existing topic keeps its own.
    ``replication_factor`` defaults to ``min(3, number of brokers)``. An existing topic with
    fewer partitions than ``partitions`` is accepted (with a warning) unless
    ``require_partitions`` is set, in which case :class:`TopicMismatch` is raised; more
    partitions are always fine.

    Raises :class:`TopicRejected` for an invalid name, partition count or config (checked
    locally as far as possible: tansu accepts anything), :class:`KafkaUnavailable` when the
    cluster does not answer or the topic does not become ready within ``timeout`` seconds.
    """
    if not is_valid_topic(name):
        raise TopicRejected(f"{name!r} is not a valid Kafka topic name")
    if partitions < 1:
        raise TopicRejected(f"topic {name!r}: partitions must be >= 1, not {partitions}")
    if replication_factor is not None and replication_factor < 1:
        raise TopicRejected(
            f"topic {name!r}: replication factor must be >= 1, not {replication_factor}"
        )
    topic_configs = {str(key): str(value) for key, value in (configs or {}).items()}

    async def op(admin: Any, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        replicas = replication_factor
        if replicas is None:
            cluster = await admin.describe_cluster()
            replicas = max(1, min(DEFAULT_MAX_REPLICATION, len(cluster.get("brokers") or ())))
        request_ms = max(int((deadline - loop.time()) * 1000), 1)
        created = True
        try:
            response = await admin.create_topics(
                [NewTopic(name, partitions, replicas, topic_configs=topic_configs)],
                timeout_ms=request_ms,
            )
        except TopicAlreadyExistsError:
            created = False  # some aiokafka versions raise instead of reporting per topic
        else:
            for topic_error in response.topic_errors:
                if topic_error[0] != name:
                    continue
                code = topic_error[1]
                message = topic_error[2] if len(topic_error) > 2 else None
                if code == TopicAlreadyExistsError.errno:
                    created = False
                elif code != 0:
                    error = for_code(code)
                    detail = f"{error.__name__}" + (f": {message}" if message else "")
                    if error.retriable:
                        raise KafkaUnavailable(f"creating topic {name!r} failed: {detail}")
                    raise TopicRejected(f"Kafka refused to create topic {name!r}: {detail}")
        count = await _wait_until_ready(admin, name, partitions if created else None, deadline)
        if not created and count < partitions:
            if require_partitions:
                raise TopicMismatch(
                    f"topic {name!r} exists with {count} partitions, fewer than the "
                    f"{partitions} required"
                )
            log.warning(
                "topic %r exists with %d partitions (asked for %d)", name, count, partitions
            )
        if created:
            log.info("created topic %r (%d partitions, %s)", name, partitions, topic_configs)
        return created

    return await _with_admin(
        f"ensuring topic {name!r}", bootstrap_servers, client_config, timeout, op
    )


async def topic_partitions(
    bootstrap_servers: str,
    name: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (bounds several requests, not one)
) -> int | None:
    """Number of partitions of topic ``name``, or None if it does not exist.

    Uses an all-topics metadata request, so asking never creates the topic (a request naming
    it would, on tansu and on Kafka with auto-creation on). A topic caught in the middle of
    creation is waited for (within ``timeout``).
    """

    async def op(admin: Any, deadline: float) -> int | None:
        loop = asyncio.get_running_loop()
        pause = _POLL_FIRST
        while True:
            entry = await _describe_one(admin, name)
            if entry is None or entry["error_code"] == UnknownTopicOrPartitionError.errno:
                return None
            if entry["error_code"] == 0 and entry["partitions"]:
                return len(entry["partitions"])
            # Another error (typically LEADER_NOT_AVAILABLE while the topic is being created):
            # the topic exists, its partitions are not known yet.
            if loop.time() + pause >= deadline:
                raise KafkaUnavailable(
                    f"topic {name!r} is in the metadata but its partitions are not "
                    f"(error {_error_name(entry['error_code'])})"
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    return await _with_admin(
        f"reading partitions of topic {name!r}", bootstrap_servers, client_config, timeout, op
    )


async def topic_retention_ms(
    bootstrap_servers: str,
    name: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (bounds several requests, not one)
) -> int | None:
    """The topic's ``retention.ms``: milliseconds, ``-1`` for unlimited, None if not known.

    Apache Kafka reports the effective value (the topic's own, or the broker default); tansu
    reports only configs set explicitly on the topic, so None there means "not set". None
    also when the topic does not exist. Never creates the topic.
    """
    value = await _topic_config(bootstrap_servers, name, RETENTION_MS, client_config, timeout)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("topic %r reports a non-numeric %s: %r", name, RETENTION_MS, value)
        return None


async def topic_timestamp_type(
    bootstrap_servers: str,
    name: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (bounds several requests, not one)
) -> str | None:
    """The topic's ``message.timestamp.type``: ``"CreateTime"``, ``"LogAppendTime"`` or None.

    None when the broker does not report it (tansu: not set explicitly) or the topic does not
    exist. Note that tansu reports the configured value but ignores it (records keep the
    producer's CreateTime). Never creates the topic.
    """
    return await _topic_config(bootstrap_servers, name, TIMESTAMP_TYPE, client_config, timeout)


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


async def _topic_config(
    bootstrap_servers: str,
    name: str,
    key: str,
    client_config: Mapping[str, Any] | None,
    seconds: float,
) -> str | None:
    async def op(admin: Any, deadline: float) -> str | None:
        # Ask for all configs and pick one: tansu cannot decode a DescribeConfigs request that
        # names config keys (it drops the connection), and the reply is small either way.
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
        for response in responses:
            for resource in response.resources:
                error_code, error_message, _type, resource_name, entries = resource[:5]
                if resource_name != name:
                    continue
                if error_code == UnknownTopicOrPartitionError.errno:
                    return None
                if error_code != 0:
                    raise KafkaUnavailable(
                        f"describing configs of topic {name!r} failed: "
                        f"{_error_name(error_code)}: {error_message}"
                    )
                for entry in entries:
                    if entry[0] == key:
                        value = entry[1]
                        return None if value is None else str(value)
        return None

    return await _with_admin(
        f"reading {key} of topic {name!r}", bootstrap_servers, client_config, seconds, op
    )


async def _describe_one(admin: Any, name: str) -> dict[str, Any] | None:
    """The metadata entry of topic ``name`` from an all-topics request (which creates nothing)."""
    for entry in await admin.describe_topics():
        if entry["topic"] == name:
            found: dict[str, Any] = entry
            return found
    return None


async def _wait_until_ready(admin: Any, name: str, expected: int | None, deadline: float) -> int:
    """Poll all-topics metadata until every partition of ``name`` has a leader; partition count.

    With ``expected``, also wait until that many partitions are listed (a topic just created
    can appear before all of its partitions do).
    """
    loop = asyncio.get_running_loop()
    pause = _POLL_FIRST
    last: object = "not listed"
    while True:
        entry = await _describe_one(admin, name)
        if entry is not None:
            last = entry
            listed = entry["partitions"] or []
            led = [p for p in listed if p["error_code"] == 0 and p["leader"] >= 0]
            if (
                entry["error_code"] == 0
                and listed
                and len(led) == len(listed)
                and (expected is None or len(listed) == expected)
            ):
                return len(listed)
        if loop.time() + pause >= deadline:
            raise KafkaUnavailable(
                f"topic {name!r} did not get a leader for every partition in time "
                f"(last metadata: {last!r})"
            )
        await asyncio.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)


async def _with_admin(
    what: str,
    bootstrap_servers: str,
    client_config: Mapping[str, Any] | None,
    seconds: float,
    op: Callable[[Any, float], Awaitable[T]],
) -> T:
    """Connect an admin client (retrying within ``seconds``), run ``op``, close, translate.

    ``op`` gets the started client and the loop-time deadline it must finish by.
    """
    if seconds <= 0:
        raise ValueError(f"timeout must be positive, not {seconds}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    config = dict(client_config or {})
    config.setdefault("request_timeout_ms", max(int(seconds * 1000), 1000))
    last_error: BaseException | None = None
    try:
        async with asyncio.timeout(seconds):
            pause = _POLL_FIRST
            while True:
                admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, **config)
                try:
                    await admin.start()
                except (KafkaError, OSError) as exc:
                    last_error = exc
                    await admin.close()
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 1.0)
                    continue
                except BaseException:
                    await admin.close()
                    raise
                break
            try:
                return await op(admin, deadline)
            finally:
                await admin.close()
    except TimeoutError as exc:
        hint = f" (last error: {last_error!r})" if last_error is not None else ""
        raise KafkaUnavailable(
            f"{what}: Kafka at {bootstrap_servers} did not answer within {seconds:g}s{hint}"
        ) from exc
    except (KafkaError, OSError) as exc:
        raise KafkaUnavailable(f"{what}: {exc!r}") from exc


def _error_name(code: int) -> str:
    return str(for_code(code).__name__)
