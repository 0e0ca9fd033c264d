"""The worker pool behind ``KmqConsumer.run``, without a broker.

Batches come from a fake source (range-covered first deliveries, as the consumer hands them
over); markers go to an :class:`InMemoryMarkerSink`. What a user relies on: never more than
``concurrency`` handlers at once, per-key lanes one at a time in offset order, the handler's
outcome settles the message (ack / retry / reject, or what the handler did itself), leases
renewed per batch while messages wait or run, a hung handler retried, a drain that finishes
what the pool holds and gives the rest back, ``BaseException`` stopping the pool without
losing the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.records import FakeRecord
from support.waiting import until

from tracker.client import KmqConsumer, KmqMessage, RejectMessage, RetryMessage, workers
from tracker.client.handlers import HandlerCaller, HandlerReturnedAwaitable, is_async_handler
from tracker.client.message import MessageContext
from tracker.client.open_ranges import ACKED, DIVERGED, SENT, OpenRange, RangeBook
from tracker.client.ordering import Lanes, Ordering
from tracker.client.pool_config import PoolSettings, WorkerStats
from tracker.client.pool_source import TakenBatch
from tracker.client.workers import WorkerPool
from tracker.errors import ClientClosed, InvalidDelay
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker, MarkerKind
from tracker.protocol_v2 import RangeKind, RangeMarker
from tracker.testing import InMemoryMarkerSink

pytestmark = pytest.mark.unit

GROUP = "billing"
TOPIC = "orders"


class FakeBatches:
    """Hands over prepared batches like the consumer does, and writes markers in memory."""

    def __init__(self) -> None:
        self.sink = InMemoryMarkerSink()
        self.book = RangeBook(self.sink.send_later)
        self.context = MessageContext(GROUP, self.sink, self.book)
        self._batches: asyncio.Queue[TakenBatch] = asyncio.Queue()
        self.offsets: dict[int, int] = defaultdict(int)
        self.polls = 0  #: keep_alive calls

    def add(
        self, keys: Sequence[bytes | None], partition: int = 0, *, copies: bool = False
    ) -> list[KmqMessage]:
        """One batch on ``partition`` with these keys: first deliveries covered by a range, or
        (``copies``) redelivered copies settled per message."""
        first = self.offsets[partition]
        self.offsets[partition] += len(keys)
        records = [FakeRecord(TOPIC, partition, first + i, key=key) for i, key in enumerate(keys)]
        if copies:
            messages = [
                KmqMessage(record, self.context, None, MessageId(TOPIC, 9, record.offset), 2)
                for record in records
            ]
            batch = TakenBatch(messages, [], list(messages), time.monotonic())
        else:
            opened = OpenRange(GROUP, TOPIC, partition, first, len(keys), all_open=True)
            self.book.add(opened)
            messages = [KmqMessage(record, self.context, opened) for record in records]
            batch = TakenBatch(messages, [opened], [], time.monotonic())
        self._batches.put_nowait(batch)
        return messages

    async def take(self, wait_s: float) -> TakenBatch | None:
        try:
            return await asyncio.wait_for(self._batches.get(), wait_s)
        except TimeoutError:
            return None

    async def send_all(self, markers: Sequence[AnyMarker]) -> None:
        await self.sink.send_all(markers)

    def send_later(self, marker: AnyMarker) -> None:
        self.sink.send_later(marker)

    async def keep_alive(self) -> None:
        self.polls += 1

    def prefetched_extensions(self, lease_ms: int, older_than_s: float) -> list[AnyMarker]:
        return []  # batches wait in the queue unSTARTed here

    def v1(self, kind: MarkerKind) -> list[Marker]:
        self.book.flush()
        return [m for m in self.sink.v1 if m.kind is kind]

    def ranges(self, kind: RangeKind) -> list[RangeMarker]:
        self.book.flush()
        return [m for m in self.sink.markers if isinstance(m, RangeMarker) and m.kind is kind]


def pool_of(
    source: FakeBatches,
    handler: Callable[[KmqMessage], Any],
    *,
    concurrency: int = 4,
    ordering: Ordering = Ordering.UNORDERED,
    lease_ms: int = 30_000,
    max_processing_s: float = 30.0,
    drain_s: float = 5.0,
    blocking: bool | None = None,
    max_waiting: int | None = None,
    keepalive_s: float = 100.0,
) -> WorkerPool:
    return WorkerPool(
        source,
        HandlerCaller(handler, blocking=blocking, threads=concurrency),
        PoolSettings(
            concurrency=concurrency,
            ordering=ordering,
            lease_ms=lease_ms,
            max_processing_s=max_processing_s,
            drain_s=drain_s,
            max_waiting=2 * max(concurrency, 500) if max_waiting is None else max_waiting,
            keepalive_s=keepalive_s,
        ),
    )


async def run_until(pool: WorkerPool, done: Callable[[], bool]) -> WorkerStats:
    """Run the pool until ``done()``, then stop it and return its stats."""
    task = asyncio.create_task(pool.run())
    await until(lambda: done() or task.done())
    pool.request_stop()
    return await task


def acked(message: KmqMessage) -> bool:
    opened = message._range
    assert opened is not None
    return opened.flags[message.offset - opened.first] in (ACKED, SENT)


# -- lanes ----------------------------------------------------------------------------------


def test_a_lane_runs_one_item_at_a_time_in_the_order_added() -> None:
    lanes: Lanes[tuple[str, int]] = Lanes(lambda item: item[0])
    for item in [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", 2)]:
        lanes.add(item)
    assert (lanes.ready, lanes.waiting) == (2, 5)
    assert [lanes.pop_ready(), lanes.pop_ready(), lanes.pop_ready()] == [("a", 1), ("b", 1), None]
    lanes.done(("b", 1))
    assert lanes.pop_ready() == ("b", 2)
    lanes.done(("a", 1))
    assert lanes.pop_ready() == ("a", 2)
    assert lanes.pop_ready() is None  # ("a", 3) waits for ("a", 2)


def test_removing_a_lanes_ready_item_readies_the_next_one_left() -> None:
    lanes: Lanes[tuple[str, int]] = Lanes(lambda item: item[0])
    for item in [("a", 1), ("a", 2), ("a", 3), ("b", 1)]:
        lanes.add(item)
    taken = lanes.remove(lambda item: item in {("a", 1), ("a", 2)})
    assert sorted(taken) == [("a", 1), ("a", 2)]
    assert lanes.waiting == 2
    assert {lanes.pop_ready(), lanes.pop_ready()} == {("a", 3), ("b", 1)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "pop", "done"]), st.integers(0, 3)), max_size=60))
def test_lanes_never_run_two_items_of_a_lane_and_keep_each_lanes_order(
    steps: list[tuple[str, int]],
) -> None:
    """Model: whatever the interleaving of adds, starts and finishes, a lane has at most one
    item started and not done, and its items start in the order they were added; no key
    (``None`` lane, 0 here) is never held back."""
    lanes: Lanes[tuple[int, int]] = Lanes(lambda item: item[0] or None)
    running: list[tuple[int, int]] = []
    started: dict[int, list[int]] = defaultdict(list)
    added = 0
    for step, lane in steps:
        if step == "add":
            lanes.add((lane, added))
            added += 1
        elif step == "pop":
            item = lanes.pop_ready()
            if item is not None:
                assert item[0] == 0 or all(r[0] != item[0] for r in running)
                running.append(item)
                started[item[0]].append(item[1])
        elif running:
            lanes.done(running.pop(lane % len(running)))
    for lane, order in started.items():
        assert order == sorted(order), f"lane {lane} started out of order"
    assert lanes.waiting == added - sum(map(len, started.values()))


# -- handlers --------------------------------------------------------------------------------


async def _async_handler(message: KmqMessage) -> None:
    return None


class _AsyncCallable:
    async def __call__(self, message: KmqMessage) -> None:
        return None


def test_async_handlers_are_told_from_blocking_ones() -> None:
    assert is_async_handler(_async_handler)
    assert is_async_handler(functools.partial(_async_handler))
    assert is_async_handler(_AsyncCallable())
    assert not is_async_handler(print)
    assert not is_async_handler(lambda message: None)


def test_retry_message_checks_its_delay() -> None:
    with pytest.raises(InvalidDelay):
        RetryMessage("later", delay=timedelta(seconds=-1))
    with pytest.raises(InvalidDelay):
        RetryMessage("later", delay=5)  # type: ignore[arg-type]
    assert RetryMessage("later", delay=timedelta(seconds=5)).delay == timedelta(seconds=5)


# -- concurrency and order -------------------------------------------------------------------


async def test_unordered_runs_up_to_concurrency_handlers_and_never_more() -> None:
    source = FakeBatches()
    messages = source.add([b"k"] * 60) + source.add([b"k"] * 60, partition=1)
    now = 0
    most = 0

    async def handler(message: KmqMessage) -> None:
        nonlocal now, most
        now += 1
        most = max(most, now)
        await asyncio.sleep(0.002)
        now -= 1

    pool = pool_of(source, handler, concurrency=8)
    stats = await run_until(pool, lambda: all(map(acked, messages)))
    assert most == 8
    assert stats.most_in_progress == 8
    assert stats.acked == 120
    settled = source.ranges(RangeKind.RANGE_SETTLE)
    covered = {(m.partition, o) for m in settled for o in m.offsets()}
    assert covered == {(m.partition, m.offset) for m in messages}


async def test_key_order_runs_a_keys_messages_one_at_a_time_in_offset_order() -> None:
    source = FakeBatches()
    keys = [bytes([65 + (i * 7) % 5]) for i in range(100)]
    messages = source.add(keys[:50]) + source.add(keys[50:])
    busy: set[bytes] = set()
    order: dict[bytes, list[int]] = defaultdict(list)
    most = 0

    async def handler(message: KmqMessage) -> None:
        nonlocal most
        key = message.key
        assert key is not None
        assert key not in busy, "two messages of one key at once"
        busy.add(key)
        most = max(most, len(busy))
        order[key].append(message.offset)
        await asyncio.sleep(0.001 * (message.offset % 3))
        busy.discard(key)

    pool = pool_of(source, handler, concurrency=16, ordering=Ordering.KEY)
    await run_until(pool, lambda: all(map(acked, messages)))
    assert most == 5  # one per key, the five keys in parallel
    for key, offsets in order.items():
        assert offsets == sorted(offsets), key
    assert sum(map(len, order.values())) == 100


async def test_key_order_leaves_keyless_messages_unordered() -> None:
    source = FakeBatches()
    messages = source.add([None] * 10)
    running = 0
    most = 0

    async def handler(message: KmqMessage) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1

    await run_until(
        pool_of(source, handler, concurrency=10, ordering=Ordering.KEY),
        lambda: all(map(acked, messages)),
    )
    assert most == 10


async def test_partition_order_runs_partitions_in_parallel_and_each_in_order() -> None:
    source = FakeBatches()
    messages = source.add([b"a", b"b", b"c"], partition=0) + source.add([b"a", b"b"], partition=1)
    seen: list[tuple[int, int]] = []

    async def handler(message: KmqMessage) -> None:
        seen.append((message.partition, message.offset))
        await asyncio.sleep(0.005)

    await run_until(
        pool_of(source, handler, concurrency=8, ordering=Ordering.PARTITION),
        lambda: all(map(acked, messages)),
    )
    assert [o for p, o in seen if p == 0] == [0, 1, 2]
    assert [o for p, o in seen if p == 1] == [0, 1]
    assert seen[:2] == [(0, 0), (1, 0)]  # the two partitions started together


async def test_blocking_handlers_run_in_threads_up_to_concurrency() -> None:
    source = FakeBatches()
    messages = source.add([b"k"] * 24)
    lock = threading.Lock()
    now = most = 0
    threads: set[str] = set()

    def handler(message: KmqMessage) -> None:
        nonlocal now, most
        with lock:
            now += 1
            most = max(most, now)
            threads.add(threading.current_thread().name)
        time.sleep(0.01)
        with lock:
            now -= 1

    stats = await run_until(
        pool_of(source, handler, concurrency=4), lambda: all(map(acked, messages))
    )
    assert most == 4
    assert stats.acked == 24
    assert all(name.startswith("kmq-handler") for name in threads)


# -- outcomes --------------------------------------------------------------------------------


async def test_the_handlers_outcome_settles_the_message() -> None:
    source = FakeBatches()
    messages = source.add([b"a", b"b", b"c", b"d", b"e"])

    async def handler(message: KmqMessage) -> None:
        match message.offset:
            case 0:
                return
            case 1:
                raise ValueError("no such customer")
            case 2:
                raise RetryMessage("rate limited", delay=timedelta(seconds=5))
            case 3:
                raise RejectMessage("not JSON")
            case 4:
                await message.reject("rejected by the handler itself")
                raise RuntimeError("after settling: the handler's settling stands")

    stats = await run_until(
        pool_of(source, handler), lambda: all(m.settled is not None for m in messages)
    )
    assert [m.settled for m in messages] == [
        MarkerKind.ACK,
        MarkerKind.DELAY,
        MarkerKind.DELAY,
        MarkerKind.REJECT,
        MarkerKind.REJECT,
    ]
    delays = {m.message.offset: m for m in source.v1(MarkerKind.DELAY)}
    assert delays[1].reason == "ValueError: no such customer"
    assert delays[1].policy_delay  # the topic's backoff
    assert (delays[2].reason, delays[2].delay_ms) == ("rate limited", 5000)
    rejects = {m.message.offset: m.reason for m in source.v1(MarkerKind.REJECT)}
    assert rejects == {3: "not JSON", 4: "rejected by the handler itself"}
    assert (stats.acked, stats.retried, stats.rejected, stats.settled_by_handler) == (1, 2, 1, 1)
    # Only the acked offset is in a SETTLE: the diverged ones are settled per message.
    settles = source.ranges(RangeKind.RANGE_SETTLE)
    assert [o for m in settles for o in m.offsets()] == [0]


async def test_a_handler_running_past_max_processing_is_cancelled_and_retried() -> None:
    source = FakeBatches()
    messages = source.add([b"a", b"b"])
    cancelled = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        if message.offset == 0:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        if message.offset == 1:  # swallows its cancellation: still a time-out
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                return

    stats = await run_until(
        pool_of(source, handler, max_processing_s=0.1),
        lambda: all(m.settled is not None for m in messages),
    )
    assert cancelled.is_set()
    assert [m.settled for m in messages] == [MarkerKind.DELAY, MarkerKind.DELAY]
    assert stats.timed_out == 2
    assert all("longer than 0.1 s" in m.reason for m in source.v1(MarkerKind.DELAY))


async def test_a_handlers_own_timeout_is_an_ordinary_failure() -> None:
    source = FakeBatches()
    (message,) = source.add([b"a"])

    async def handler(message: KmqMessage) -> None:
        raise TimeoutError("the database did not answer")

    stats = await run_until(pool_of(source, handler), lambda: message.settled is not None)
    assert (stats.timed_out, stats.retried) == (0, 1)
    assert source.v1(MarkerKind.DELAY)[0].reason == "TimeoutError: the database did not answer"


# -- leases ----------------------------------------------------------------------------------


async def test_leases_are_renewed_per_batch_while_messages_wait_or_run() -> None:
    source = FakeBatches()
    messages = source.add([b"a", b"b", b"c"])
    release = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        if message.offset == 0:
            await release.wait()

    pool = pool_of(source, handler, concurrency=1, lease_ms=200)
    task = asyncio.create_task(pool.run())
    # One range EXTEND of the whole lease covers the running message and the two waiting.
    await until(lambda: len(source.ranges(RangeKind.RANGE_EXTEND)) >= 2)
    extends = source.ranges(RangeKind.RANGE_EXTEND)
    assert all(m.timeout_ms == 200 for m in extends)
    assert all(list(m.offsets()) == [0, 1, 2] for m in extends)
    assert not source.v1(MarkerKind.EXTEND)  # none per message
    release.set()
    await until(lambda: all(map(acked, messages)))
    renewed = len(source.ranges(RangeKind.RANGE_EXTEND))
    await asyncio.sleep(0.3)  # more than a renewal period: settled batches are not renewed
    assert len(source.ranges(RangeKind.RANGE_EXTEND)) == renewed
    pool.request_stop()
    stats = await task
    assert stats.renewals == renewed


# -- stopping and draining -------------------------------------------------------------------


async def test_stop_finishes_what_the_pool_holds_within_the_drain_timeout() -> None:
    source = FakeBatches()
    messages = source.add([b"k"] * 20)
    started = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        started.set()
        await asyncio.sleep(0.01)

    pool = pool_of(source, handler, concurrency=2, drain_s=10)
    task = asyncio.create_task(pool.run())
    await started.wait()
    pool.request_stop()
    stats = await task
    assert all(map(acked, messages))  # in progress and waiting ones alike
    assert (stats.acked, stats.released) == (20, 0)


async def test_after_the_drain_timeout_the_rest_goes_back_to_the_tracker() -> None:
    source = FakeBatches()
    messages = source.add([b"k"] * 6)
    started = 0
    cancelled: list[int] = []

    async def handler(message: KmqMessage) -> None:
        nonlocal started
        started += 1
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(message.offset)
            raise

    pool = pool_of(source, handler, concurrency=2, drain_s=0.05)
    task = asyncio.create_task(pool.run())
    await until(lambda: started == 2)
    pool.request_stop()
    stats = await task
    assert sorted(cancelled) == [0, 1]
    assert stats.released == 6
    assert all(m.settled is None for m in messages)
    released = source.ranges(RangeKind.RANGE_EXTEND)  # the waiting ones, then the cancelled
    assert {m.timeout_ms for m in released} == {1}
    assert sorted(o for m in released for o in m.offsets()) == list(range(6))
    assert not source.ranges(RangeKind.RANGE_SETTLE)
    # Given back: later renewals and SETTLEs leave them out.
    opened = messages[0]._range
    assert opened is not None
    assert set(opened.flags) == {DIVERGED}


async def test_a_revocation_drains_only_the_revoked_partitions() -> None:
    source = FakeBatches()
    revoked = source.add([b"a", b"b"], partition=0)
    kept = source.add([b"c", b"d"], partition=1)
    gate = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        if message.partition == 1:
            await gate.wait()
        else:
            await asyncio.sleep(0.01)

    pool = pool_of(source, handler, concurrency=4)
    task = asyncio.create_task(pool.run())
    await until(lambda: pool.stats.most_in_progress == 4)
    await pool.drain_partitions({(TOPIC, 0)}, 5.0)
    assert all(map(acked, revoked))
    assert not any(map(acked, kept))
    gate.set()
    await until(lambda: all(map(acked, kept)))
    pool.request_stop()
    await task


async def test_a_full_pool_takes_again_once_a_revocation_gave_its_waiting_messages_back() -> None:
    """The take loop waits for room, not for a job to finish: a revocation that gives the
    waiting messages back makes room while the one running handler goes on."""
    source = FakeBatches()
    source.add([b"a"], partition=1)
    waiting = source.add([b"b", b"c"], partition=0)
    gate = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        if message.partition == 1:
            await gate.wait()

    pool = pool_of(source, handler, concurrency=1, max_waiting=2)
    task = asyncio.create_task(pool.run())
    await until(lambda: pool.stats.most_in_progress == 1 and source._batches.empty())
    source.add([b"d"], partition=1)
    await pool.drain_partitions({(TOPIC, 0)}, 0.05)
    assert all(m.settled is None for m in waiting)  # given back to the tracker, never run
    # Without waiting for the running handler (or the 100 s keep-alive): the next batch.
    await until(source._batches.empty, within=2.0, what="the next batch taken")
    gate.set()
    pool.request_stop()
    await task


async def test_a_handlers_base_exception_stops_the_pool_and_loses_nothing() -> None:
    source = FakeBatches()
    messages = source.add([b"a", b"b", b"c", b"d"])

    async def handler(message: KmqMessage) -> None:
        if message.offset == 1:
            raise KeyboardInterrupt
        await asyncio.sleep(0.01)

    pool = pool_of(source, handler, concurrency=1)
    with pytest.raises(KeyboardInterrupt):
        await pool.run()
    # The interrupted message is given back (redelivered at once), the others drained.
    assert [m.settled for m in messages] == [MarkerKind.ACK, None, MarkerKind.ACK, MarkerKind.ACK]
    (released,) = source.ranges(RangeKind.RANGE_EXTEND)
    assert (released.timeout_ms, list(released.offsets())) == (1, [1])


async def test_a_blocking_handler_returning_a_coroutine_is_a_clear_error() -> None:
    source = FakeBatches()
    (message,) = source.add([b"a"])

    async def work(message: KmqMessage) -> None:
        return None

    pool = pool_of(source, work, blocking=True)  # told it blocks: returns a coroutine
    with pytest.raises(HandlerReturnedAwaitable, match="async def"):
        await pool.run()
    assert message.settled is None  # given back, not acked
    assert source.ranges(RangeKind.RANGE_EXTEND)[0].timeout_ms == 1


async def test_a_handler_that_returns_after_the_stop_cancelled_it_is_given_back_not_acked() -> None:
    """Cancelled at the end of the drain, a handler that swallows the cancellation and returns
    cannot be known to have finished: its message goes back to the tracker, and stop ends."""
    source = FakeBatches()
    (message,) = source.add([b"k"])

    async def handler(message: KmqMessage) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return

    pool = pool_of(source, handler, drain_s=0.05)
    task = asyncio.create_task(pool.run())
    await until(lambda: pool.stats.most_in_progress == 1)
    pool.request_stop()
    stats = await asyncio.wait_for(task, 5)
    assert message.settled is None
    assert (stats.acked, stats.released) == (0, 1)


async def test_a_handler_that_ignores_cancellation_does_not_hang_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers, "ABANDON_WAIT_S", 0.1)
    source = FakeBatches()
    (_message,) = source.add([b"k"])
    leave = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        while not leave.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await leave.wait()

    pool = pool_of(source, handler, drain_s=0.05)
    task = asyncio.create_task(pool.run())
    try:
        await until(lambda: pool.stats.most_in_progress == 1)
        pool.request_stop()
        stats = await asyncio.wait_for(task, 5)
        assert stats.released == 1
        assert source.ranges(RangeKind.RANGE_EXTEND)[0].timeout_ms == 1
    finally:
        leave.set()  # lets the abandoned handler end with the test


async def test_a_timed_out_handler_that_raises_instead_leaves_its_worker_sound() -> None:
    """The time-out's cancellation is taken back however the handler ends, so a later
    cancellation inside a handler (its own business) is a failure, not the worker's end."""
    source = FakeBatches()
    messages = source.add([b"a", b"b", b"c"])

    async def handler(message: KmqMessage) -> None:
        if message.offset == 0:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                raise RetryMessage("gave up") from None
        if message.offset == 1:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            future.cancel()
            await future  # a CancelledError that is not the pool's

    stats = await run_until(
        pool_of(source, handler, concurrency=1, max_processing_s=0.05),
        lambda: all(m.settled is not None for m in messages),
    )
    assert [m.settled for m in messages] == [MarkerKind.DELAY, MarkerKind.DELAY, MarkerKind.ACK]
    assert stats.timed_out == 1
    reasons = [m.reason for m in source.v1(MarkerKind.DELAY)]
    assert reasons[1] == "RuntimeError: the handler was cancelled"


