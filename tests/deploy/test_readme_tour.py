"""The README's client quick tour runs, for real, and does what its comments say.

"A doc example that does not run is a bug": this test takes the ```python block of the README's
"Quick tour: the client" section as it is committed, changes only its addresses (bootstrap
servers, topic, group, markers topic: each literal must still be in the block, so a README edit
is noticed), supplies the reader's ``handle`` and runs ``main()`` against the test broker with a
real tracker. The consumer loop never ends on its own, so the test cancels it once the immediate
message was handled and the delayed one deferred, and checks that the consumer closed cleanly
(it flushes the pending ACK; any unclosed client would surface as a warning, and warnings are
errors here). Runs the same against a real Kafka: the block's consumer keeps aiokafka's default
10 s session timeout, above Kafka's 6 s minimum.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from integration.engine_support import FAST_GROUP, TopicWatcher, eventually, tracker_settings

from tracker.client import KmqProducer
from tracker.domain.entries import State
from tracker.ids import MessageId
from tracker.protocol import AnyMarker, Marker, MarkerKind, decode_marker
from tracker.protocol_v2 import RangeKind, RangeMarker
from tracker.runtime import create_tracker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TopicFactory = Callable[..., Awaitable[str]]

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Quick tour: the client"
NOW, LATER = b'{"id": 1}', b'{"id": 2}'
THREE_HOURS_MS = 3 * 3600 * 1000


def readme_python_block(heading: str, index: int = 0) -> str:
    """The ``index``-th ```python block of the README section ``heading``, at its README line
    numbers.

    (Padded with empty lines, so a traceback from the block points at the README's line.)
    """
    text = README.read_text(encoding="utf-8")
    start = text.find(f"\n{heading}\n")
    assert start >= 0, f"README.md has no {heading!r} section"
    section = re.split(r"\n## ", text[start + len(heading) + 2 :], maxsplit=1)[0]
    blocks = list(re.finditer(r"^```python\n(.*?)^```$", section, re.M | re.S))
    assert len(blocks) > index, f"README.md section {heading!r} lacks ```python block {index}"
    block = blocks[index]
    lines_before = text[: start + len(heading) + 2 + block.start(1)].count("\n")
    return "\n" * lines_before + block.group(1)


