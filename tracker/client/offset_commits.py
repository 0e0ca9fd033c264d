"""Committing queue offsets once their batch is handed over, without waiting for it.

The KMQ invariant needs a batch's STARTs acknowledged before its offsets are committed; it
does not need the application to wait for the commit. :class:`OffsetCommits` keeps one
OffsetCommit in flight: batches handed over meanwhile only move the offsets the next one
carries (a later batch's offset replaces an earlier one's), so a fast application costs one
OffsetCommit per round trip, not one per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

log = logging.getLogger(__name__)


def offsets_past(fetched: dict[Any, list[Any]]) -> dict[Any, OffsetAndMetadata]:
    """The offsets to commit past each partition's batch in ``fetched``."""
    return {
        tp: OffsetAndMetadata(batch[-1].offset + 1, "") for tp, batch in fetched.items() if batch
    }


class OffsetCommits:
    """Background commits of a consumer's handed-over batches, one in flight at a time."""

    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer
        self._committing: asyncio.Task[None] | None = None
        #: offsets of batches handed over, not yet in a commit request
        self._to_commit: dict[Any, OffsetAndMetadata] = {}

    def soon(self, fetched: dict[Any, list[Any]]) -> None:
        """Commit past ``fetched`` soon (with the next commit request)."""
        self._to_commit.update(offsets_past(fetched))
        if self._committing is None or self._committing.done():
            self._committing = asyncio.get_running_loop().create_task(
                self._commit_pending(), name="kmq-commit"
            )

    async def _commit_pending(self) -> None:
        while self._to_commit:
            offsets, self._to_commit = self._to_commit, {}
            # A partition revoked since its batch was handed over is the next owner's to
            # read again (its messages are covered by their STARTs); the rest is committed.
            assigned = self._consumer.assignment()
            offsets = {tp: offset for tp, offset in offsets.items() if tp in assigned}
            if not offsets:
                continue
            try:
                await self._consumer.commit(offsets)
            except KafkaError as exc:
                log.warning(
                    "offset commit failed (%r); the batch is covered by its STARTs and will "
                    "be read again by the partition's next owner",
                    exc,
                )

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the commit in flight (before a rebalance goes on)."""
        task = self._committing
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout_s)

    async def finish(self) -> None:
        """Wait for the commits in flight and pending (before leaving the group)."""
        task, self._committing = self._committing, None
        if task is not None:
            with contextlib.suppress(Exception):
                await task
