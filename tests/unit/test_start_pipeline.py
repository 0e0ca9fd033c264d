"""The START pipeline without a broker: how far it fetches ahead, and what a failure gives back.

A prefetched batch's lease runs while it waits for the application, so the pipeline must
fetch a whole ``depth`` ahead only for an application fast enough to take it within the time
budget, and one batch ahead for a slow one. When a START write fails, every batch not handed
over must be read again, including the one the fetching task held while the queue was full.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from tracker.client import pipeline as pipeline_module
from tracker.client.pipeline import (
    MIN_AHEAD_S,
    READY_COVER,
    InFlight,
    StartPipeline,
    seconds_ahead,
)
from tracker.errors import MarkerWriteFailed

pytestmark = pytest.mark.unit

BATCH = 500


@dataclass(frozen=True)
class Record:
    offset: int


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Source:
    """Endless records, fetched ``BATCH`` at a time from partitions taken in turn."""

    def __init__(self, partitions: int = 1) -> None:
        self.positions = {f"p{i}": 0 for i in range(partitions)}
        self.fetches = 0
        self.sought: dict[Any, int] = {}

    async def fetch(self) -> dict[Any, list[Any]]:
        tp = f"p{self.fetches % len(self.positions)}"
        self.fetches += 1
        first = self.positions[tp]
        self.positions[tp] = first + BATCH
        return {tp: [Record(o) for o in range(first, first + BATCH)]}

    def seek(self, first: dict[Any, int]) -> None:
        self.sought = dict(first)
        self.positions.update(first)


def _plan(fetched: dict[Any, list[Any]]) -> tuple[list[Any], list[Any]]:
    return [], ["start"]


async def _acked(markers: Any) -> None:
    return None


def _pipeline(
    source: Source, clock: FakeClock, send: Any = _acked, depth: int = 8, **options: Any
) -> StartPipeline:
    return StartPipeline(
        fetch=source.fetch,
        plan=_plan,
        send=send,
        seek=source.seek,
        depth=depth,
        ahead_s=1.0,
        clock=clock,
        **options,
    )


async def _settle(predicate: Any) -> None:
    """Let the fetching task run until ``predicate()`` holds (it never sleeps on its own)."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the pipeline did not get there")


async def _quiet() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def test_a_fast_application_gets_the_whole_depth_ahead() -> None:
    source, clock = Source(), FakeClock()
    pipeline = _pipeline(source, clock)
    for _ in range(3):  # takes 500 records per millisecond: 500k records/s
        item = await pipeline.next(1.0)
        assert item is not None
        assert item.count == BATCH
        clock.now += 0.001
    # depth 8 queued + one held by the fetching task, waiting for room in the queue
    await _settle(lambda: source.fetches == 3 + 8 + 1)
    await _quiet()
    assert source.fetches == 3 + 8 + 1
    await pipeline.close()


def test_the_time_ahead_hides_the_round_trips_and_no_more() -> None:
    assert seconds_ahead(1.0, None) == MIN_AHEAD_S, "before the first batch is ready"
    assert seconds_ahead(1.0, 0.001) == MIN_AHEAD_S, "a broker that answers at once: the floor"
    assert seconds_ahead(1.0, 0.010) == pytest.approx(READY_COVER * 0.010)
    assert seconds_ahead(0.1, 0.5) == 0.1, "never more than the lease allows"


async def test_the_time_measured_runs_from_the_fetch_to_the_starts_acknowledgement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The round trip the batches ahead must hide is a batch's START write (50 ms here), not
    the fetch's own wait for data (200 ms here): idle time hides nothing, and counting it
    would keep seconds of leases running in the queue."""
    clock = FakeClock()

    class WaitingSource(Source):
        async def fetch(self) -> dict[Any, list[Any]]:
            for _ in range(3):  # the STARTs before are acknowledged while this one waits
                await asyncio.sleep(0)
            clock.now += 0.2
            return await super().fetch()

    async def acked_in_50_ms(markers: Any) -> None:
        clock.now += 0.05

    measured: list[float] = []
    real = pipeline_module.seconds_ahead

    def spy(ahead_s: float, ready_s: float | None) -> float:
        if ready_s is not None:
            measured.append(ready_s)
        return real(ahead_s, ready_s)

    monkeypatch.setattr(pipeline_module, "seconds_ahead", spy)
    pipeline = _pipeline(WaitingSource(), clock, send=acked_in_50_ms, depth=128)
    for _ in range(4):
        assert await pipeline.next(1.0) is not None
    await _settle(lambda: len(measured) >= 3)
    await pipeline.close()
    assert all(r == pytest.approx(0.05) for r in measured), measured
    assert seconds_ahead(1.0, measured[-1]) == pytest.approx(READY_COVER * 0.05)


async def test_a_fast_application_keeps_what_hides_the_round_trips_not_the_whole_depth() -> None:
    source, clock = Source(), FakeClock()
    pipeline = _pipeline(source, clock, depth=128)
    for _ in range(3):  # 500 records per millisecond, batches ready at once (fake clock)
        assert await pipeline.next(1.0) is not None
        clock.now += 0.001
    # 500k records/s x MIN_AHEAD_S (20 ms) = 10,000 records: 20 batches (21 where the
    # measured rate rounds above 500k), not 128
    await _settle(lambda: source.fetches >= 3 + 20)
    await _quiet()
    assert 3 + 20 <= source.fetches <= 3 + 21
    await pipeline.close()


async def test_a_slow_application_gets_one_batch_ahead() -> None:
    source, clock = Source(), FakeClock()
    pipeline = _pipeline(source, clock)
    first = await pipeline.next(1.0)
    assert first is not None
    clock.now += 5.0  # 500 records took 5 s: 100 records/s, a second's work is 100 records
    second = await pipeline.next(1.0)
    assert second is not None
    # Up to the first measurement the pipeline fetched freely (the whole depth); from now
    # on it fetches at most one batch per batch taken, and once what it had is taken, it
    # keeps exactly one batch ahead.
    await _quiet()
    for _ in range(12):
        before = source.fetches
        clock.now += 5.0
        assert await pipeline.next(1.0) is not None
        await _quiet()
        assert source.fetches - before <= 1, "a slow application's batches expire in a queue"
    assert pipeline._queue.qsize() == 1
    assert pipeline._putting is None
    await pipeline.close()


async def test_the_fetch_ahead_grows_again_when_the_application_speeds_up() -> None:
    source, clock = Source(), FakeClock()
    pipeline = _pipeline(source, clock)
    await pipeline.next(1.0)
    clock.now += 5.0
    for _ in range(12):
        item = await pipeline.next(1.0)
        assert item is not None
        clock.now += 5.0
    await _quiet()
    assert pipeline._queue.qsize() <= 1
    for _ in range(20):  # now 500 records per millisecond
        clock.now += 0.001
        assert await pipeline.next(1.0) is not None
    await _settle(lambda: pipeline._queue.qsize() == 8)
    await pipeline.close()


async def _measured_fast(pipeline: StartPipeline, clock: FakeClock) -> None:
    """Take two batches a millisecond apart: the application's rate is known and high."""
    assert await pipeline.next(1.0) is not None
    clock.now += 0.001
    assert await pipeline.next(1.0) is not None


