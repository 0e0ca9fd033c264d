"""Starting and stopping aiokafka consumers despite their known faults (aiokafka 0.14)."""

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


async def stop_consumer(consumer: Any) -> None:
    """``consumer.stop()``, closing its connections also when aiokafka gives up half-way.

    aiokafka 0.14: a consumer stopped while a fetch waits out its retry backoff (the broker is
    away) has ``stop()`` raise that fetch's own ``CancelledError`` and skip closing the
    connections, which then leak ("Unclosed AIOKafkaConsumer") and end the caller's shutdown.
    ``stop()`` runs as a task of its own, so that cancellation ends only that task (and is told
    from one of the caller: the task's outcome, not ``cancelling()``, which stays set in every
    cleanup that runs *because* the caller was cancelled); the connections are then closed
    here. If the caller itself is cancelled while it waits, the stop goes on in the background.
    """
    stopping = asyncio.ensure_future(consumer.stop())
    await asyncio.wait({stopping})
    if stopping.cancelled():
        await consumer._client.close()
    else:
        stopping.result()  # any other failure is the caller's to see