async def test_a_timed_out_blocking_handler_keeps_its_lane_until_its_thread_returns() -> None:
    source = FakeBatches()
    messages = source.add([b"k", b"k"])
    release = threading.Event()
    running: list[int] = []
    lock = threading.Lock()
    overlap = False

    def handler(message: KmqMessage) -> None:
        nonlocal overlap
        with lock:
            overlap = overlap or bool(running)
            running.append(message.offset)
        if message.offset == 0:
            release.wait(5)
        with lock:
            running.remove(message.offset)

    pool = pool_of(source, handler, concurrency=4, ordering=Ordering.KEY, max_processing_s=0.05)
    task = asyncio.create_task(pool.run())
    await until(lambda: messages[0].settled is MarkerKind.DELAY)  # timed out: retried
    await asyncio.sleep(0.1)  # the second message must still wait for the thread
    assert messages[1].settled is None
    release.set()
    await until(lambda: acked(messages[1]))
    pool.request_stop()
    await task
    assert not overlap


async def test_released_copies_are_not_renewed_any_more() -> None:
    """A revocation gives back the waiting copies (1 ms EXTEND); later renewals of the batch
    cover the running one only."""
    source = FakeBatches()
    running, waiting = source.add([b"a", b"b"], copies=True)
    gate = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        await gate.wait()

    pool = pool_of(source, handler, concurrency=1, lease_ms=120)
    task = asyncio.create_task(pool.run())
    await until(lambda: pool.stats.most_in_progress == 1)
    await pool.drain_partitions({(TOPIC, 0)}, 0.0)
    extends = source.v1(MarkerKind.EXTEND)
    assert [(m.offset, m.timeout_ms) for m in extends if m.offset == waiting.offset] == [
        (waiting.offset, 1)
    ]
    count = len(extends)
    await until(lambda: len(source.v1(MarkerKind.EXTEND)) >= count + 2)  # renewals go on
    later = source.v1(MarkerKind.EXTEND)[count:]
    assert {m.offset for m in later} == {running.offset}
    gate.set()
    pool.request_stop()
    await task


