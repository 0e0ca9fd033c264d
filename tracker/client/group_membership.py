"""The consumer's place in its group: rebalance generations and the group's timeouts.

aiokafka rebalances eagerly: every partition is revoked, and the ones assigned again start
from their committed offsets. The START pipeline drops batches fetched before a rebalance
(:class:`RebalanceCounter` tells it the generation), and a worker pool drains what it holds of
revoked partitions within the time the group gives a member (:class:`GroupTimeouts`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

log = logging.getLogger(__name__)

#: aiokafka's default ``max_poll_interval_ms``.
AIOKAFKA_MAX_POLL_INTERVAL_MS = 300_000
#: aiokafka's default ``session_timeout_ms`` (its ``rebalance_timeout_ms`` defaults to it).
AIOKAFKA_SESSION_TIMEOUT_MS = 10_000


@dataclass(frozen=True, slots=True)
class GroupTimeouts:
    """The group-membership timeouts of the consumer's aiokafka settings (or their defaults)."""

    max_poll_interval_ms: int  #: the group drops a member that does not poll for this long
    rebalance_timeout_ms: int  #: how long the group waits for members to rejoin

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> GroupTimeouts:
        return cls(
            int(config.get("max_poll_interval_ms", AIOKAFKA_MAX_POLL_INTERVAL_MS)),
            int(
                config.get("rebalance_timeout_ms")
                or config.get("session_timeout_ms", AIOKAFKA_SESSION_TIMEOUT_MS)
            ),
        )


class RebalanceCounter(ConsumerRebalanceListener):  # type: ignore[misc]
    """Counts the group's rebalances for the START pipeline.

    A batch fetched ahead of a rebalance would be handed over and read again (here or by the
    partition's new owner), so the pipeline drops the batches of an older generation; their
    STARTs keep them covered until they are read again.
    """

    def __init__(self, on_revoked: Callable[[set[TopicPartition]], Awaitable[None]]) -> None:
        self.generation = 0
        self._on_revoked = on_revoked

    def current(self) -> int:
        return self.generation

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self.generation += 1
        try:
            await self._on_revoked(set(revoked))
        except Exception:
            # aiokafka logs and goes on too; the messages are covered by their STARTs.
            log.exception("finishing work on revoked partitions failed")

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.generation += 1