async def test_a_failed_start_reads_again_every_batch_not_handed_over() -> None:
    source, clock = Source(partitions=3), FakeClock()
    failing = asyncio.get_running_loop().create_future()
    sent = 0

    async def send(markers: Any) -> None:
        nonlocal sent
        sent += 1
        if sent == 3:  # the third batch's START (p2 at 0) fails
            await failing

    pipeline = _pipeline(source, clock, send=send, depth=1)
    await _measured_fast(pipeline, clock)  # p0 at 0 and p1 at 0 handed over
    # p2 waits in the queue (depth 1) and the fetching task holds p0's second batch, which
    # it cannot put. When the application takes p2, p0's batch goes in and the task holds
    # p1's second batch: fetched, so it must be read again too, though nothing before it is.
    await _settle(lambda: source.fetches == 4)
    await _quiet()
    failing.set_exception(MarkerWriteFailed("broker gone"))
    with pytest.raises(MarkerWriteFailed):
        await pipeline.next(1.0)
    assert source.sought == {"p0": BATCH, "p1": BATCH, "p2": 0}
    again = await pipeline.next(1.0)
    assert again is not None
    ((tp, records),) = again.fetched.items()
    assert records[0].offset == source.sought[tp]
    await pipeline.close()


async def test_close_gives_back_the_batch_held_for_a_full_queue() -> None:
    source, clock = Source(), FakeClock()
    pipeline = _pipeline(source, clock, depth=1)
    await _measured_fast(pipeline, clock)
    await _settle(lambda: source.fetches == 4)  # one queued, one held
    await _quiet()
    left: list[InFlight] = await pipeline.close()
    assert [item.fetched["p0"][0].offset for item in left] == [2 * BATCH, 3 * BATCH]


async def test_one_batch_ahead_until_the_application_has_taken_one() -> None:
    source, clock = Source(), FakeClock()
    pipeline = _pipeline(source, clock)
    assert await pipeline.next(1.0) is not None
    await _quiet()
    assert source.fetches == 2, "no rate known yet: one batch ahead"
    await pipeline.close()


async def test_prefetching_stops_at_max_bytes() -> None:
    source, clock = Source(), FakeClock()
    # a batch of large values
    pipeline = _pipeline(source, clock, max_bytes=2_500, weigh=lambda fetched: 1_000)
    for _ in range(3):  # a fast application: only the bytes bound holds the pipeline back
        assert await pipeline.next(1.0) is not None
        clock.now += 0.001
    await _quiet()
    assert source.fetches == 3 + 3, "three batches (3,000 bytes) reach the 2,500-byte bound"
    assert await pipeline.next(1.0) is not None
    await _quiet()
    assert source.fetches == 3 + 3 + 1
    await pipeline.close()


async def test_batches_fetched_before_a_rebalance_are_dropped() -> None:
    source, clock = Source(), FakeClock()
    generation = 0
    pipeline = _pipeline(source, clock, generation=lambda: generation)
    await _measured_fast(pipeline, clock)  # batches 0 and 1 handed over
    await _settle(lambda: source.fetches == 2 + 8 + 1)  # 8 queued, 1 held for a full queue
    await _quiet()
    generation += 1  # a rebalance: the consumer reads from its committed offsets again
    item = await pipeline.next(1.0)
    assert item is not None
    assert item.generation == 1
    # The nine batches fetched before it are gone (not handed over), the first after is next.
    assert item.fetched["p0"][0].offset == 11 * BATCH
    await pipeline.close()