async def test_a_full_pool_keeps_polling_without_taking() -> None:
    """Every slot busy and the wait list full: nothing is taken (nothing fetched), but the
    group still sees the member poll."""
    source = FakeBatches()
    source.add([b"k"] * 3)
    source.add([b"k"] * 3)
    gate = asyncio.Event()

    async def handler(message: KmqMessage) -> None:
        await gate.wait()

    pool = pool_of(
        source, handler, concurrency=1, ordering=Ordering.KEY, max_waiting=2, keepalive_s=0.02
    )
    task = asyncio.create_task(pool.run())
    await until(lambda: source.polls >= 3)
    assert source._batches.qsize() == 1  # the second batch was not taken
    gate.set()
    pool.request_stop()
    await task


async def test_stop_called_from_a_task_a_handler_started_does_not_wait_for_the_pool() -> None:
    source = FakeBatches()
    (_message,) = source.add([b"k"])
    pool: WorkerPool

    async def handler(message: KmqMessage) -> None:
        helper = asyncio.create_task(asyncio.sleep(0, pool.runs_here()))
        assert await helper
        pool.request_stop()

    pool = pool_of(source, handler)
    assert not pool.runs_here()
    stats = await asyncio.wait_for(pool.run(), 5)
    assert stats.acked == 1


