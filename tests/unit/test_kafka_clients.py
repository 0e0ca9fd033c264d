"""stop_consumer closes a consumer's connections whatever aiokafka's stop() does."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tracker.kafka.clients import stop_consumer

pytestmark = [pytest.mark.unit]


class _Client:
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class _Consumer:
    """aiokafka's fault: stop() ends with a fetch task's CancelledError, connections open."""

    def __init__(self, fails_with: BaseException | None) -> None:
        self._client = _Client()
        self._fails_with = fails_with

    async def stop(self) -> None:
        await asyncio.sleep(0)
        if self._fails_with is not None:
            raise self._fails_with
        self._client.closed = True


async def test_a_stop_that_raises_a_fetch_cancellation_still_closes_the_connections() -> None:
    consumer = _Consumer(asyncio.CancelledError())
    await stop_consumer(consumer)
    assert consumer._client.closed


async def test_also_in_a_cleanup_that_runs_because_the_caller_was_cancelled() -> None:
    consumer = _Consumer(asyncio.CancelledError())
    cleaned = asyncio.Event()

    async def worker() -> None:
        try:
            await asyncio.sleep(3600)
        finally:  # cancelling() is 1 here: the old check took the fault for our cancellation
            await stop_consumer(consumer)
            cleaned.set()

    task = asyncio.create_task(worker())
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert cleaned.is_set()
    assert consumer._client.closed


async def test_other_failures_reach_the_caller() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        await stop_consumer(_Consumer(RuntimeError("boom")))
