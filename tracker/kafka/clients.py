"""Starting the group-less consumers the tracker uses to read records by position."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from tracker.errors import KmqError


async def start_positional_consumer(
    bootstrap_servers: str,
    config: Mapping[str, Any],
    *,
    timeout: float,  # noqa: ASYNC109 - bounds the connection, passed down from the caller
    auto_offset_reset: str,
    error: type[KmqError],
) -> Any:
    """A started consumer with no group (nothing committed), or ``error`` if Kafka is away.

    The consumer is closed again on any failure, so no client leaks on a broker outage.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        **config,
    )
    try:
        async with asyncio.timeout(timeout):
            await consumer.start()
    except (KafkaError, OSError, TimeoutError) as exc:
        await consumer.stop()
        raise error(f"cannot connect to Kafka at {bootstrap_servers}: {exc!r}") from exc
    except BaseException:
        await consumer.stop()
        raise
    return consumer