# -- bad input -------------------------------------------------------------------------------


@pytest.fixture
async def consumer() -> AsyncIterator[KmqConsumer]:
    """A consumer never started (its aiokafka client is closed at the end)."""
    made = KmqConsumer(
        TOPIC, group_id=GROUP, bootstrap_servers="localhost:1", marker_sink=InMemoryMarkerSink()
    )
    yield made
    await made._close_clients()


async def _handler(message: KmqMessage) -> None:
    return None


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"concurrency": 0}, ValueError, "concurrency must be a positive integer"),
        ({"concurrency": -3}, ValueError, "concurrency must be a positive integer"),
        ({"concurrency": True}, ValueError, "concurrency must be a positive integer"),
        ({"concurrency": 2.5}, ValueError, "concurrency must be a positive integer"),
        ({"ordering": "fifo"}, ValueError, "ordering must be one of 'unordered', 'key'"),
        ({"max_processing": 5}, TypeError, "max_processing must be a datetime.timedelta"),
        ({"max_processing": timedelta(0)}, ValueError, "max_processing must be positive"),
        ({"max_processing": timedelta(days=60)}, ValueError, "under ~49 days"),
        ({"drain_timeout": timedelta(seconds=-1)}, ValueError, "drain_timeout"),
    ],
)
async def test_run_refuses_bad_settings_with_a_clear_error(
    consumer: KmqConsumer, kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        await consumer.run(_handler, **kwargs)


async def test_run_refuses_a_handler_that_is_not_callable_and_a_closed_consumer(
    consumer: KmqConsumer,
) -> None:
    with pytest.raises(TypeError, match="the handler must be callable, got str"):
        await consumer.run("handle")  # type: ignore[arg-type]
    with pytest.raises(ClientClosed):
        await consumer.run(_handler)