@contextlib.asynccontextmanager
async def running(coroutine: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``coroutine`` as a task; cancel it on the way out if the test did not."""
    task = asyncio.create_task(coroutine)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def substitute(source: str, replacements: dict[str, str]) -> str:
    for literal, value in replacements.items():
        assert literal in source, f"the README tour no longer contains {literal}: update this test"
        source = source.replace(literal, repr(value))
    return source


async def test_readme_client_tour_runs(
    kafka_bootstrap: str, topic_factory: TopicFactory, sqlite_url: str
) -> None:
    topic = await topic_factory(partitions=3, prefix="orders")
    markers = await topic_factory(partitions=4, prefix="markers")
    group = f"billing-{topic}"
    source = substitute(
        readme_python_block(SECTION),
        {
            '"localhost:9092"': kafka_bootstrap,
            '"orders"': topic,
            '"billing"': group,
            '"kmq-markers"': markers,
        },
    )
    handled: list[bytes] = []

    async def handle(value: bytes) -> None:  # the reader's application function
        handled.append(value)

    namespace: dict[str, Any] = {"__name__": "readme_tour", "handle": handle}
    exec(compile(source, str(README), "exec"), namespace)  # noqa: S102

    settings = tracker_settings(
        kafka_bootstrap, sqlite_url, markers, kafka_consumer_config=dict(FAST_GROUP)
    )
    produced_ms = time.time() * 1000
    async with (
        TopicWatcher(kafka_bootstrap, topic, markers) as seen,
        running(namespace["main"]()) as task,  # joins its group while the tracker joins its own
        create_tracker(settings) as tracker,
    ):

        def record(value: bytes) -> MessageId:
            (r,) = [r for r in seen.on(topic) if r.value == value]
            return MessageId(r.topic, r.partition, r.offset)

        def markers_of(value: bytes) -> list[AnyMarker]:
            """The markers about the message: v1 ones naming it, v2 ranges covering it."""
            about = record(value)
            decoded = [decode_marker(r.value) for r in seen.on(markers)]
            return [
                m
                for m in decoded
                if (isinstance(m, Marker) and m.origin == about)
                or (isinstance(m, RangeMarker) and about in set(m.messages()))
            ]

        async def delayed_is_tracked() -> bool:
            entries = await tracker.store.list_entries(group=group)
            return [(e.origin_offset, e.state) for e in entries] == [
                (record(LATER).offset, State.DELAYED)
            ]

        # Run the loop until the immediate message was handled and the delayed one deferred.
        await eventually(lambda: handled or task.done(), within=60, what="a message handled")
        assert not task.done(), f"main() ended on its own: {task.exception()!r}"
        await seen.wait_for(lambda _: len(seen.on(topic)) == 2, what="both messages on the topic")
        await eventually(delayed_is_tracked, what="the tracker to track the delayed message")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # and nothing else: the consumer closed
            await task
        gc.collect()  # a client the cancelled tour left open would warn now and fail this test

        # Closing flushed the ack that `processing()` made after `handle` returned: the batch's
        # RANGE_START, the message's own EXTEND, the batch's RANGE_SETTLE (protocol v2).
        await seen.wait_for(lambda _: len(markers_of(NOW)) == 3, what="START, EXTEND, SETTLE")
        start, extend, ack = markers_of(NOW)
        assert (start.kind, start.timeout_ms) == (RangeKind.RANGE_START, 30_000)  # the lease
        assert (extend.kind, extend.timeout_ms) == (MarkerKind.EXTEND, 300_000)  # renewed
        assert ack.kind is RangeKind.RANGE_SETTLE
        (defer,) = markers_of(LATER)
        assert isinstance(defer, Marker)
        assert defer.kind is MarkerKind.DELAY
        assert defer.deferred

        # Once the tracker has applied the SETTLE, it tracks only the delayed one, due in 3 h.
        ack_at = next(r for r in seen.on(markers) if decode_marker(r.value) == ack)

        async def ack_applied() -> bool:
            progress = await tracker.store.partition_offsets(markers)
            return progress.get(ack_at.partition, (0, -1))[1] > ack_at.offset

        await eventually(ack_applied, what="the tracker to apply the ACK")
        (entry,) = await tracker.store.list_entries(group=group)
        assert entry.origin_offset == record(LATER).offset
        assert entry.state is State.DELAYED
        assert entry.deferred
        assert entry.due_at_ms is not None
        assert 0 <= entry.due_at_ms - produced_ms - THREE_HOURS_MS < 60_000

    assert handled == [NOW]  # the delayed message was never handed over


async def test_readme_batch_form_runs(kafka_bootstrap: str, topic_factory: TopicFactory) -> None:
    """The README's batch form: every message handled, then settled by ranges only."""
    topic = await topic_factory(partitions=3, prefix="orders")
    markers = await topic_factory(partitions=4, prefix="markers")
    source = substitute(
        readme_python_block(SECTION, 1),
        {
            '"localhost:9092"': kafka_bootstrap,
            '"orders"': topic,
            '"billing"': f"billing-{topic}",
        },
    ).replace("bootstrap_servers=", f"markers_topic={markers!r}, bootstrap_servers=")
    handled: list[bytes] = []

    async def handle_all(values: list[bytes]) -> None:  # the reader's application function
        handled.extend(values)

    namespace: dict[str, Any] = {"__name__": "readme_batches", "handle_all": handle_all}
    exec(compile(source, str(README), "exec"), namespace)  # noqa: S102
    async with KmqProducer(kafka_bootstrap) as producer:
        for i in range(20):
            await producer.send(topic, f"job-{i}".encode())
    async with (
        TopicWatcher(kafka_bootstrap, markers) as seen,
        running(namespace["main"]()) as task,
    ):
        await eventually(lambda: len(handled) == 20 or task.done(), within=60, what="20 handled")
        assert not task.done(), f"main() ended on its own: {task.exception()!r}"

        def settled() -> set[tuple[int, int]]:
            return {
                (m.partition, offset)
                for m in (decode_marker(r.value) for r in seen.on(markers))
                if isinstance(m, RangeMarker) and m.kind is RangeKind.RANGE_SETTLE
                for offset in m.offsets()
            }

        await seen.wait_for(lambda _: len(settled()) == 20, what="20 offsets settled")
        decoded = [decode_marker(r.value) for r in seen.on(markers)]
        assert all(isinstance(m, RangeMarker) for m in decoded), "only range markers"
    assert sorted(handled) == sorted(f"job-{i}".encode() for i in range(20))


async def test_readme_worker_pool_form_runs(
    kafka_bootstrap: str, topic_factory: TopicFactory
) -> None:
    """The README's worker-pool form: each order charged once, many at once, one key at a
    time; the empty one dead-lettered, the declined one retried in a minute, the rest acked
    (by ranges); cancelling ``main()`` drains the pool and closes the consumer cleanly."""
    topic = await topic_factory(partitions=3, prefix="orders")
    markers = await topic_factory(partitions=4, prefix="markers")
    source = substitute(
        readme_python_block(SECTION, 2),
        {
            '"localhost:9092"': kafka_bootstrap,
            '"orders"': topic,
            '"billing"': f"billing-{topic}",
        },
    ).replace("bootstrap_servers=", f"markers_topic={markers!r}, bootstrap_servers=")
    charged: list[bytes] = []
    busy: set[bytes] = set()
    most = 0

    async def charge(order: bytes) -> bool:  # the reader's application function
        nonlocal most
        key = order.split(b":")[0]
        assert key not in busy, "two orders of one customer at once"
        busy.add(key)
        most = max(most, len(busy))
        await asyncio.sleep(0.05)
        busy.discard(key)
        charged.append(order)
        return order != b"c3:declined"

    namespace: dict[str, Any] = {"__name__": "readme_pool", "charge": charge}
    exec(compile(source, str(README), "exec"), namespace)  # noqa: S102
    orders = [f"c{i % 10}:order-{i}".encode() for i in range(40)] + [b"c3:declined"]
    async with KmqProducer(kafka_bootstrap) as producer:
        for order in orders:
            await producer.send(topic, order, key=order.split(b":")[0])
        await producer.send(topic, None, key=b"c4")
    async with (
        TopicWatcher(kafka_bootstrap, markers) as seen,
        running(namespace["main"]()) as task,
    ):
        await eventually(lambda: len(charged) == 41 or task.done(), within=60, what="41 charged")
        assert not task.done(), f"main() ended on its own: {task.exception()!r}"

        def markers_of() -> list[AnyMarker]:
            return [decode_marker(r.value) for r in seen.on(markers)]

        def settled() -> int:
            return sum(
                m.covered.bit_count()
                for m in markers_of()
                if isinstance(m, RangeMarker) and m.kind is RangeKind.RANGE_SETTLE
            )

        await seen.wait_for(lambda _: settled() == 40, what="40 orders acked by ranges")
        per_message = {
            m.kind: m
            for m in markers_of()
            if isinstance(m, Marker) and m.kind is not MarkerKind.START
        }
        assert per_message[MarkerKind.REJECT].reason == "empty payload"
        assert (per_message[MarkerKind.DELAY].reason, per_message[MarkerKind.DELAY].delay_ms) == (
            "card declined",
            60_000,
        )
    assert task.cancelled()
    assert sorted(charged) == sorted(orders)
    assert most > 1  # different customers at once
